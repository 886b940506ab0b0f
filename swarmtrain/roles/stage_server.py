"""`swarmtrain peer --role server`: a stage server, the stage it holds, its moves to the bottleneck stage, and
its taking of lost stages.

What a server holds of its stage (a `Holding`): the stage's blocks and their StageServer, the Pipeline
handler, the part's data plane (one node serves its calls, the all-reduce and the part's state) and the
part's outer rounds, opened (`_hold`) and closed (`_close`) as a unit.

One decision loop (`_decide`) runs the server: at each look it reads the live servers' records once, and
pure rules choose one of stay, move, rebuild or restore, carried out before the next look, so no two
switches ever race. Its looks are due at three periods: the lost-stage look every `discovery.heartbeat_s`
(at least a quarter of `lost_stage_grace_s`), the rebalancing look every `rebalance_period_s` (with
`pipeline.rebalance`), and the refresh of the stage copies every `stage_copy_period_s` (with
`pipeline.lost_stage = "checkpoint"`; a download that may take long, so it runs beside the loop). A lost
stage comes first: a rebuild changes the records the rebalancing rule would read.

Rebalancing applies the rule of rebalance.py. When the rule moves it to stage s:

1. it builds stage s's blocks and takes the stage's θ_global and outer momentum from servers of s
   (through its current node), checked against the hash most of them announce at their newest round, as
   a heal is; if none serves a state that checks out, it stays where it was;
2. it leaves the old stage: the old handler refuses new forwards (WrongStage: trainers re-send them to
   another server of the old stage) and answers the backwards of the forwards its old stage ran, for up
   to `rebalance_drain_s`; then it finishes the old part's round in flight and closes the old node.
   Gradients the old part accumulated toward an inner step it had not taken yet are dropped with it;
3. it serves stage s from the taken state on a new node, which listens where the old one did (`rpc.port`:
   one port, fixed where a firewall opens it), and its record names stage s at once. Should the new node
   not start, it serves its old stage again from its own state.

One `stage_move` line per move says why, with the figures it was decided on.

The lost-stage look finds a stage left without a live server (lost.py): when the rule names it the taker
(`pipeline.lost_stage = "neighbours"`), it builds the lost stage on a new node, starts it from the average of the two
neighbouring stages' θ_global (its own stage's and one taken from the other neighbour's servers,
checked like a heal), at the lost stage's last announced round + 1, and switches to it as in steps
2-3. With `pipeline.lost_stage = "checkpoint"` it keeps copies of its neighbouring stages' θ_global
(stage_copies.py, refreshed every `stage_copy_period_s`, announced in its record), and the spare server
holding the freshest copy of a lost stage restores it from that copy instead, any stage. One
`stage_rebuild` line says what the stage was rebuilt from.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmtrain.config import RunConfig
from swarmtrain.diloco.flat import param_shapes
from swarmtrain.discovery import PeerRecord, StageLoad
from swarmtrain.driver.part import CommittedState
from swarmtrain.peer.network import NetworkPlane, round_budget_s
from swarmtrain.peer.services import PeerError
from swarmtrain.pipeline.cut import stage_blocks
from swarmtrain.pipeline.decisions import Choice, Move, Rebuild, Restore, ServerRules, Stay, describe
from swarmtrain.pipeline.lost import (
    LostStageWatch,
    weighted_average,
)
from swarmtrain.pipeline.memory import MB, server_bytes
from swarmtrain.pipeline.outer import PartRounds
from swarmtrain.pipeline.parts import Stage, build_stage
from swarmtrain.pipeline.placement import fitting_stages, least_served_stage
from swarmtrain.pipeline.rebalance import Decision, Rebalancer, RebalanceRule
from swarmtrain.pipeline.server import StageServer, StageStats
from swarmtrain.pipeline.service import StageHandler, serve_stage
from swarmtrain.pipeline.stage_copies import StageCopies, fetch_stage_state
from swarmtrain.pipeline.tensors import TensorCodec
from swarmtrain.roles.part_role import PartRole
from swarmtrain.round.ballots import Voter
from swarmtrain.rpc.node import RpcNode
from swarmtrain.telemetry import LeaveEvent, StageMoveEvent, StageRebuildEvent, StageStepEvent

__all__ = ["Holding", "StageServerRole"]

log = logging.getLogger(__name__)

_TAKE_TRIES = 3  # a stage may commit a round while its state is taken: the hash read then no longer matches
_DRAIN_POLL_S = 0.05


@dataclass
class _Look:
    """One kind of look of the decision loop, due every `period_s`."""

    name: str
    period_s: float
    due: float  # time.monotonic()


@dataclass
class Holding:
    """Everything a server holds of one stage."""

    stage: int
    part: Stage
    server: StageServer
    handler: StageHandler
    plane: NetworkPlane
    node: RpcNode
    rounds: PartRounds
    since: float  # swarm clock: when this server took the stage
    last_step: tuple[int, float] = field(default=(0, 0.0))  # (step, monotonic) of its previous stage_step line


class StageServerRole(PartRole):
    role = "stage_server"

    def __init__(self, local: RunConfig, *, stage: int | None = None, **kw: Any) -> None:
        super().__init__(local, **kw)
        self.stage = stage
        self.holding: Holding | None = None
        self.server: StageServer | None = None
        self.handler: StageHandler | None = None
        self.moves = 0
        self._leaving: list[Holding] = []  # moved from, still answering backwards
        self._deciding: asyncio.Task[None] | None = None  # the decision loop
        self.copies: StageCopies | None = None  # pipeline.lost_stage = "checkpoint": made at start

    async def start(self) -> dict[str, Any]:
        discovery = await self._join_pipeline()
        cfg, pipe = self.cfg, self.cfg.pipeline
        n_layer = cfg.model.shape_value("n_layer")
        fitting = fitting_stages(cfg)
        if self.stage is None:
            peers = await discovery.live_peers(timeout_s=cfg.rpc.call_timeout_s)
            self.stage = least_served_stage(peers, n_layer=n_layer, stages=pipe.stages, allowed=fitting)
        if not 0 <= self.stage < pipe.stages:
            raise PeerError(f"--stage {self.stage}: this run has stages 0..{pipe.stages - 1}")
        if self.stage not in fitting:
            need = server_bytes(cfg.model, pipe, seq_len=cfg.data.seq_len)[self.stage]
            raise PeerError(f"stage {self.stage} needs {need / MB:.0f} MB to train, more than train.memory_budget_mb="
                            f"{cfg.train.memory_budget_mb} (stages that fit: {fitting})")
        holding = await self._hold(self.stage)
        self._adopt(holding)
        await holding.rounds.join()  # the stage's θ_global if its servers are past round 0
        await self._announce()
        holding.rounds.start()
        if pipe.lost_stage == "checkpoint":
            self.copies = StageCopies(cfg.model, stages=pipe.stages, max_donors=cfg.rpc.state_donors)
        self._deciding = asyncio.create_task(self._decide(fitting), name=f"stage-server-{discovery.peer_id}")
        blocks = stage_blocks(n_layer, pipe.stages)[self.stage]
        info = {"role": "server", "peer_id": discovery.peer_id, "endpoint": holding.node.endpoint,
                "run_id": cfg.train.run_id, "stage": self.stage, "blocks": [blocks.start, blocks.stop],
                "num_params": sum(p.numel() for p in holding.part.parameters()), **self._metrics_info()}
        self.writer.ready(info)
        return info

    async def _build(self, stage: int) -> Stage:
        cfg = self.cfg
        return await asyncio.to_thread(build_stage, cfg.model, stage, cfg.pipeline.stages, seed=cfg.train.seed)

    async def _hold(self, stage: int, *, resume_step: int = 0, part: Stage | None = None) -> Holding:
        """Stage `stage`'s blocks (`part`, else built) served on a new node, with their outer rounds (not started
        yet). A heal puts the schedule at the healed round's step, or at `resume_step` (the steps of a server
        that moved)."""
        assert self.discovery is not None
        cfg, pipe = self.cfg, self.cfg.pipeline
        part = part if part is not None else await self._build(stage)
        cell: list[Holding] = []
        server = StageServer(part, stage=stage, pipeline=pipe, inner=cfg.inner,
                             total_steps=cfg.diloco.rounds * cfg.diloco.inner_steps, seq_len=cfg.data.seq_len,
                             on_step=lambda stats: self._on_step(cell[0], stats))
        codec = TensorCodec(pipe.activation_codec,
                            max_shape=(pipe.microbatch_size, cfg.data.seq_len, cfg.model.shape_value("n_embd")))
        handlers: list[StageHandler] = []

        def serve(node: RpcNode) -> None:
            handlers.append(serve_stage(node, server, codec=codec))

        scoped, plane, node = await self._open_plane(part, scope=f"stage{stage}", role="stage_server", serve=serve,
                                                     member=lambda p: p.role == "stage_server" and p.stage == stage)
        h = cfg.diloco.inner_steps
        rounds = self._rounds(part, plane, scoped, stage=stage, moving=server.moving, apply_now=True,
                              role="stage_server", still=server.still,
                              on_heal=lambda r: server.resume_at(max(r * h, resume_step)))
        cell.append(Holding(stage, part, server, handlers[0], plane, node, rounds, since=self.discovery.now(),
                            last_step=(resume_step, time.monotonic())))
        return cell[0]

    def _adopt(self, holding: Holding) -> None:
        """Serve `holding` from now on: the record names its stage and endpoint at the next beat."""
        self.holding, self.stage = holding, holding.stage
        self.server, self.handler = holding.server, holding.handler
        self.plane, self.node, self.rounds = holding.plane, holding.node, holding.rounds

    def _record(self) -> PeerRecord:
        assert self.discovery is not None and self.holding is not None
        h = self.holding
        return PeerRecord(run_id=self.cfg.train.run_id, peer_id=self.discovery.peer_id, endpoint=h.node.endpoint,
                          role="stage_server", server=StageLoad(
                              stage=h.stage, latency_s=h.handler.latency_s, queue=h.handler.waiting,
                              service_s=h.handler.service_s, busy=h.handler.busy(self.cfg.pipeline.rebalance_period_s),
                              stage_since=h.since, copies=self.copies.announced() if self.copies else ()),
                          **self._part_fields())

    def _on_step(self, holding: Holding, stats: StageStats) -> None:  # on the server's compute thread, weights still
        if holding is self.holding:  # a stage it is leaving starts no more rounds
            holding.rounds.stepped()
        steps, at = holding.last_step
        now = time.monotonic()
        rate = self.cfg.pipeline.samples_per_step * (stats.step - steps) / max(now - at, 1e-9)
        holding.last_step = (stats.step, now)
        self.writer.emit(StageStepEvent(stage=stats.stage, step=stats.step, samples_per_s=round(rate, 3),
                                        forwards=stats.forwards, backwards=stats.backwards, refused=stats.refused,
                                        peer=self.discovery.peer_id if self.discovery else "", at=time.time()))

    # -- the decision loop ---------------------------------------------------------------------------
    async def _decide(self, fitting: Sequence[int]) -> None:
        """Look, choose, carry out, until the server leaves (see the module docstring)."""
        assert self.discovery is not None
        discovery, cfg, pipe = self.discovery, self.cfg, self.cfg.pipeline
        blocks = [len(b) for b in stage_blocks(cfg.model.shape_value("n_layer"), pipe.stages)]
        rebalancer = Rebalancer(RebalanceRule(margin=pipe.rebalance_margin, cooldown_s=pipe.rebalance_cooldown_s,
                                              observe_s=pipe.rebalance_observe_s), me=discovery.peer_id, blocks=blocks)
        rules = ServerRules(me=discovery.peer_id, stages=pipe.stages, blocks=blocks, fitting=fitting,
                            lost_stage=pipe.lost_stage, rebalancer=rebalancer if pipe.rebalance else None,
                            watch=LostStageWatch(stages=pipe.stages, grace_s=pipe.lost_stage_grace_s))
        now = time.monotonic()
        # A lost-stage look is a DHT read; a quarter of the grace is soon enough, and keeps the reads off the hot path
        lost_s = max(cfg.discovery.heartbeat_s, pipe.lost_stage_grace_s / 4)
        looks = [_Look("lost", lost_s, now + lost_s)]
        if pipe.rebalance:
            looks.append(_Look("rebalance", pipe.rebalance_period_s, now + pipe.rebalance_period_s))
        if self.copies is not None:  # the first soon after start, once the records have gone round
            looks.append(_Look("copies", pipe.stage_copy_period_s,
                               now + min(pipe.stage_copy_period_s, 2 * cfg.discovery.heartbeat_s)))
        refresh: asyncio.Task[None] | None = None
        try:
            while True:
                await asyncio.sleep(max(min(look.due for look in looks) - time.monotonic(), 0.0))
                now = time.monotonic()
                due = {look.name for look in looks if look.due <= now}
                for look in looks:
                    if look.name in due:
                        look.due = now + look.period_s
                try:
                    peers = await discovery.live_peers(timeout_s=cfg.rpc.call_timeout_s)
                except Exception as e:  # a slow control plane: look again at the next look
                    log.warning("stage server: could not list the live servers (%s)", e)
                    continue
                if "copies" in due and (refresh is None or refresh.done()):
                    refresh = asyncio.create_task(self._refresh_copies(peers))
                records = (self._record(), *(p for p in peers if p.peer_id != discovery.peer_id))  # its own: as of now
                choice = rules.choose(due, records, now=discovery.now())
                for warning in rules.warnings:
                    log.warning("%s", warning)
                rules.warnings.clear()
                await self._carry_out(choice)
        finally:
            if refresh is not None:
                refresh.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await refresh

    async def _carry_out(self, choice: Choice) -> None:
        """Switch as `choice` says; a switch that fails leaves the server on its stage (or back on it)."""
        try:
            match choice:
                case Stay(why):
                    if why:
                        log.debug("rebalancing: %s", why)
                case Move(decision):
                    await self._move(decision)
                case Restore(lost, lost_s, round_):
                    await self._restore(lost, lost_s=lost_s, round_=round_)
                case Rebuild(lost, pair, records, lost_s, round_):
                    await self._rebuild(lost, pair, records, lost_s=lost_s, round_=round_)
        except (PeerError, OSError, RuntimeError, ValueError) as e:  # a node that would not start, a torn transfer
            log.warning("%s failed (%s); staying on stage %s", describe(choice), e, self.stage)

    async def _move(self, d: Decision) -> None:
        """Take stage `d.move_to`'s state, switch to it, drain the old stage, close it (see the module doc)."""
        assert self.holding is not None and d.move_to is not None and self.discovery is not None
        old, target = self.holding, d.move_to
        start = time.monotonic()
        part = await self._build(target)
        shapes = param_shapes(part)
        taken = None
        for _ in range(_TAKE_TRIES):
            records = await self.discovery.live_peers(timeout_s=self.cfg.rpc.call_timeout_s)
            taken = await fetch_stage_state(old.plane, target, records, max_donors=self.cfg.rpc.state_donors,
                                            param_shapes=shapes, momentum=True)
            if taken is not None:
                break
        if taken is None:
            log.warning("rebalancing: no server of stage %d served a state that checks out; staying on stage %d",
                        target, old.stage)
            return
        state = taken[0]
        transfer_s = time.monotonic() - start
        new, switched_at, drain_s, unfinished = await self._switch(
            old, target, part, state.theta_global, round_=state.round, outer_momentum=state.outer_momentum,
            voters=state.voters, why=f"this server moved to stage {target}")
        self.writer.emit(StageMoveEvent(from_stage=old.stage, to_stage=target, reason=d.reason,
                                        capacity_per_s=d.capacity_per_s, load=d.load,
                                        predicted_per_s=d.predicted_per_s, round=new.rounds.round,
                                        hash=new.rounds.hash, transfer_s=round(transfer_s, 4),
                                        drain_s=drain_s, unfinished=unfinished, peer=self.discovery.peer_id,
                                        at=switched_at))

    async def _switch(self, old: Holding, stage: int, part: Stage, theta: torch.Tensor, *, round_: int,
                      outer_momentum: torch.Tensor | None, voters: Sequence[Voter] | None,
                      why: str) -> tuple[Holding, float, float, int]:
        """Leave `old` (refuse its new forwards, drain its backwards, close its node), then serve `stage` with
        `part` started from `theta` at `round_` on a new node, announced at once. The old node goes first: a
        server listens on one port (`rpc.port`, fixed where a firewall opens it), which the new node then takes.
        Returns the new holding, the unix time of the switch, the seconds drained and the micro-batches left
        undrained. If the new node cannot start, the server serves its old stage again from its own state.

        `voters` decide the new stage's next round: a moved-to stage's own (they came with its state), or None for
        a stage this server rebuilt, whose next round only it can decide (its voter alone) until others join."""
        assert self.discovery is not None
        self._leaving.append(old)
        old.handler.leave(why)
        old.rounds.stop_following()  # no heal or new round while it drains; a round in flight may still land
        drain_start = time.monotonic()
        unfinished = await self._drain(old)
        drain_s = time.monotonic() - drain_start
        await self._close(old)
        self._leaving.remove(old)
        try:
            new = await self._hold(stage, resume_step=old.server.step, part=part)
        except (PeerError, OSError, RuntimeError) as e:
            log.warning("could not serve stage %d (%s); serving stage %d again from this server's state", stage, e,
                        old.stage)
            mine = old.rounds.snapshot(momentum=True)  # closed, so its θ_global and momentum no longer change
            back = await self._hold(old.stage, resume_step=old.server.step)
            await self._install(back, mine.theta_global, round_=mine.round, outer_momentum=mine.outer_momentum,
                                voters=mine.voters, step=old.server.step)
            self._serve(back)
            raise
        await self._install(new, theta, round_=round_, outer_momentum=outer_momentum,
                            voters=voters if voters is not None else (Voter(self.discovery.peer_id,
                                                                            new.plane.incarnation),),
                            step=old.server.step)
        switched_at = self._serve(new)
        if self.heartbeat is not None:
            with contextlib.suppress(Exception):  # the next beat announces it anyway
                await self.heartbeat.beat()
        self.moves += 1
        return new, switched_at, round(drain_s, 4), unfinished

    @staticmethod
    async def _install(holding: Holding, theta: torch.Tensor, *, round_: int, outer_momentum: torch.Tensor | None,
                       voters: Sequence[Voter], step: int) -> None:
        def install() -> None:
            with holding.server.moving():
                holding.rounds.adopt(theta, round=round_, outer_momentum=outer_momentum, voters=voters)
                holding.server.resume_at(step)

        await asyncio.to_thread(install)

    def _serve(self, holding: Holding) -> float:
        """Serve `holding` from now on; the unix time of the switch."""
        assert self.discovery is not None
        holding.since = self.discovery.now()
        self._adopt(holding)
        holding.rounds.start()
        return time.time()

    async def _drain(self, old: Holding) -> int:
        """Wait until every forward the old stage ran had its backward (at most `rebalance_drain_s`); returns
        how many had not."""
        deadline = time.monotonic() + self.cfg.pipeline.rebalance_drain_s
        while True:
            held = old.server.stats().contexts
            if (held == 0 and old.handler.waiting == 0) or time.monotonic() >= deadline:
                return held
            await asyncio.sleep(_DRAIN_POLL_S)

    async def _close(self, holding: Holding) -> None:
        """Finish the holding's round in flight (bounded), retire its voter (this server leaves the stage for
        good: the departure record says so), stop its node and its compute thread."""
        with contextlib.suppress(Exception):
            await holding.rounds.finish(timeout_s=round_budget_s(self.cfg))
        await self._retire(holding.plane.scope, holding.rounds)
        await holding.plane.aclose()
        await asyncio.to_thread(holding.handler.close)

    # -- lost stages --------------------------------------------------------------------------------
    async def _refresh_copies(self, peers: Sequence[PeerRecord]) -> None:
        """Refresh the copies of the neighbouring stages from the servers in `peers` (beside the decision loop: a
        download may take long on a slow link, and a lost stage is not to wait for it). A switch meanwhile closes
        the plane (the download fails) or leaves copies of the old neighbours, which the next refresh drops; each
        copy stays a verified state of its stage."""
        holding, copies = self.holding, self.copies
        if holding is None or copies is None:
            return
        try:
            for c in await copies.refresh(own_stage=holding.stage, plane=holding.plane, records=peers):
                log.info("kept a copy of stage %d at round %d (%s) from %s", c.stage, c.round, c.state_hash[:12],
                         c.source)
        except Exception as e:  # a torn transfer: the old copies stay, refreshed at the next look
            log.warning("stage copies: could not refresh them (%s)", e)

    async def _restore(self, lost: int, *, lost_s: float, round_: int) -> None:
        """Start stage `lost` from this server's copy of it at round `round_` and switch to it (as a move does)."""
        assert self.holding is not None and self.discovery is not None
        copy = self.copies.get(lost) if self.copies else None
        if copy is None:  # dropped since the look (a move): another look decides again
            return
        old = self.holding
        start = time.monotonic()
        part = await self._build(lost)
        transfer_s = time.monotonic() - start
        age_s = time.monotonic() - copy.taken_at
        source = f"stage {lost} round {copy.round} {copy.state_hash[:12]} from {copy.source}, kept {age_s:.1f} s"
        new, switched_at, drain_s, unfinished = await self._switch(
            old, lost, part, copy.theta_global, round_=round_, outer_momentum=None, voters=None,
            why=f"this server took the lost stage {lost}")
        self.writer.emit(StageRebuildEvent(stage=lost, from_stage=old.stage, method="checkpoint", sources=(source,),
                                           weights=(1.0,), lost_s=round(lost_s, 3), round=new.rounds.round,
                                           hash=new.rounds.hash, transfer_s=round(transfer_s, 4), drain_s=drain_s,
                                           unfinished=unfinished, peer=self.discovery.peer_id, at=switched_at))

    async def _rebuild(self, lost: int, pair: tuple[int, int], records: Sequence[PeerRecord], *, lost_s: float,
                       round_: int) -> None:
        """Start stage `lost` from the average of its neighbours' θ_global at round `round_` and switch to it (as
        a move does)."""
        assert self.holding is not None and self.discovery is not None
        old = self.holding
        start = time.monotonic()
        part = await self._build(lost)
        shapes = param_shapes(part)
        taken = [await self._stage_state(k, old.plane, records, shapes=shapes) for k in pair]
        if any(t is None for t in taken):
            log.warning("lost stages: no server of stage %s served a state that checks out; stage %d stays unserved",
                        [k for k, t in zip(pair, taken, strict=True) if t is None], lost)
            return
        states = [t[0] for t in taken if t is not None]
        sources = tuple(f"stage {k} round {t[0].round} {t[0].digest[:12]} from {t[1]}"
                        for k, t in zip(pair, taken, strict=True) if t is not None)
        weights = (0.5, 0.5)  # no gradient norms in the records: CheckFree's weights are equal here
        theta = await asyncio.to_thread(weighted_average, [s.theta_global for s in states], weights)
        transfer_s = time.monotonic() - start
        new, switched_at, drain_s, unfinished = await self._switch(
            old, lost, part, theta, round_=round_, outer_momentum=None, voters=None,
            why=f"this server took the lost stage {lost}")
        self.writer.emit(StageRebuildEvent(stage=lost, from_stage=old.stage, method="neighbours", sources=sources,
                                           weights=weights, lost_s=round(lost_s, 3), round=new.rounds.round,
                                           hash=new.rounds.hash, transfer_s=round(transfer_s, 4), drain_s=drain_s,
                                           unfinished=unfinished, peer=self.discovery.peer_id, at=switched_at))

    async def _stage_state(self, stage: int, plane: NetworkPlane, records: Sequence[PeerRecord], *,
                           shapes: list[tuple[str, tuple[int, ...]]]) -> tuple[CommittedState, str] | None:
        """Stage `stage`'s θ_global (this server's own, or taken from its servers and checked against the hash
        most of them announce at their newest round), with who served it; None if none served one."""
        assert self.holding is not None and self.discovery is not None
        if stage == self.holding.stage:
            return self.holding.rounds.snapshot(), self.discovery.peer_id
        return await fetch_stage_state(plane, stage, records, max_donors=self.cfg.rpc.state_donors,
                                       param_shapes=shapes)

    # -- life ----------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> str:
        """Serve until `stop` (a server has no end of its own: the trainers decide when the run is over)."""
        await stop.wait()
        return "signal"

    async def aclose(self, reason: str) -> None:
        if self._deciding is not None:
            self._deciding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._deciding
        for holding in list(self._leaving):
            await self._close(holding)
        self._leaving.clear()
        step = self.server.step if self.server is not None else 0
        await super().aclose(reason)
        if self.handler is not None:
            await asyncio.to_thread(self.handler.close)
        self.writer.emit(LeaveEvent(round=step, reason=reason,
                                    peer=self.discovery.peer_id if self.discovery is not None else ""))

"""The peer daemon's composition root: discovery -> rpc -> averaging -> diloco, start/stop order.

Start: DHT node -> the run config from the coordinator's record -> worker (model, data, resume
from checkpoint) -> gRPC server (all-reduce shards, state transfer) -> heartbeat -> READY.
Each round: heal if the swarm is ahead, inner steps off the event loop (H of them, or with
`diloco.pace=time` a span shared by the group, whose matchmaking starts during the last steps),
average Δ, apply, print one round line, checkpoint, refresh the peer record in the background
(with `diloco.overlap` the average runs during the next round's first inner steps: overlap.py).
Stop (a signal via process.py, rounds done or an error): withdraw the peer record
(departure), checkpoint, close the data plane, stop the DHT.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from swarmtrain.averaging.group import Group
from swarmtrain.averaging.protocol import AverageResult
from swarmtrain.compress import Codec, codec_from_config
from swarmtrain.config import RunConfig, public_dict
from swarmtrain.data import eval_batches, load_corpus
from swarmtrain.data.evaluation import bits_per_byte, bytes_per_token, perplexity
from swarmtrain.data.tokenizer import load_tokenizer
from swarmtrain.diloco import DilocoWorker, resolve_device
from swarmtrain.diloco.flat import param_shapes
from swarmtrain.diloco.pace import Pace, RoundBudget
from swarmtrain.diloco.worker import InnerStats, InnerStep
from swarmtrain.discovery import (
    Discovery,
    DiscoveryError,
    Heartbeat,
    PeerRecord,
)
from swarmtrain.models import build_model
from swarmtrain.models.spec import check_run
from swarmtrain.peer.config import merge_run_config
from swarmtrain.peer.data import choose_shard, peer_batches, peer_seed, saved_slot
from swarmtrain.peer.healing import Healing
from swarmtrain.peer.heap import steps_heap
from swarmtrain.peer.joining import fetch_run_config
from swarmtrain.peer.membership import Membership
from swarmtrain.peer.overlap import OverlappedRounds
from swarmtrain.peer.presence import Presence
from swarmtrain.peer.rounds import LocalRoundError, PendingRound, group_reporter, interruptible
from swarmtrain.peer.services import DataPlane, PeerError, PeerServices, PeerState
from swarmtrain.peer.watching import Watching
from swarmtrain.pipeline.memory import check_worker_budget
from swarmtrain.round import Average, Finish, Heal, RoundMachine, Train, Wait
from swarmtrain.sync.checkpoint import (
    DirectoryClaim,
    LoadedCheckpoint,
    claim_directory,
    load_latest_checkpoint,
    save_checkpoint,
)
from swarmtrain.telemetry import EventWriter, LeaveEvent, RoundEvent, StatusSnapshot
from swarmtrain.telemetry.tally import Tally
from swarmtrain.trust import resolve_run_key

__all__ = ["DataPlane", "Peer", "PeerError", "PeerServices", "PeerState", "merge_run_config"]

log = logging.getLogger(__name__)

RUN_FETCH_TIMEOUT_S = 60.0


def _resume(worker: DilocoWorker, loaded: LoadedCheckpoint) -> None:
    try:
        worker.load_state_dict(loaded.tensors, loaded.meta["worker"])
    except (KeyError, ValueError) as e:
        raise PeerError(f"{loaded.path}: checkpoint does not fit this run (model or data layout): {e}") from e
    log.info("resumed from %s at round %d", loaded.path, worker.round)


class Peer(OverlappedRounds, Healing, Watching):
    """One DiLoCo peer of a swarm. `await start()`, `await run(stop)`, `await aclose(reason)`.

    `on_step` sees every inner step, on the training thread (the console progress display).
    """

    def __init__(self, local: RunConfig, *, writer: EventWriter, services: PeerServices,
                 local_overrides: Sequence[str] = (), coordinator_id: str | None = None,
                 on_step: Callable[[InnerStep], None] | None = None) -> None:
        self.local = local
        self.services = services
        self.writer = writer
        self.on_step = on_step
        self.local_overrides = tuple(local_overrides)
        self.coordinator_id = coordinator_id
        self.cfg: RunConfig = local
        self.discovery: Discovery | None = None
        self.worker: DilocoWorker | None = None
        self.pace = Pace(local.diloco)
        self.heartbeat: Heartbeat | None = None
        self._beat_task: asyncio.Task[None] | None = None
        self._clock_task: asyncio.Task[None] | None = None  # reads the others' clocks until this one agrees
        self._round_ends_at = 0.0  # swarm clock: when this round's inner steps should end (peer record)
        self.membership: Membership | None = None  # the electorate and this peer's departure
        self._join_by: tuple[int, float] | None = None  # (round healed into, monotonic time its steps end)
        self._prematching: asyncio.Future[None] | None = None  # the latest prematch a round's budget alarm started
        self.plane: DataPlane | None = None
        self.val_batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._val_bytes_per_token = 1.0  # of the validation text: val_loss in bits per byte
        self.endpoint = ""
        self.phase = "starting"
        self.last_loss: float | None = None
        self.last_val_loss: float | None = None
        self.rounds_committed = 0
        self.rounds_aborted = 0
        self.presence: Presence | None = None  # made once the run's discovery settings are known
        # (round, hash of θ_global) as last published: heartbeats announce this pair, never a θ half-way
        # through an outer step or a hash not computed yet
        self._announced: tuple[int, str] = (0, "")
        self._claim: DirectoryClaim | None = None
        self.tally, self.metrics = Tally(), ""  # its work so far (record stats, /metrics at `metrics`: host:port)
        writer.listeners.append(self.tally.observe)

    # ------------------------------------------------------------------ start

    async def start(self) -> dict[str, Any]:
        """Bring every service up in order; returns the READY payload (also printed)."""
        dcfg = self.local.discovery
        if self.local.checkpoint.dir:
            # One live peer per directory: it holds that peer's state and its identity key.
            self._claim = claim_directory(self.local.checkpoint.dir)
        if not dcfg.identity_path and self.local.checkpoint.dir:
            # A restarted peer keeps its peer id, so the swarm sees one peer come back, not a new one.
            dcfg = dataclasses.replace(dcfg, identity_path=str(Path(self.local.checkpoint.dir) / "identity.key"))
        discovery = await self.services.open_discovery(dcfg, run_id=self.local.train.run_id,
                                                       run_key=resolve_run_key(self.local.rpc.run_key))
        self.discovery = discovery
        # Resolved against this peer's own files: a model or tokenizer that differs from the run's is refused
        self.cfg = check_run(merge_run_config(await self._fetch_run(), self.local, local_overrides=self.local_overrides))
        check_worker_budget(self.cfg)
        if self.cfg.train.threads:
            torch.set_num_threads(self.cfg.train.threads)
        loaded = self._load_checkpoint()
        self.cfg = await choose_shard(self.cfg, discovery, saved=saved_slot(
            loaded.meta.get("worker") if loaded else None, num_shards=self.cfg.data.num_shards))
        self.pace = Pace(self.cfg.diloco)
        t = self.tally
        t.tokens_per_step, t.peer, t.role = self.cfg.data.batch_size * self.cfg.data.seq_len, discovery.peer_id, "worker"
        codec = codec_from_config(self.cfg.compress, seed=peer_seed(self.cfg.train.seed + 2, discovery.peer_id))
        worker = await asyncio.to_thread(self._build_worker, discovery.peer_id, codec)
        if loaded is not None:
            _resume(worker, loaded)
        # Only now: a peer leaves with a checkpoint of its worker, and one whose checkpoint did not
        # load must not write a fresh state over the run's newest.
        self.worker = worker
        self.plane = await self.services.open_data_plane(self.cfg, discovery=discovery, codec=codec,
                                                         param_shapes=param_shapes(self.worker.model))
        self.plane.serve_state(self._live_state)
        await self._publish_committed_state()
        self.endpoint = self.plane.endpoint
        self.membership = Membership(discovery, run_id=self.cfg.train.run_id, timeout_s=self.cfg.rpc.call_timeout_s)
        try:  # before its first round: a departure of this identity would let others not count it
            await discovery.rejoin(timeout_s=self.cfg.rpc.call_timeout_s)
        except DiscoveryError as e:
            raise PeerError(f"could not withdraw this identity's earlier departure from the DHT: {e}") from e
        self.heartbeat = Heartbeat(discovery, current=self._record, heartbeat_s=self.cfg.discovery.heartbeat_s,
                                   now=discovery.now, timeout_s=self.cfg.rpc.call_timeout_s)
        await self.heartbeat.start()
        self._clock_task = asyncio.create_task(self._settle_clock(), name=f"clock-{discovery.peer_id}")
        info = {"peer_id": discovery.peer_id, "endpoint": self.endpoint, "run_id": self.cfg.train.run_id,
                "maddrs": await self.services.visible_maddrs(discovery), "round": self.worker.round,
                "hash": self._announced[1], "num_params": self.worker.numel, **({"metrics": self.metrics} if self.metrics else {})}
        self.writer.ready(info)
        self.phase = "training"
        return info

    async def _fetch_run(self) -> RunConfig:
        assert self.discovery is not None
        return await fetch_run_config(self.discovery, self.local, coordinator_id=self.coordinator_id,
                                      timeout_s=RUN_FETCH_TIMEOUT_S)

    def _build_worker(self, peer_id: str, codec: Codec) -> DilocoWorker:
        cfg = self.cfg
        corpus = load_corpus(cfg.data)
        batches = peer_batches(cfg, corpus.train, peer_id)
        self.val_batches = eval_batches(corpus.val, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len,
                                        num_batches=cfg.diloco.eval_batches)
        self._val_bytes_per_token = bytes_per_token(self.val_batches, load_tokenizer(cfg.data.tokenizer))
        # every peer starts from the same θ
        model = build_model(cfg.model, seed=cfg.train.seed, activation_checkpointing=cfg.train.activation_checkpointing)
        return DilocoWorker(cfg, model=model, batches=batches, device=resolve_device(cfg.train.device),
                            codec=codec, rng_seed=peer_seed(cfg.train.seed + 1, peer_id), on_step=self.on_step)

    def _load_checkpoint(self) -> LoadedCheckpoint | None:
        """The newest good checkpoint in checkpoint.dir, if any; one of another run is an error."""
        if not self.cfg.checkpoint.dir:
            return None
        loaded = load_latest_checkpoint(self.cfg.checkpoint.dir)
        if loaded is None:
            return None
        if loaded.meta.get("run_id") != self.cfg.train.run_id:
            raise PeerError(f"{loaded.path}: checkpoint is of run {loaded.meta.get('run_id')!r}, "
                            f"not {self.cfg.train.run_id!r}; use another --checkpoint-dir")
        if loaded.meta.get("run_nonce", "") != self.cfg.train.run_nonce:
            raise PeerError(f"{loaded.path}: checkpoint is of another run of {self.cfg.train.run_id!r} (nonce "
                            f"{loaded.meta.get('run_nonce', '')!r}, this run's is {self.cfg.train.run_nonce!r}); "
                            "use another --checkpoint-dir")
        saved = (loaded.meta.get("run_config") or {}).get("model", {}).get("fingerprint", "")
        if saved and self.cfg.model.fingerprint and saved != self.cfg.model.fingerprint:
            raise PeerError(f"{loaded.path}: checkpoint is of another model (fingerprint {saved[:12]}, this run's "
                            f"{self.cfg.model.fingerprint[:12]}); use another --checkpoint-dir")
        return loaded

    def current_state(self, *, copy: bool = True) -> PeerState:
        """The state joiners download (call on the event loop: `apply` and heals run there). Without
        `copy` its tensors are the worker's own, valid until the next outer step or heal."""
        assert self.worker is not None
        momentum = self.worker.outer.state_tensors().get("momentum")
        theta = self.worker.theta_global.detach().cpu()

        def own(t: torch.Tensor) -> torch.Tensor:
            return t.clone() if copy else t

        return PeerState(round=self.worker.round, theta_global=own(theta),
                         outer_momentum=None if momentum is None else own(momentum.detach().cpu()),
                         state_hash=self.worker.global_hash(), members=self.worker.members,
                         version=self.worker.theta_version)

    @contextlib.contextmanager
    def _live_state(self) -> Iterator[PeerState]:
        """The committed state with the worker's own tensors, for a joiner's download: outer steps and
        heals wait until the block is left (the worker's global lock; called off the event loop)."""
        assert self.worker is not None
        with self.worker.global_lock:
            yield self.current_state(copy=False)

    def _record(self) -> PeerRecord:
        assert self.discovery is not None and self.worker is not None
        return PeerRecord(run_id=self.cfg.train.run_id, peer_id=self.discovery.peer_id,
                          endpoint="" if self.cfg.discovery.client_mode else self.endpoint, role="worker",
                          client_mode=self.cfg.discovery.client_mode, round=self._announced[0],
                          state_hash=self._announced[1], shard_index=self.cfg.data.shard_index,
                          round_ends_at=self._round_ends_at, clock_offset_s=self._presence().clock_offset_s,
                          stats=self.tally.stats())

    # ------------------------------------------------------------------ rounds

    async def run(self, stop: asyncio.Event) -> str:
        """Train until `diloco.rounds` rounds are committed or `stop` is set; returns why it ended.

        The round's decisions are the RoundMachine's (swarmtrain/round/machine.py); this loop performs
        its actions. A round that does not commit keeps its trained Δ: after waiting out the attempt it
        missed, the peer either heals (the swarm committed the round without it, so its local progress
        is dropped) or averages the same Δ again, without retraining.
        """
        assert self.worker is not None and self.plane is not None
        if self.cfg.diloco.overlap:
            return await self._run_overlapped(stop)
        worker = self.worker
        machine = self._round_machine(overlap=False)
        pending: PendingRound | None = None
        while True:
            if stop.is_set():
                machine.request_stop()
            action = machine.next()
            if isinstance(action, Finish):
                if action.reason == "done":
                    await self._linger_for_stragglers(stop)
                return action.reason
            if isinstance(action, Heal):
                await self._heal(machine, action)
            elif isinstance(action, Train):
                pending = None  # the last round's Δ, done with: never two in memory
                stats = await self._train_round(stop)
                if stats is None:
                    machine.stopped()
                    continue
                pending = PendingRound(round=worker.round, delta=await asyncio.to_thread(worker.delta_source),
                                       loss=stats.loss, compute_s=stats.compute_s, steps=stats.steps)
                # Checked once per trained Δ (a retry averages the same Δ again).
                problem = await asyncio.to_thread(worker.delta_problem, pending.delta)
                if problem:
                    self._abort_locally(pending, problem)
                machine.trained(problem=problem)
            elif isinstance(action, Average):
                assert pending is not None and pending.round == action.round
                try:
                    result = await self._average(pending, on_group=group_reporter(machine))
                except LocalRoundError as e:  # this peer's own Δ or code failed: the swarm goes on without it
                    self._abort_locally(pending, str(e))
                    machine.failed(reason=str(e))
                    continue
                machine.averaged(committed=result.committed, reason=result.reason, retry_at=result.retry_at,
                                 heal_to_hash=result.heal_to_hash)
                if result.committed:
                    pending = None  # Δ is in θ_global now; only an aborted round averages it again
                del result  # the mean's memory goes back to the pool before the next round needs it
            elif isinstance(action, Wait):
                await self._wait(machine, action, stop)
            else:
                raise AssertionError(f"the classic round loop cannot perform {action!r}")

    async def _wait(self, machine: RoundMachine, action: Wait, stop: asyncio.Event) -> None:
        """Perform the machine's wait and report it (both round loops)."""
        if await self._await_swarm_past(action.round, until=action.until, stop=stop):
            machine.waited()
        else:
            machine.stopped()

    def _round_machine(self, *, overlap: bool, unsent: bool = False) -> RoundMachine:
        assert self.worker is not None
        return RoundMachine(round_index=self.worker.round, rounds=self.cfg.diloco.rounds, clock=self._now,
                            overlap=overlap, unsent=unsent,
                            on_transition=lambda t: log.info("%s: %s", self._peer_id, t.line()))

    async def _train_round(self, stop: asyncio.Event) -> InnerStats | None:
        """One round's inner steps, as `diloco.pace` budgets them (None: `stop` came first).

        A timed round enters matchmaking shortly before its span ends (`RoundBudget.match_at_s`).
        """
        assert self.worker is not None and self.plane is not None
        await asyncio.to_thread(steps_heap)  # what the last round freed goes back before the inner steps allocate
        budget = self.pace.budget()
        join, self._join_by = self._join_by, None
        if join is not None and join[0] == self.worker.round:  # healed into a round under way: end with the swarm
            budget.cut_to(max(0.0, join[1] - time.monotonic()))
        match_at = budget.match_at_s()
        if match_at is not None:
            budget.set_alarm(match_at, self._prematch_alarm(budget))
        stats = await self._train(budget, stop)
        if stats is not None and budget.alarm is not None:  # the steps ran out before the alarm
            budget.alarm = None
            pace = self.pace
            await self.plane.prematch(self.worker.round, steps_per_s=pace.prematch_rate(budget), lag_s=pace.lag_s)
        return stats

    def _prematch_alarm(self, budget: RoundBudget, *, round_index: int | None = None,
                        loop: asyncio.AbstractEventLoop | None = None) -> Callable[[], None]:
        """What a time-paced round's budget calls on the training thread at `match_at_s`: start matchmaking
        for `round_index` (default: the worker's) on the loop. The training call runs on; ending it there
        to prematch cost a hand-off between threads and back every round, time in which nothing trained."""
        assert self.worker is not None and self.plane is not None
        loop, plane, pace = loop or asyncio.get_running_loop(), self.plane, self.pace
        round_index = self.worker.round if round_index is None else round_index

        def start(rate: float) -> None:
            self._prematching = asyncio.ensure_future(plane.prematch(round_index, steps_per_s=rate, lag_s=pace.lag_s))

        def alarm() -> None:  # the rate as measured now, on the training thread
            loop.call_soon_threadsafe(start, self.pace.prematch_rate(budget))

        return alarm

    async def _train(self, budget: RoundBudget, stop: asyncio.Event, *, max_steps: int = 0,
                     interrupt: threading.Event | None = None, between: Callable[[], bool] | None = None,
                     then: Callable[[], None] | None = None) -> InnerStats | None:
        """At least one inner step, off the loop, until `budget` is spent, `max_steps` ran, (when given)
        `interrupt` is set or `between` ends it (`DilocoWorker.train_inner`); then `then`, on the same
        thread. None if `stop` came first."""
        assert self.worker is not None
        worker, steps = self.worker, min(max(1, budget.steps_left()), max_steps or budget.max_steps)

        def run() -> InnerStats:
            stats = worker.train_inner(steps, budget=budget, interrupt=interrupt, between=between)
            if then is not None:
                then()
            return stats

        return await interruptible(asyncio.to_thread(run), stop)

    async def _settle(self, pending: PendingRound) -> AverageResult:
        assert pending.task is not None
        result, comm_s = await pending.task
        await self._conclude(pending, result, comm_s=comm_s)
        return result

    async def _linger_for_stragglers(self, stop: asyncio.Event) -> None:
        """Run done: keep serving state while a live peer is still behind the last round (bounded).

        A peer that missed the last round's window can only finish by healing from one that
        committed it; if every finisher left at once it would have no donor and retry alone forever.
        """
        a = self.cfg.averaging
        deadline = time.monotonic() + 2 * (a.matchmaking_timeout_s + a.allreduce_timeout_s) \
            + 4 * self.cfg.discovery.heartbeat_s
        self.phase = "lingering"

        def nobody_behind(peers: Sequence[PeerRecord]) -> bool:
            behind = [p.peer_id for p in peers if p.role == "worker" and p.round < self.cfg.diloco.rounds]
            if behind:
                log.info("run done; serving state until %s catch up", behind)
            return not behind

        await self._watch_peers(nobody_behind, deadline=deadline, stop=stop)

    async def _average(self, pending: PendingRound, *,
                       on_group: Callable[[Group], None] | None = None) -> AverageResult:
        """One averaging attempt of the pending round; applies, reports and checkpoints a commit.

        LocalRoundError when this peer's side of the all-reduce failed with an error of its own (a
        codec or a bug), not of the network.
        """
        assert self.plane is not None
        self.phase = "averaging"
        start = time.perf_counter()
        try:
            result = await self.plane.average(pending.round, pending.delta, steps_per_s=pending.steps_per_s,
                                              lag_s=self.pace.lag_s, electorate=await self._electorate(pending.round),
                                              on_group=on_group)
        except Exception as e:
            log.exception("round %d: the all-reduce failed on this peer", pending.round)
            raise LocalRoundError(f"local error in the all-reduce: {type(e).__name__}: {e}") from e
        await self._conclude(pending, result, comm_s=time.perf_counter() - start)
        return result

    async def _electorate(self, round_index: int) -> tuple[str, ...]:
        assert self.worker is not None and self.membership is not None
        return await self.membership.electorate(self.worker.members, round_index)

    def _abort_locally(self, pending: PendingRound, reason: str) -> None:
        """End this peer's attempt at a round for a fault of its own: report it, resync from θ_global.

        The round's local progress is dropped (θ_local ← θ_global, poisoned optimizer moments reset);
        the swarm commits the round without this peer, and the next heal check brings it back.
        """
        assert self.worker is not None
        log.warning("round %d aborted on this peer: %s; resynchronising from θ_global", pending.round, reason)
        self.worker.resync()
        self.phase = "training"
        self._after_round(pending.round, False, pending.loss, None)
        self.writer.emit(RoundEvent(
            round=pending.round, committed=False, members=(), loss=pending.loss, val_loss=None,
            hash=self.worker.global_hash(), bytes_sent=0, bytes_received=0, compute_s=round(pending.compute_s, 4),
            comm_s=0.0, peer=self._peer_id, reason=reason, steps=pending.steps, alone_s=self._presence().alone_s()))

    async def _conclude(self, pending: PendingRound, result: AverageResult, *, comm_s: float) -> None:
        """Apply a commit (or put an overlapped abort's Δ back), report the round, checkpoint on schedule."""
        # Off the loop (an outer step over θ takes seconds at 100M+ parameters) but never during inner
        # steps; heartbeats announce the previous (round, hash) until the new one is published.
        landed = result.committed or pending.carry is not None
        digest = await asyncio.to_thread(self._land, pending, result, comm_s=comm_s) if landed else None
        await self._report(pending, result, comm_s=comm_s, digest=digest)

    def _land(self, pending: PendingRound, result: AverageResult, *, comm_s: float,
              digest: bool = True) -> str | None:
        """`result` applied to the worker in one call off the loop (or between two inner steps, on the training
        thread, with `digest` False: `_report` hashes beside the steps): a commit's outer step, the pace it sets
        and the new θ_global's hash (returned); an overlapped abort's Δ back into θ_local (None)."""
        assert self.worker is not None
        self.worker.apply(result, carry=pending.carry)
        if not result.committed:
            return None
        self.pace.observe(result, peer_id=self._peer_id, comm_s=comm_s)
        self.pace.last_rate = pending.steps_per_s or self.pace.last_rate
        expected_s = self.pace.expected_round_s()
        self._round_ends_at = self._now() + expected_s if expected_s > 0 else 0.0
        return self.worker.global_hash() if digest else None

    async def _report(self, pending: PendingRound, result: AverageResult, *, comm_s: float,
                      digest: str | None) -> None:
        """After `_land`: announce the new θ_global (`digest`), score it on schedule, report the round (one
        line), checkpoint on schedule."""
        assert self.worker is not None
        worker = self.worker
        self.phase = "training"
        val_loss = None
        pending.delta = torch.empty(0) if result.committed else pending.delta  # a committed Δ's memory goes now
        self._presence().saw_others(len(result.members) - 1)
        if result.committed:
            await self._publish_committed_state(digest)
            self._beat_soon()  # now, not at the next tick: peers that missed the round look for it
            if self._due(worker.round)[0]:
                # Overlapped, θ_local holds newer steps than θ_global: score θ_global (two model copies).
                evaluate = worker.evaluate if pending.carry is None else worker.evaluate_global
                val_loss = await asyncio.to_thread(evaluate, self.val_batches)
        self._after_round(pending.round, result.committed, pending.loss, val_loss)
        self.writer.emit(RoundEvent(
            round=pending.round, committed=result.committed, members=result.members, loss=pending.loss,
            val_loss=val_loss, hash=worker.global_hash(), bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received, compute_s=round(pending.compute_s, 4), comm_s=round(comm_s, 4),
            peer=self._peer_id, reason=result.reason, steps=pending.steps,
            alone_s=0.0 if len(result.members) > 1 else self._presence().alone_s(),
            val_ppl=None if val_loss is None else perplexity(val_loss),
            val_bpb=None if val_loss is None else bits_per_byte(val_loss, bytes_per_token=self._val_bytes_per_token)))
        pending.compute_s, pending.steps = 0.0, 0  # a retry of the round reports only its own communication
        if result.committed and self._due(worker.round)[1]:
            await self._checkpoint()

    def _due(self, round_index: int) -> tuple[bool, bool]:
        """(evaluation, checkpoint): what reaching `round_index` by a commit brings, on schedule."""
        every = self.cfg.diloco.eval_every_rounds
        return bool(every and round_index % every == 0), round_index % self.cfg.checkpoint.every_rounds == 0

    async def _publish_committed_state(self, digest: str | None = None) -> None:
        """After θ_global changed: hash it once, off the event loop (unless `digest` is that hash), and announce it.

        Nothing changes θ_global meanwhile (outer steps and heals are awaited by the round loop). The
        hash is cached in the worker: round lines and checkpoints only read it, and heartbeats announce
        the (round, hash) pair published here. Joiners get the state itself through `_live_state`,
        serialized when they ask.
        """
        assert self.worker is not None and self.plane is not None
        if digest is None:
            digest = await asyncio.to_thread(self.worker.global_hash)
        state = self.current_state(copy=False)
        self.plane.publish_state(state)
        self._announced = (state.round, digest)

    def _now(self) -> float:
        assert self.discovery is not None
        return self.discovery.now()

    @staticmethod
    async def _wait_until(t_monotonic: float, stop: asyncio.Event) -> bool:
        """Sleep until `t_monotonic`; False if `stop` was set first."""
        delay_s = t_monotonic - time.monotonic()
        if delay_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay_s)
        return not stop.is_set()

    def _after_round(self, attempted: int, committed: bool, loss: float, val_loss: float | None) -> None:
        self.last_loss = loss if math.isfinite(loss) else None
        if committed:
            self.rounds_committed += 1
            self.last_val_loss = val_loss
        else:
            self.rounds_aborted += 1
            log.info("round %d aborted on %s", attempted, self._peer_id)

    def _beat_soon(self) -> None:
        """Publish the peer record in the background: a DHT store (~0.1 s) must not hold up the next round."""
        previous = self._beat_task

        async def beat() -> None:
            if previous is not None:
                await previous  # records land in the order they were made
            await self._beat()

        self._beat_task = asyncio.ensure_future(beat())

    async def _beat(self) -> None:
        # Publish the new round now, not at the next tick: laggards and joiners look for it.
        assert self.heartbeat is not None
        try:
            await self.heartbeat.beat()
        except Exception as e:  # the periodic beat retries; a failed early beat only delays visibility
            log.warning("peer record refresh failed: %s", e)

    # ------------------------------------------------------------------ stop

    async def _checkpoint(self) -> Path | None:
        if not self.cfg.checkpoint.dir or self.worker is None:
            return None
        # The worker's own tensors, no copies: nothing steps it until the save below returns.
        tensors, meta = self.worker.state_dict(copy=False)
        full_meta = {"run_id": self.cfg.train.run_id, "run_nonce": self.cfg.train.run_nonce,
                     "peer_id": self._peer_id, "worker": meta,
                     "hash": self.worker.global_hash(), "saved_unix_s": time.time(),
                     "run_config": public_dict(self.cfg)}  # what `swarmtrain export` rebuilds the model from
        return await asyncio.to_thread(save_checkpoint, self.cfg.checkpoint.dir, tensors=tensors, meta=full_meta,
                                       keep=self.cfg.checkpoint.keep)

    async def aclose(self, reason: str) -> None:
        """Leave: withdraw the peer record (departure), checkpoint, then stop rpc and the DHT."""
        self.phase = "leaving"
        path: Path | None = None
        if self._clock_task is not None:
            self._clock_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._clock_task
        if self._beat_task is not None:
            await self._beat_task  # bounded by the heartbeat's timeout; a record stored after the withdrawal
            # would announce a departed peer until it expires
        if self.heartbeat is not None:
            await self.heartbeat.aclose(withdraw=True)
        if self.membership is not None and self.worker is not None:
            await self.membership.announce_departure(self.worker.round)
        if self.worker is not None:
            try:
                path = await self._checkpoint()
            except Exception as e:
                log.error("checkpoint on leave failed: %s", e)
        sent = received = 0
        if self.plane is not None:
            await self.plane.aclose()  # drains first: serves the means its group still needs
            sent, received = self.plane.unreported_bytes()
        if self.worker is not None:
            self.writer.emit(LeaveEvent(round=self.worker.round, reason=reason, hash=self.worker.global_hash(),
                                        peer=self._peer_id, checkpoint=str(path or ""), bytes_sent=sent,
                                        bytes_received=received))
        if self.discovery is not None:
            await self.discovery.aclose()
        if self._claim is not None:
            self._claim.release()
        self.phase = "stopped"

    # ------------------------------------------------------------------ status

    @property
    def _peer_id(self) -> str:
        return self.discovery.peer_id if self.discovery is not None else ""

    def snapshot(self) -> StatusSnapshot:
        w = self.worker
        return StatusSnapshot(
            peer_id=self._peer_id, run_id=self.cfg.train.run_id, phase=self.phase, round=w.round if w else 0,
            state_hash=self._announced[1], loss=self.last_loss, val_loss=self.last_val_loss,
            rounds_committed=self.rounds_committed, rounds_aborted=self.rounds_aborted)

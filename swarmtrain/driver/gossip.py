"""The gossip driver (`averaging.mode = "gossip"`): a DiLoCo worker's rounds as NoLoCo runs them, each peer on
its own clock. No collective, no quorum, no shared θ_global: nobody waits for the swarm.

A round: the worker's inner steps; its part (Δ with the run's codec, φ with `averaging.gossip_weights_codec`)
published in this peer's mailbox (rpc/gossip_wire.py); its partners drawn from the live roster by the round's
seeded permutation (round/gossip_groups.py); each partner's part fetched, all at once, for at most
`averaging.gossip_timeout_s` (a partner that has not reached the round yet is waited for within that time);
the group's means formed from what arrived (diloco/noloco.py: a part that does not decode, is not finite or
does not fit is left out, one too large is clipped); the NoLoCo step applied; a round line with the
replicas' spread. A dead, frozen or lying partner costs this peer that partner's part of one round; one
whose part did not arrive is not waited for again until its record beats again.

A peer behind its roster's median round copies a live peer at that round (its state, checked against the
digest its record announces): a joiner at round 0 before its first round, any other once it is more than
LAG_ROUNDS behind (stopped for a while, or much slower than the others), since its partners no longer keep
the parts of its rounds. A partner whose record is that far from this peer's round is not waited for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol

import torch

from swarmtrain.compress import Codec, get_codec
from swarmtrain.config import RunConfig
from swarmtrain.diloco.averager import AverageResult
from swarmtrain.diloco.noloco import GroupMean, NolocoOuter, group_mean
from swarmtrain.diloco.worker import DilocoWorker
from swarmtrain.discovery import Discovery, PeerRecord
from swarmtrain.driver.part import CommittedState, Trained
from swarmtrain.round.gossip_groups import gossip_partners
from swarmtrain.rpc.errors import RpcError
from swarmtrain.rpc.gossip_wire import GossipClient, GossipMailbox, GossipPart
from swarmtrain.rpc.node import RpcNode
from swarmtrain.telemetry import HealEvent

__all__ = ["KEEP_ROUNDS", "LAG_ROUNDS", "GossipDriver", "not_waited_for"]

log = logging.getLogger(__name__)
KEEP_ROUNDS = 4  # rounds of parts a peer's mailbox keeps
LAG_ROUNDS = KEEP_ROUNDS - 1  # rounds a peer may be behind its roster's median before it copies a peer


def not_waited_for(drawn: Sequence[str], records: Mapping[str, PeerRecord], *, round_index: int,
                   silent: Mapping[str, float]) -> dict[str, str]:
    """The drawn partners not worth a wait this round, with why: one whose record is more than LAG_ROUNDS
    behind (it copies a peer before it reaches this round) or ahead (it no longer keeps this round's part),
    and one whose part did not arrive last time it was drawn and whose record has not beaten since (frozen
    or dead: a SIGSTOPped peer stays listed until its record expires, and would cost a whole
    `gossip_timeout_s` each round it is drawn)."""
    out = {}
    for p in drawn:
        rec = records[p]
        if abs(rec.round - round_index) > LAG_ROUNDS:
            out[p] = f"at round {rec.round}, too far from round {round_index}"
        elif p in silent and rec.heartbeat_at <= silent[p]:
            out[p] = "its part did not arrive last time, and its record has not beaten since"
    return out


class GossipWorker(Protocol):
    """What the gossip driver needs of its part (peer/part.py's WorkerPart)."""

    @property
    def worker(self) -> DilocoWorker: ...

    async def train(self, stop: asyncio.Event) -> Trained | None: ...

    async def adopt(self, state: CommittedState, *, keep_progress: bool = False) -> None: ...

    async def resync(self, reason: str) -> None: ...

    async def announce_now(self) -> None: ...

    async def report(self, trained: Trained | None, result: AverageResult, *, comm_s: float,
                     overlapped: bool = False, spread: float | None = None, wait_s: float | None = None) -> None: ...


class GossipDriver:
    """Runs `part`'s gossip rounds until `diloco.rounds` or `stop` (see the module docstring)."""

    def __init__(self, *, part: GossipWorker, cfg: RunConfig, codec: Codec, node: RpcNode, mailbox: GossipMailbox,
                 discovery: Discovery, fetch_state: Callable[[Sequence[str]], Coroutine[Any, Any, Any]],
                 emit: Callable[[HealEvent], None], changed: Callable[[], None]) -> None:
        self.part, self.cfg, self.codec = part, cfg, codec
        self.worker = part.worker
        self.node, self.mailbox, self.client = node, mailbox, GossipClient(node, run_id=cfg.train.run_id)
        self.discovery, self.fetch_state, self.emit, self.changed = discovery, fetch_state, emit, changed
        avg = cfg.averaging
        buf = self.worker.outer.momentum_buffer
        assert buf is not None, "a gossip worker allocates NoLoCo's momentum buffer (diloco/worker.py)"
        self.weights_codec = get_codec(avg.gossip_weights_codec, device=buf.device)  # where the round runs
        self.outer = NolocoOuter(lr=avg.gossip_lr, momentum=avg.gossip_momentum, buffer=buf)
        self.last_spread: float | None = None
        self._last_roster: tuple[PeerRecord, ...] = ()
        self._silent: dict[str, float] = {}  # partner -> its record's heartbeat when its part did not arrive
        self.partners_missed = 0  # partner parts of all rounds that did not arrive or were left out

    @property
    def peer_id(self) -> str:
        return self.discovery.peer_id

    async def run(self, stop: asyncio.Event) -> str:
        """Train and gossip until the run's rounds are done ("done") or `stop` is set ("signal")."""
        await self._catch_up(await self._roster())
        while self.worker.round < self.cfg.diloco.rounds:
            if stop.is_set():
                return "signal"
            trained = await self.part.train(stop)
            if trained is None:
                return "signal"
            await self.round(trained)
            await self._catch_up(self._last_roster)
        return "done"

    async def _roster(self) -> tuple[PeerRecord, ...]:
        try:
            peers = await self.discovery.live_peers(timeout_s=self.cfg.rpc.call_timeout_s)
        except Exception as e:  # no roster this round: train on alone
            log.warning("round %d: no roster (%s): this round takes no partner", self.worker.round, e)
            return ()
        return tuple(p for p in peers if p.role == "worker" and p.endpoint and p.peer_id != self.peer_id)

    async def _catch_up(self, roster: Sequence[PeerRecord]) -> None:
        """Copy a live peer's state when this peer is behind the roster's median round: a fresh peer (round 0)
        when the median is past 0, any other once it is more than LAG_ROUNDS behind (stopped for a while, or
        slow): its partners no longer hold the parts of its rounds, and it would train alone. The donors
        are the peers at the median round or past, nearest to it first (a record that claims a far round
        does not pull everyone to it); the state must have the digest the donor's record announces."""
        rounds = sorted(p.round for p in roster)
        if not rounds:
            return
        median, own = rounds[len(rounds) // 2], self.worker.round
        if median <= own + (0 if own == 0 else LAG_ROUNDS):
            return
        donors = sorted((p for p in roster if p.round >= median), key=lambda p: (p.round - median, p.peer_id))
        for donor in donors:
            started = time.monotonic()
            try:
                state, _ = await self.fetch_state([donor.endpoint])
            except Exception as e:
                log.warning("copying %s's state failed: %s", donor.peer_id, e)
                continue
            if state.digest != donor.state_hash:
                log.warning("%s served state %s, its record announces %s: refused", donor.peer_id,
                            state.digest[:12], donor.state_hash[:12])
                continue
            await self.part.adopt(state)
            self.emit(HealEvent(from_round=own, to_round=state.round, source=donor.peer_id, hash=state.digest,
                                peer=self.peer_id, transfer_s=round(time.monotonic() - started, 4)))
            return

    async def round(self, trained: Trained) -> GroupMean | None:
        """This peer's part of the round just trained: publish, fetch, average, step, report."""
        worker, round_index = self.worker, self.worker.round
        started = time.monotonic()
        delta = await asyncio.to_thread(worker.delta)
        problem = await asyncio.to_thread(worker.delta_problem, delta)
        if problem:
            await self.part.resync(problem)
            return None
        own = await asyncio.to_thread(self._encode, round_index, delta)
        await self.node.call(self.mailbox.publish(own))
        roster = self._last_roster = await self._roster()
        records = {p.peer_id: p for p in roster}
        drawn = gossip_partners(records, self.peer_id, round_index=round_index,
                                size=self.cfg.averaging.gossip_group_size, seed=self.cfg.train.seed)
        failed = not_waited_for(drawn, records, round_index=round_index, silent=self._silent)
        partners = [p for p in drawn if p not in failed]
        deadline = time.monotonic() + self.cfg.averaging.gossip_timeout_s
        max_bytes = 2 * (len(own.delta) + len(own.weights)) + (1 << 20)
        waiting = time.monotonic()
        fetched = await asyncio.gather(*(self.node.call(self.client.get_part(
            records[p].endpoint, round_index=round_index, numel=worker.numel, max_bytes=max_bytes,
            deadline=deadline)) for p in partners), return_exceptions=True)
        wait_s = time.monotonic() - waiting
        parts: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for peer, got in zip(partners, fetched, strict=True):
            if isinstance(got, BaseException):
                failed[peer] = str(got) if isinstance(got, RpcError | TimeoutError) else f"{type(got).__name__}: {got}"
                self._silent[peer] = records[peer].heartbeat_at  # not waited for again until it beats again
                continue
            self._silent.pop(peer, None)
            decoded = await asyncio.to_thread(self._decode, got)
            if isinstance(decoded, str):
                failed[peer] = decoded
                continue
            parts.append((peer, *decoded))
        mean = await asyncio.to_thread(group_mean, delta, worker.theta_global, parts,
                                       clip=self.cfg.averaging.gossip_clip)
        failed.update(mean.dropped)
        self.partners_missed += len(failed)
        try:
            await asyncio.to_thread(worker.gossip_step, lambda phi: self.outer.step(phi, mean.delta, mean.phi))
        except ValueError as e:  # a mean that is not finite after all: the step is skipped, φ unchanged
            await self.part.resync(f"gossip step: {e}")
            return None
        self.last_spread = mean.spread
        await self.part.announce_now()
        self.changed()
        reason = "; ".join(f"{p}: {why}" for p, why in failed.items())
        if mean.clipped:
            reason = "; ".join(x for x in (reason, f"clipped {', '.join(mean.clipped)}") if x)
        sent_bytes = (len(own.delta) + len(own.weights)) * self.mailbox.served_of(round_index)
        got_bytes = sum(len(g.delta) + len(g.weights) for g in fetched if isinstance(g, GossipPart))
        result = AverageResult(round=round_index, committed=True, mean=None, members=(self.peer_id, *mean.used),
                               bytes_sent=sent_bytes, bytes_received=got_bytes, reason=reason)
        await self.part.report(trained, result, comm_s=time.monotonic() - started, spread=mean.spread,
                               wait_s=wait_s)
        return mean

    def _encode(self, round_index: int, delta: torch.Tensor) -> GossipPart:
        with self.worker.global_lock:
            weights = self.weights_codec.encode(self.worker.theta_global)
        return GossipPart(round=round_index, peer_id=self.peer_id, numel=self.worker.numel,
                          delta_codec=self.codec.name, weights_codec=self.weights_codec.name,
                          delta=bytes(self.codec.encode(delta)), weights=bytes(weights))

    def _decode(self, part: GossipPart) -> tuple[torch.Tensor, torch.Tensor] | str:
        """A partner's (Δ, φ), or why its part cannot be used."""
        if part.delta_codec != self.codec.name or part.weights_codec != self.weights_codec.name:
            return (f"sent Δ as {part.delta_codec} and φ as {part.weights_codec}, the run uses {self.codec.name} "
                    f"and {self.weights_codec.name}")
        try:
            return self.codec.decode(part.delta).reshape(-1), self.weights_codec.decode(part.weights).reshape(-1)
        except (ValueError, RuntimeError) as e:  # CodecError is a ValueError
            return f"its part does not decode: {e}"

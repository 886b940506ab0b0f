"""FaultPlan: a deterministic table of faults keyed by (peer, round, call[, target]); CrashPlan: peers that crash
at such a site; and the wrappers that put them on production objects from outside (the all-reduce's and the
round decision's transports): no fault branch lives in the shipped code."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from swarmtrain.averaging.network import NetworkAverager
from swarmtrain.averaging.transport import Fetched, Payload, ReduceTransport
from swarmtrain.round.ballots import Ballot, MaterialLayout, Value
from swarmtrain.round.certificate import Certificate
from swarmtrain.round.group import Member
from swarmtrain.round.messages import AcceptReply, ConsensusTransport, Contact, LearnReply, PrepareReply
from swarmtrain.rpc.averaging_wire import PushHeader, SessionKey
from swarmtrain.rpc.errors import RpcRejected, RpcTimeout, RpcUnavailable
from swarmtrain.rpc.faults import Fault, FaultAction, FaultHook, FaultSite, corrupt, truncate
from swarmtrain.rpc.node import RpcNode

__all__ = ["CrashPlan", "FaultPlan", "FaultyConsensusTransport", "FaultyReduceTransport", "inject_faults"]

log = logging.getLogger(__name__)

CRASH_HANG_S = 3600.0  # what a crashed peer's own calls wait: it does nothing more
# Sites a peer serves (the site's peer answers the call): a crashed one is unreachable there at once.
SERVED = frozenset({"contributors", "mean", "mean_asked", "prepare", "accept", "learn", "state"})


@dataclass
class FaultPlan:
    """Answers `FaultHook` calls from a fixed table; records every site that fired.

    `add(peer="b", round=1, call="push", action="corrupt")` corrupts b's pushes in round 1 to every
    reducer; `target="c"` narrows it to pushes towards c. `times` bounds how often a rule fires
    (0 = always), so "drop the first push" does not also drop its retry when that matters.
    """

    _rules: list[tuple[FaultSite, Fault, int]] = field(default_factory=list)
    _fired: dict[int, int] = field(default_factory=dict)
    hits: list[tuple[FaultSite, Fault]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, *, peer: str, round: int, call: str, action: FaultAction, target: str = "", delay_s: float = 0.0,
            times: int = 0) -> FaultPlan:
        self._rules.append((FaultSite(peer, round, call, target), Fault(action, delay_s), times))
        return self

    def __call__(self, site: FaultSite) -> Fault | None:
        with self._lock:
            for i, (rule, fault, times) in enumerate(self._rules):
                if (rule.peer, rule.round, rule.call) != (site.peer, site.round, site.call):
                    continue
                if rule.target and rule.target != site.target:
                    continue
                if times and self._fired.get(i, 0) >= times:
                    continue
                self._fired[i] = self._fired.get(i, 0) + 1
                self.hits.append((site, fault))
                return fault
        return None


class CrashPlan:
    """A `FaultHook` that crashes peers: when a crash site fires, the peer's `RpcNode` closes (its server
    stops answering and its own all-reduce is cancelled, as when its process dies) and the call at that
    site never answers. Other sites go to `plan`. Give it the nodes (`nodes[peer_id]`) before the round.
    """

    def __init__(self, plan: FaultPlan | None = None) -> None:
        self.plan = plan if plan is not None else FaultPlan()
        self.nodes: dict[str, RpcNode] = {}
        self.crashed: list[FaultSite] = []
        self._sites: list[tuple[FaultSite, int]] = []  # (site, the how-many-th time it is reached)
        self._reached: dict[int, int] = {}
        self._lock = threading.Lock()

    def crash(self, *, peer: str, round: int, call: str, target: str = "", nth: int = 1) -> CrashPlan:
        """`peer` crashes the `nth` time it reaches `call` in `round` (towards `target`, or any). The calls
        `mean_asked` is reached when a member's request for a mean reaches its reducer (after any delay of
        `mean`), `mean_served` and `contributors_served` once a reducer's answer has reached the member that
        asked for it."""
        self._sites.append((FaultSite(peer, round, call, target), nth))
        return self

    def _due(self, site: FaultSite) -> bool:
        due = False
        for i, (s, nth) in enumerate(self._sites):
            if (s.peer, s.round, s.call) == (site.peer, site.round, site.call) and s.target in ("", site.target):
                self._reached[i] = self._reached.get(i, 0) + 1
                due = due or self._reached[i] == nth
        return due

    def __call__(self, site: FaultSite) -> Fault | None:
        with self._lock:
            gone = site.peer in {s.peer for s in self.crashed}
            due = not gone and self._due(site)
            if due:
                self.crashed.append(site)
        dead = Fault("unreachable") if site.call in SERVED else Fault("delay", CRASH_HANG_S)
        if gone:
            return dead  # a dead peer answers nothing and does nothing more (its own calls hang until cancelled)
        if not due:
            return self.plan(site)
        # Possibly called on a node's loop: close the crashing one from another thread (close joins its loop).
        threading.Thread(target=self.nodes[site.peer].close, name=f"crash-{site.peer}", daemon=True).start()
        return dead


def _left(deadline: float) -> float:
    return deadline - asyncio.get_running_loop().time()


async def _delayed(fault: Fault, deadline: float, what: str) -> None:
    """A delay fault, bounded by the call's deadline (a held call times out as a slow peer's would)."""
    wait = min(fault.delay_s, max(0.0, _left(deadline)))
    await asyncio.sleep(wait)
    if wait < fault.delay_s:
        raise RpcTimeout(f"DEADLINE_EXCEEDED: {what} held by fault injection")


class FaultyReduceTransport:
    """The all-reduce's transport of member `peer` (averaging/transport.py) with a FaultPlan's faults: pushes
    at site (member, round, "push", reducer) can be dropped, delayed, corrupted or truncated; a reducer's
    answers at (reducer, round, "contributors" / "mean", member) delayed or refused."""

    def __init__(self, inner: ReduceTransport, faults: FaultHook, *, peer: str) -> None:
        self.inner = inner
        self.faults = faults
        self.peer = peer

    async def push(self, reducer: Member, header: PushHeader, payload: Payload, *, deadline: float) -> None:
        fault = self.faults(FaultSite(self.peer, header.session.round, "push", reducer.peer_id))
        if fault is not None:
            log.warning("%s: fault %s on push of shard %d to %s", self.peer, fault.action, header.shard,
                        reducer.peer_id)
            if fault.action == "drop":
                return
            if fault.action == "delay":
                await asyncio.sleep(fault.delay_s)
            payload = corrupt(payload) if fault.action == "corrupt" else payload
            payload = truncate(payload) if fault.action == "truncate" else payload
        await self.inner.push(reducer, header, payload, deadline=deadline)

    async def _reducer_fault(self, reducer: Member, round_index: int, call: str, deadline: float) -> None:
        fault = self.faults(FaultSite(reducer.peer_id, round_index, call, self.peer))
        if fault is None:
            return
        if fault.action == "delay":
            await _delayed(fault, deadline, f"{call} of {reducer.peer_id}")
        elif fault.action == "drop":
            raise RpcRejected("FAILED_PRECONDITION", "dropped by fault injection")
        elif fault.action == "unreachable":
            raise RpcUnavailable(f"UNAVAILABLE: {reducer.peer_id} is gone (fault injection)")

    async def contributors(self, reducer: Member, key: SessionKey, shard: int, *,
                           deadline: float) -> tuple[str, ...]:
        await self._reducer_fault(reducer, key.round, "contributors", deadline)
        names = await self.inner.contributors(reducer, key, shard, deadline=deadline)
        self.faults(FaultSite(reducer.peer_id, key.round, "contributors_served", self.peer))  # a crash site only
        return names

    async def fetch(self, reducer: Member, key: SessionKey, shard: int, contributors: tuple[str, ...], *,
                    max_bytes: int, deadline: float) -> Fetched:
        await self._reducer_fault(reducer, key.round, "mean", deadline)
        await self._reducer_fault(reducer, key.round, "mean_asked", deadline)  # a crash site, after mean's delay
        data = await self.inner.fetch(reducer, key, shard, contributors, max_bytes=max_bytes, deadline=deadline)
        self.faults(FaultSite(reducer.peer_id, key.round, "mean_served", self.peer))  # a crash site only
        return data


class FaultyConsensusTransport:
    """The round decision's transport of `peer` (round/messages.py) with a FaultPlan's faults at the voter's
    sites (voter, round, "prepare" / "accept" / "learn", caller): delayed (bounded by the call's deadline) or
    refused."""

    def __init__(self, inner: ConsensusTransport, faults: FaultHook, *, peer: str) -> None:
        self.inner = inner
        self.faults = faults
        self.peer = peer

    async def _fault(self, to: Contact, round_index: int, call: str, timeout_s: float) -> None:
        fault = self.faults(FaultSite(to.peer_id, round_index, call, self.peer))
        if fault is None:
            return
        if fault.action == "delay":
            await _delayed(fault, asyncio.get_running_loop().time() + timeout_s, f"{call} of {to.peer_id}")
        elif fault.action == "drop":
            raise RpcRejected("FAILED_PRECONDITION", "dropped by fault injection")
        elif fault.action == "unreachable":
            raise RpcUnavailable(f"UNAVAILABLE: {to.peer_id} is gone (fault injection)")

    async def prepare(self, to: Contact, *, scope: str, round_index: int, ballot: Ballot,
                      timeout_s: float) -> PrepareReply:
        await self._fault(to, round_index, "prepare", timeout_s)
        return await self.inner.prepare(to, scope=scope, round_index=round_index, ballot=ballot, timeout_s=timeout_s)

    async def accept(self, to: Contact, *, scope: str, round_index: int, ballot: Ballot, value: Value,
                     holders: Sequence[Contact], timeout_s: float) -> AcceptReply:
        await self._fault(to, round_index, "accept", timeout_s)
        return await self.inner.accept(to, scope=scope, round_index=round_index, ballot=ballot, value=value,
                                       holders=holders, timeout_s=timeout_s)

    async def learn(self, to: Contact, *, scope: str, round_index: int, timeout_s: float) -> LearnReply:
        await self._fault(to, round_index, "learn", timeout_s)
        return await self.inner.learn(to, scope=scope, round_index=round_index, timeout_s=timeout_s)

    async def material(self, to: Contact, *, scope: str, layout: MaterialLayout, shard: int,
                       timeout_s: float) -> bytes | bytearray | memoryview:
        return await self.inner.material(to, scope=scope, layout=layout, shard=shard, timeout_s=timeout_s)

    async def certificates(self, to: Contact, *, scope: str, from_round: int,
                           timeout_s: float) -> tuple[Certificate, ...]:
        return await self.inner.certificates(to, scope=scope, from_round=from_round, timeout_s=timeout_s)


def inject_faults(averager: NetworkAverager, faults: FaultHook) -> None:
    """Put `faults` on the transports of `averager` (its all-reduce, its proposer and learner, its fetches)."""
    peer = averager.node.peer_id
    averager.allreduce.transport = FaultyReduceTransport(averager.allreduce.transport, faults, peer=peer)
    consensus = FaultyConsensusTransport(averager.decider.transport, faults, peer=peer)
    averager.decider.transport = consensus
    averager.fetcher.transport = consensus

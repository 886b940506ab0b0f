"""The simulated data plane: peers' services reached by calls that take seeded latencies, can be dropped,
cut by a partition, stalled by a frozen peer and lost with a crashed one; and the transports of the all-reduce,
the round's decision and state transfer over it (the production code's seams, testing/ side).

A call runs its handler as a task of the *called* node, so a crash of that node cancels it as the death of
its process would, and its caller sees the peer unreachable. A handler's refusal (`Rejected`) reaches the
caller as the rpc layer's `RpcRejected`, as over gRPC; any other exception of a handler is a bug, kept in
`SimNetwork.bugs` for the checker and surfacing to the caller as a broken link.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from swarmtrain.averaging.transport import Fetched
from swarmtrain.averaging.voting import VoterService
from swarmtrain.driver.part import CommittedState
from swarmtrain.round.ballots import Ballot, MaterialLayout, Value
from swarmtrain.round.certificate import Certificate
from swarmtrain.round.group import Member
from swarmtrain.round.messages import AcceptReply, Contact, LearnReply, PrepareReply
from swarmtrain.rpc.averaging_wire import PushHeader, ReducerSink, SessionKey
from swarmtrain.rpc.errors import Rejected, RpcRejected, RpcTimeout, RpcUnavailable, status_name

__all__ = ["SimConsensusTransport", "SimNetwork", "SimNode", "SimReduceTransport", "SimStates"]

T = TypeVar("T")
Payload = bytes | bytearray | memoryview


@dataclass
class SimNode:
    """One peer's served side: its reducer, its voter, its committed state."""

    peer_id: str
    endpoint: str
    reducer: ReducerSink | None = None
    voter: VoterService | None = None
    state: Callable[[], AbstractContextManager[CommittedState]] | None = None
    alive: bool = True
    frozen_until: float = 0.0
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    def spawn(self, coro: Awaitable[T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that gave up waiting is not told, as over a real network

    def kill(self) -> None:
        self.alive = False
        for task in list(self.tasks):
            task.cancel()


class SimNetwork:
    """Nodes by endpoint; links between peer ids, cut by `partition` (sides) until `heal`."""

    def __init__(self, *, rng: random.Random, latency_s: tuple[float, float] = (0.002, 0.03),
                 drop: float = 0.0, access_s: dict[str, float] | None = None) -> None:
        """A call's leg takes a uniform draw from `latency_s`, or with `access_s` (peer id -> its access link's
        one-way delay) the two ends' delays added: peer i to peer j takes access_s[i] + access_s[j] each way."""
        self.rng = rng
        self.latency_s = latency_s
        self.access_s = access_s
        self.drop = drop
        self.nodes: dict[str, SimNode] = {}
        self._side: dict[str, int] = {}
        self.frozen: dict[str, float] = {}  # peer id -> loop time it thaws at
        self.bugs: list[str] = []
        self.calls = 0
        # Called as a call's answer reaches its caller, with (caller, callee node, the call's tag):
        # the seam for faults timed to one message (a reducer dying right after serving one member its mean).
        self.answered: list[Callable[[str, SimNode, object], None]] = []

    def add(self, node: SimNode) -> None:
        self.nodes[node.endpoint] = node

    def partition(self, sides: Sequence[Sequence[str]]) -> None:
        self._side = {p: i for i, side in enumerate(sides) for p in side}

    def heal(self) -> None:
        self._side = {}

    def linked(self, a: str, b: str) -> bool:
        sa, sb = self._side.get(a), self._side.get(b)
        return a == b or sa is None or sb is None or sa == sb

    def _latency(self, a: str, b: str) -> float:
        if self.access_s is not None:
            return self.access_s.get(a, 0.0) + self.access_s.get(b, 0.0)
        lo, hi = self.latency_s
        return lo + (hi - lo) * self.rng.random()

    async def thawed(self, peer_id: str) -> None:
        """Wait while `peer_id` is frozen (a SIGSTOPped process does nothing, and answers nothing)."""
        loop = asyncio.get_running_loop()
        while (until := self.frozen.get(peer_id, 0.0)) > loop.time():
            await asyncio.sleep(until - loop.time())

    async def call(self, src: str, endpoint: str, fn: Callable[[SimNode], Awaitable[T]], *, timeout_s: float,
                   tag: object = None) -> T:
        """`fn(node)` on the node at `endpoint`, as `src` calling it over the network (see the module docstring);
        `tag` names the call for `answered`."""
        self.calls += 1
        try:
            return await asyncio.wait_for(self._call(src, endpoint, fn, tag), timeout=max(timeout_s, 1e-3))
        except TimeoutError:
            raise RpcTimeout(f"DEADLINE_EXCEEDED: {endpoint}") from None

    async def _call(self, src: str, endpoint: str, fn: Callable[[SimNode], Awaitable[T]], tag: object) -> T:
        if self.frozen:  # (`thawed` returns at once, without yielding, where nothing is frozen)
            await self.thawed(src)
        node = self.nodes.get(endpoint)
        local = node is not None and node.peer_id == src
        if not local:
            await asyncio.sleep(self._latency(src, node.peer_id if node is not None else endpoint))
        if node is None or not node.alive or not self.linked(src, node.peer_id):
            raise RpcUnavailable(f"UNAVAILABLE: {endpoint} unreachable")
        if not local and self.drop and self.rng.random() < self.drop:
            raise RpcUnavailable(f"UNAVAILABLE: the call to {endpoint} was lost")
        if self.frozen:
            await self.thawed(node.peer_id)
        task = node.spawn(self._handle(node, fn))
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and current is not None and not current.cancelling():
                raise RpcUnavailable(f"UNAVAILABLE: {endpoint} went away mid-call") from None
            raise
        if not local:
            await asyncio.sleep(self._latency(src, node.peer_id))
            if not node.alive or not self.linked(src, node.peer_id):
                raise RpcUnavailable(f"UNAVAILABLE: the answer from {endpoint} was lost")
        for hook in list(self.answered):
            hook(src, node, tag)
        return result

    async def _handle(self, node: SimNode, fn: Callable[[SimNode], Awaitable[T]]) -> T:
        try:
            return await fn(node)
        except Rejected as e:
            raise RpcRejected(status_name(e), str(e)) from None
        except (RpcUnavailable, RpcTimeout, RpcRejected):
            raise
        except Exception as e:
            self.bugs.append(f"{node.peer_id}: {type(e).__name__}: {e}")
            raise RpcUnavailable(f"UNKNOWN: {type(e).__name__} in the handler") from None


def _left(deadline: float) -> float:
    return deadline - asyncio.get_running_loop().time()


class SimReduceTransport:
    """The all-reduce's calls (averaging/transport.py) over a SimNetwork; this peer's own reducer directly."""

    def __init__(self, net: SimNetwork, *, peer_id: str, local: ReducerSink) -> None:
        self.net = net
        self.peer_id = peer_id
        self.local = local

    async def push(self, reducer: Member, header: PushHeader, payload: Payload, *, deadline: float) -> None:
        async def handle(node: SimNode) -> None:
            assert node.reducer is not None
            await node.reducer.check_push(header, peer=self.peer_id)
            await node.reducer.accept_push(header, bytearray(payload), peer=self.peer_id)

        await self.net.call(self.peer_id, reducer.endpoint, handle, timeout_s=_left(deadline),
                            tag=("push", header.session.round))

    async def contributors(self, reducer: Member, key: SessionKey, shard: int, *,
                           deadline: float) -> tuple[str, ...]:
        async def handle(node: SimNode) -> tuple[str, ...]:
            assert node.reducer is not None
            return await node.reducer.contributors(key, shard, peer=self.peer_id)

        return await self.net.call(self.peer_id, reducer.endpoint, handle, timeout_s=_left(deadline))

    async def fetch(self, reducer: Member, key: SessionKey, shard: int, contributors: tuple[str, ...], *,
                    max_bytes: int, deadline: float) -> Fetched:
        async def handle(node: SimNode) -> Payload:
            assert node.reducer is not None
            data = await node.reducer.mean(key, shard, contributors, peer=self.peer_id)
            await node.reducer.delivered(key, shard, peer=self.peer_id)
            return bytes(data)

        data = await self.net.call(self.peer_id, reducer.endpoint, handle, timeout_s=_left(deadline),
                                   tag=("mean", key.round))
        if len(data) > max_bytes:
            raise RpcRejected("INVALID_REPLY", f"mean of shard {shard}: {len(data)} bytes, max {max_bytes}")
        return Fetched(data)


class SimConsensusTransport:
    """The round's decision calls (averaging/consensus.py) over a SimNetwork."""

    def __init__(self, net: SimNetwork, *, peer_id: str) -> None:
        self.net = net
        self.peer_id = peer_id

    def _voter(self, node: SimNode) -> VoterService:
        if node.voter is None:
            raise Rejected(f"{node.peer_id} runs no voter", kind="not_found")
        return node.voter

    async def prepare(self, to: Contact, *, scope: str, round_index: int, ballot: Ballot,
                      timeout_s: float) -> PrepareReply:
        return await self.net.call(self.peer_id, to.endpoint, lambda n: self._voter(n).prepare(
            scope=scope, round_index=round_index, ballot=ballot, caller=self.peer_id), timeout_s=timeout_s,
            tag=("prepare", round_index))

    async def accept(self, to: Contact, *, scope: str, round_index: int, ballot: Ballot, value: Value,
                     holders: Sequence[Contact], timeout_s: float) -> AcceptReply:
        return await self.net.call(self.peer_id, to.endpoint, lambda n: self._voter(n).accept(
            scope=scope, round_index=round_index, ballot=ballot, value=value, holders=holders, caller=self.peer_id,
            deadline_s=timeout_s * 0.8), timeout_s=timeout_s)

    async def learn(self, to: Contact, *, scope: str, round_index: int, timeout_s: float) -> LearnReply:
        return await self.net.call(self.peer_id, to.endpoint, lambda n: self._voter(n).learn(
            scope=scope, round_index=round_index, caller=self.peer_id), timeout_s=timeout_s)

    async def material(self, to: Contact, *, scope: str, layout: MaterialLayout, shard: int,
                       timeout_s: float) -> Payload:
        async def handle(node: SimNode) -> Payload:
            return bytes(await self._voter(node).material(scope=scope, layout=layout, shard=shard,
                                                          caller=self.peer_id))

        return await self.net.call(self.peer_id, to.endpoint, handle, timeout_s=timeout_s)

    async def certificates(self, to: Contact, *, scope: str, from_round: int,
                           timeout_s: float) -> tuple[Certificate, ...]:
        return await self.net.call(self.peer_id, to.endpoint, lambda n: self._voter(n).certificates_from(
            scope=scope, from_round=from_round, caller=self.peer_id), timeout_s=timeout_s)


class SimStates:
    """State transfer over a SimNetwork: a copy of the donor's committed tensors (the receiver checks them)."""

    def __init__(self, net: SimNetwork, *, peer_id: str) -> None:
        self.net = net
        self.peer_id = peer_id

    async def fetch(self, endpoint: str, *, timeout_s: float) -> CommittedState:
        async def handle(node: SimNode) -> CommittedState:
            if node.state is None:
                raise Rejected(f"{node.peer_id} serves no state", kind="not_found")
            with node.state() as s:
                return CommittedState(s.round, s.theta_global.clone(),
                                      None if s.outer_momentum is None else s.outer_momentum.clone(),
                                      s.voters, s.digest, s.certificates, s.version)

        return await self.net.call(self.peer_id, endpoint, handle, timeout_s=timeout_s)


def finite(t: torch.Tensor | None) -> bool:
    return t is None or bool(torch.isfinite(t).all())


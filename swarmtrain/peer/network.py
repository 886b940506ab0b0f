"""The peer's network services: a hivemind DHT for control, and per averaging scope a data plane (an RpcNode
serving the all-reduce, the round's decision and state transfer).

`NetworkPlane` is the round driver's plane (driver/part.py) of a real peer. Its node runs on the peer's one
event loop, beside the peer's discovery, matchmaking and heartbeat: the all-reduce, the decision, the voter
and state transfer are awaited directly, and compute (codecs, checks, hashing, the outer step) goes to
threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractContextManager

import torch

from swarmtrain.averaging.matchmaking import Matchmaker, MatchOutcome
from swarmtrain.averaging.material import Material, sharded_mean
from swarmtrain.averaging.network import NetworkAverager
from swarmtrain.averaging.rounds import Electorate, Preview, result_of
from swarmtrain.compress import Codec
from swarmtrain.config import DiscoveryConfig, RunConfig, to_dict
from swarmtrain.diloco.averager import AverageResult, Delta, ShardedMean
from swarmtrain.diloco.flat import state_digest
from swarmtrain.discovery import Discovery
from swarmtrain.driver.part import CommittedState
from swarmtrain.peer.heap import round_heap
from swarmtrain.peer.services import PeerError
from swarmtrain.round.ballots import Value, Voter
from swarmtrain.round.certificate import Certificate, Retirement
from swarmtrain.round.group import Member
from swarmtrain.round.messages import Contact
from swarmtrain.rpc.errors import RpcError
from swarmtrain.rpc.node import RpcNode
from swarmtrain.sync.transfer import StateServer, StateSnapshot, fetch_state_async, fetch_state_parallel_async

__all__ = ["NetworkPlane", "NetworkServices", "match_budget_s", "round_budget_s"]

RUN_SECTIONS_THAT_MUST_MATCH = ("model", "outer", "compress")
OutcomeOf = Callable[[Value, ShardedMean], Awaitable[str | None]]


def match_budget_s(cfg: RunConfig) -> float:
    """The most one round's matchmaking may take: up to four attempts, each a window and the calls around it."""
    a, r = cfg.averaging, cfg.rpc
    return 4 * a.matchmaking_timeout_s + 4 * r.call_timeout_s + 2.0


def round_budget_s(cfg: RunConfig) -> float:
    """The most a trained round may take to end: its matchmaking, then the all-reduce and the decision."""
    return match_budget_s(cfg) + cfg.averaging.allreduce_timeout_s


class NetworkServices:
    """hivemind discovery + the gRPC data plane (the only services a real peer runs)."""

    async def open_discovery(self, cfg: DiscoveryConfig, *, run_id: str, run_key: str) -> Discovery:
        from swarmtrain.discovery.hivemind_dht import HivemindDiscovery

        return await HivemindDiscovery.create(cfg, run_id=run_id, run_key=run_key)

    async def open_data_plane(self, cfg: RunConfig, *, discovery: Discovery, codec: Codec,
                              param_shapes: Sequence[tuple[str, tuple[int, ...]]], scope: str = "",
                              role: str = "worker", round_now: Callable[[], int] = lambda: 0,
                              before_start: Callable[[RpcNode], None] | None = None) -> NetworkPlane:
        plane = NetworkPlane(cfg, discovery=discovery, codec=codec, param_shapes=param_shapes, scope=scope, role=role,
                             round_now=round_now)
        if before_start is not None:
            before_start(plane.node)
        await plane.open()
        return plane

    async def visible_maddrs(self, discovery: Discovery) -> list[str]:
        from swarmtrain.discovery.hivemind_dht import HivemindDiscovery

        if not isinstance(discovery, HivemindDiscovery):
            raise TypeError(f"NetworkServices serves HivemindDiscovery, got {type(discovery).__name__}")
        return await discovery.visible_maddrs()


class NetworkPlane:
    """One scope's data plane on its own RpcNode (see the module docstring)."""

    def __init__(self, cfg: RunConfig, *, discovery: Discovery, codec: Codec,
                 param_shapes: Sequence[tuple[str, tuple[int, ...]]], scope: str = "", role: str = "worker",
                 round_now: Callable[[], int] = lambda: 0) -> None:
        """`role`: of the peers this one averages with (a pipeline part's plane: "stage_server", "trainer"),
        through `discovery` (a ScopedDiscovery for a pipeline part); `scope` names its rounds' decisions."""
        self.cfg = cfg
        self.discovery = discovery
        self.scope = scope
        self.param_shapes = list(param_shapes)
        self.numel = sum(math.prod(s) for _, s in self.param_shapes)
        self.client_mode = cfg.discovery.client_mode
        self.node = RpcNode(cfg.rpc, peer_id=discovery.peer_id, serve=not self.client_mode)
        self.matchmaker = Matchmaker.from_config(discovery, cfg.averaging, role=role,
                                                 heartbeat_s=cfg.discovery.heartbeat_s)
        self.averager = NetworkAverager(self.node, run_id=cfg.train.run_id, run_nonce=cfg.train.run_nonce, codec=codec,
                                        cfg=cfg.averaging, identity=discovery.identity,
                                        key_binding=discovery.key_binding, numel=self.numel, scope=scope,
                                        votes_dir=cfg.checkpoint.dir or None, round_now=round_now,
                                        check_result=self._check_result)
        self.matchmaker.probe = self.averager.reachable
        self.codec = codec
        # A client-mode peer accepts no calls, so it cannot serve state either.
        self.states = None if self.client_mode else StateServer(self.node)
        self._prematch: tuple[int, asyncio.Task[MatchOutcome]] | None = None
        self._outcome_of: OutcomeOf | None = None
        a, r = cfg.averaging, cfg.rpc
        self._match_timeout_s = match_budget_s(cfg)
        self._fetch_timeout_s = 4 * max(r.call_timeout_s, a.allreduce_timeout_s)

    async def open(self) -> None:
        """Serve on the running event loop (the peer's)."""
        await self.node.open()
        self.averager.started()

    @property
    def endpoint(self) -> str:
        return self.node.endpoint

    @property
    def incarnation(self) -> int:
        return self.averager.voter.state.incarnation

    # ------------------------------------------------------------------ the part's hooks

    def attach(self, outcome_of: OutcomeOf, *, round_now: Callable[[], int] | None = None) -> None:
        """The part's `outcome_of(value, mean)`: the state its outer step with `mean` would commit, or None when
        the part does not hold `value.base` (then it cannot tell). This peer's voter checks values against it,
        and bounds the rounds it answers by `round_now()` (the part's round) when given."""
        self._outcome_of = outcome_of
        if round_now is not None:
            self.averager.voter.round_now = round_now

    async def _check_result(self, value: Value, material: Material) -> str:
        if self._outcome_of is None:
            return ""
        mine = await self._outcome_of(value, sharded_mean(material, self.codec))
        if mine is None or mine == value.result:
            return ""
        return f"its own outer step gives {mine[:12]}, the value names {value.result[:12]}"

    # ------------------------------------------------------------------ rounds

    async def prematch(self, round_index: int, member: Member) -> None:
        """Start forming round `round_index`'s group now, in the background; `match` of that round adopts it
        (a time-paced peer matches while its last inner steps run)."""
        self._cancel_prematch()
        self._prematch = (round_index, asyncio.ensure_future(self.matchmaker.form_group(round_index, member)))

    def _cancel_prematch(self) -> None:
        if self._prematch is not None:
            self._prematch[1].cancel()
            self._prematch = None

    async def match(self, round_index: int, member: Member) -> MatchOutcome:
        prematch, self._prematch = self._prematch, None
        if prematch is not None and prematch[0] == round_index:
            task = prematch[1]
        else:
            if prematch is not None:
                prematch[1].cancel()  # matched a round this peer no longer averages (it healed meanwhile)
            task = asyncio.ensure_future(self.matchmaker.form_group(round_index, member))
        try:
            return await asyncio.wait_for(task, timeout=self._match_timeout_s)
        except TimeoutError:
            return MatchOutcome(round=round_index, group=None,
                                reason=f"matchmaking took longer than {self._match_timeout_s:.1f}s")

    async def average(self, outcome: MatchOutcome, delta: Delta, *, base: str, electorate: Electorate,
                      preview: Preview) -> AverageResult:
        assert outcome.group is not None
        await asyncio.to_thread(round_heap)  # what the inner steps freed goes back before the all-reduce allocates
        result = await self.node.call(self.averager.average_async(outcome.group, delta, base=base,
                                                                  electorate=electorate, preview=preview))
        # Inner steps come next, the peak of the peer's memory: idle buffers are not kept through them.
        if self.node.running:
            self.node.buffers.release_idle()
        sent, received = self.averager.take_bytes()
        return _with_bytes(result, sent, received)

    async def learn(self, round_index: int, electorate: Electorate, *, others: Sequence[Contact]) -> AverageResult:
        averager = self.averager.averager
        outcome = await self.node.call(averager.learn(round_index, electorate, others=others,
                                                      timeout_s=2 * self.cfg.rpc.call_timeout_s))
        return result_of(round_index, outcome, self.codec)

    async def certificates(self, peer: Contact, *, from_round: int) -> tuple[Certificate, ...]:
        transport = self.averager.decider.transport
        try:
            return await self.node.call(transport.certificates(peer, scope=self.scope, from_round=from_round,
                                                               timeout_s=self.cfg.rpc.call_timeout_s))
        except (RpcError, TimeoutError, ValueError):
            return ()

    async def advanced(self, round_index: int, *, keep_from: int | None = None) -> None:
        await self.node.call(self.averager.voter.advanced(round_index, keep_from=keep_from))

    async def keep_certificate(self, cert: Certificate) -> None:
        async def keep() -> None:
            self.averager.voter.certificates.add(cert)
        await self.node.call(keep())

    async def retire(self, current_round: int, *, successors: Sequence[Voter] = ()) -> list[Retirement]:
        voter = self.averager.voter

        async def retire() -> list[Retirement]:
            await voter.retire(current_round=current_round, successors=successors)
            return voter.retirements()
        return await self.node.call(retire())

    def retirements(self) -> list[Retirement]:
        return self.averager.voter.retirements()

    # ------------------------------------------------------------------ state

    def serve_state(self, live: Callable[[], AbstractContextManager[CommittedState]]) -> None:
        if self.states is None:
            return

        @contextlib.contextmanager
        def snapshot() -> Iterator[tuple[int, StateSnapshot]]:
            with live() as state:  # views of the live tensors: StateServer serializes them inside
                params = _split(state.theta_global, self.param_shapes)
                momentum = {} if state.outer_momentum is None else _split(state.outer_momentum, self.param_shapes)
                yield state.version, StateSnapshot(round=state.round, params=params, momentum=momentum,
                                                   config=self.cfg, voters=state.voters)

        self.states.serve(snapshot)

    def unreported_bytes(self) -> tuple[int, int]:
        return self.averager.unreported_bytes()

    async def fetch_state(self, endpoints: Sequence[str], *,
                          param_shapes: Sequence[tuple[str, tuple[int, ...]]] | None = None,
                          ) -> tuple[CommittedState, tuple[str, ...]]:
        """The donors' state, checked (sha256, names, shapes, finite, run), with its digest computed here."""
        shapes = self.param_shapes if param_shapes is None else list(param_shapes)
        expected = {name: shape for name, shape in shapes}
        if len(endpoints) > 1:
            snap, served = await fetch_state_parallel_async(self.node, endpoints, run_id=self.cfg.train.run_id,
                                                            expected_shapes=expected, timeout_s=self._fetch_timeout_s)
        else:
            snap = await fetch_state_async(self.node, endpoints, run_id=self.cfg.train.run_id,
                                           expected_shapes=expected, timeout_s=self._fetch_timeout_s)
            served = tuple(endpoints)
        who = ", ".join(served)
        if snap.config.train.run_nonce != self.cfg.train.run_nonce:
            raise PeerError(f"{who} serves a state of another run of {self.cfg.train.run_id!r} (nonce "
                            f"{snap.config.train.run_nonce!r}, this run's is {self.cfg.train.run_nonce!r})")
        ours, theirs = to_dict(self.cfg), to_dict(snap.config)
        differing = [s for s in RUN_SECTIONS_THAT_MUST_MATCH if ours[s] != theirs[s]]
        if differing:
            raise PeerError(f"{who} serves a state of a differently configured run ({', '.join(differing)})")
        theta = torch.cat([snap.params[name].reshape(-1).to(torch.float32) for name, _ in shapes])
        momentum = None
        if snap.momentum:
            momentum = torch.cat([snap.momentum[name].reshape(-1).to(torch.float32) for name, _ in shapes])
        digest = await asyncio.to_thread(functools.partial(state_digest, snap.round, theta, momentum, snap.voters))
        return CommittedState(snap.round, theta, momentum, snap.voters, digest), served

    async def aclose(self) -> None:
        self._cancel_prematch()
        if self.node.running:
            # Serve the means this peer reduced until its group has them (bounded), then stop.
            with contextlib.suppress(Exception):
                await self.node.call(self.averager.drain_async(timeout_s=self.cfg.averaging.contribution_window_s))
        await self.node.aclose()
        await asyncio.to_thread(self.averager.close)


def _with_bytes(result: AverageResult, sent: int, received: int) -> AverageResult:
    return dataclasses.replace(result, bytes_sent=sent, bytes_received=received)


def _split(flat: torch.Tensor, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """θ's flat fp32 vector as named tensors, in the model's parameter order."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in shapes:
        n = math.prod(shape)
        out[name] = flat[offset:offset + n].reshape(shape)
        offset += n
    if offset != flat.numel():
        raise ValueError(f"θ has {flat.numel()} values but the model's parameters hold {offset}")
    return out


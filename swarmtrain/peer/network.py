"""The peer's network services: a hivemind DHT for control, the gRPC node (all-reduce, state transfer) for data.

`NetworkServices` is the `PeerServices` a real `swarmtrain peer` uses; `NetworkPlane` adapts the
blocking `NetworkAverager`/`fetch_state` and the async `Matchmaker` to the Peer's event loop:
the averager runs on a worker thread, and its group provider hops back onto the Peer's loop (where
the discovery lives) for matchmaking.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from swarmtrain.averaging.ballot import VoteBook
from swarmtrain.averaging.group import Group, Member
from swarmtrain.averaging.matchmaking import Matchmaker, MatchOutcome
from swarmtrain.averaging.network import NetworkAverager
from swarmtrain.averaging.protocol import AverageResult, Delta
from swarmtrain.compress import Codec
from swarmtrain.config import DiscoveryConfig, RunConfig, to_dict
from swarmtrain.discovery import Discovery
from swarmtrain.peer.heap import round_heap
from swarmtrain.peer.services import LivePeerState, PeerError, PeerState
from swarmtrain.rpc.node import RpcNode
from swarmtrain.sync.transfer import StateServer, StateSnapshot, fetch_state, fetch_state_parallel

__all__ = ["NetworkPlane", "NetworkServices"]

log = logging.getLogger(__name__)
RUN_SECTIONS_THAT_MUST_MATCH = ("model", "outer", "compress")
VOTES_FILE = "votes.json"  # in the checkpoint directory


class NetworkServices:
    """hivemind discovery + the gRPC data plane (the only services a real peer runs)."""

    async def open_discovery(self, cfg: DiscoveryConfig, *, run_id: str, run_key: str) -> Discovery:
        from swarmtrain.discovery.hivemind_dht import HivemindDiscovery

        return await HivemindDiscovery.create(cfg, run_id=run_id, run_key=run_key)

    async def open_data_plane(self, cfg: RunConfig, *, discovery: Discovery, codec: Codec,
                              param_shapes: Sequence[tuple[str, tuple[int, ...]]], role: str = "worker",
                              before_start: Callable[[RpcNode], None] | None = None) -> NetworkPlane:
        plane = NetworkPlane(cfg, discovery=discovery, codec=codec, param_shapes=param_shapes,
                             loop=asyncio.get_running_loop(), role=role)
        if before_start is not None:
            before_start(plane.node)
        await asyncio.to_thread(plane.start)
        return plane

    async def visible_maddrs(self, discovery: Discovery) -> list[str]:
        from swarmtrain.discovery.hivemind_dht import HivemindDiscovery

        if not isinstance(discovery, HivemindDiscovery):
            raise TypeError(f"NetworkServices serves HivemindDiscovery, got {type(discovery).__name__}")
        return await discovery.visible_maddrs()


class NetworkPlane:
    """One RpcNode serving the all-reduce and state transfer; `average` forms the round's group first."""

    def __init__(self, cfg: RunConfig, *, discovery: Discovery, codec: Codec,
                 param_shapes: Sequence[tuple[str, tuple[int, ...]]], loop: asyncio.AbstractEventLoop,
                 role: str = "worker") -> None:
        """`role`: of the peers this one averages with (a pipeline part's plane: "stage_server", "trainer"),
        through `discovery` (a ScopedDiscovery for a pipeline part)."""
        self.cfg = cfg
        self.discovery = discovery
        self.loop = loop
        self.param_shapes = list(param_shapes)
        self.client_mode = cfg.discovery.client_mode
        self.node = RpcNode(cfg.rpc, peer_id=discovery.peer_id, serve=not self.client_mode)
        self.matchmaker = Matchmaker.from_config(discovery, cfg.averaging, role=role)
        # This peer's votes outlive a restart from its checkpoint directory (averaging/ballot.py).
        votes = VoteBook(Path(cfg.checkpoint.dir) / VOTES_FILE if cfg.checkpoint.dir else None)
        self.averager = NetworkAverager(self.node, run_id=cfg.train.run_id, group_provider=self._group,
                                        codec=codec, cfg=cfg.averaging, votes=votes)
        # A client-mode peer accepts no calls, so it cannot serve state either.
        self.states = None if self.client_mode else StateServer(self.node)
        self._outcome: MatchOutcome | None = None
        self._steps_per_s = 0.0  # announced in this round's match entry
        self._lag_s = 0.0  # likewise (diloco.pace_align)
        self._state_hash = ""  # of the θ_global last published: a group's members share one
        self._prematch: tuple[int, asyncio.Task[MatchOutcome]] | None = None
        self._on_group: Callable[[Group], None] | None = None  # of the average in progress
        a, r = cfg.averaging, cfg.rpc
        self._match_timeout_s = 4 * a.matchmaking_timeout_s + 4 * r.call_timeout_s + 2.0
        self._fetch_timeout_s = 4 * max(r.call_timeout_s, a.allreduce_timeout_s)

    def start(self) -> None:
        self.node.start(timeout_s=self.cfg.rpc.call_timeout_s + 10.0)

    @property
    def endpoint(self) -> str:
        return self.node.endpoint

    def _member(self, steps_per_s: float, lag_s: float) -> Member:
        return Member(peer_id=self.discovery.peer_id, endpoint=self.endpoint, client_mode=self.client_mode,
                      steps_per_s=steps_per_s, lag_s=lag_s, state_hash=self._state_hash)

    async def prematch(self, round_index: int, *, steps_per_s: float, lag_s: float = 0.0) -> None:
        self._cancel_prematch()
        task = asyncio.ensure_future(self.matchmaker.form_group(round_index, self._member(steps_per_s, lag_s)))
        self._prematch = (round_index, task)

    def _cancel_prematch(self) -> None:
        """Drop a background matchmaking no `average` call took (on the loop)."""
        if self._prematch is not None:
            self._prematch[1].cancel()
            self._prematch = None

    def _group(self, round_index: int) -> Group | None:
        """The averager's group provider: runs on its thread, matchmaking on the Peer's loop."""
        prematch, self._prematch = self._prematch, None
        if prematch is not None and prematch[0] == round_index:
            future = asyncio.run_coroutine_threadsafe(_outcome_of(prematch[1]), self.loop)
        else:
            if prematch is not None:  # matched a round this peer no longer averages (it healed meanwhile)
                self.loop.call_soon_threadsafe(prematch[1].cancel)
            member = self._member(self._steps_per_s, self._lag_s)
            future = asyncio.run_coroutine_threadsafe(self.matchmaker.form_group(round_index, member), self.loop)
        try:
            self._outcome = future.result(timeout=self._match_timeout_s)
        except TimeoutError:
            future.cancel()
            self._outcome = MatchOutcome(round=round_index, group=None,
                                         reason=f"matchmaking took longer than {self._match_timeout_s:.1f}s")
        group, on_group = self._outcome.group, self._on_group
        if group is not None and on_group is not None:
            self.loop.call_soon_threadsafe(on_group, group)
        return group

    async def average(self, round_index: int, delta: Delta, *, steps_per_s: float = 0.0, lag_s: float = 0.0,
                      electorate: tuple[str, ...] = (),
                      on_group: Callable[[Group], None] | None = None) -> AverageResult:
        self._outcome, self._steps_per_s, self._lag_s, self._on_group = None, steps_per_s, lag_s, on_group
        await asyncio.to_thread(round_heap)  # what the inner steps freed goes back before the all-reduce allocates
        result = await asyncio.to_thread(functools.partial(self.averager.average, round_index, delta,
                                                           electorate=electorate))
        # Inner steps come next, the peak of the peer's memory: idle buffers are not kept through them
        # (the next round allocates its own; a fresh page costs far less than a round's inner steps).
        if self.node.running:  # a node closed during the round (the peer left) has no buffers to release
            with contextlib.suppress(RuntimeError):  # closed between the check and the call
                self.node.loop.call_soon_threadsafe(self.node.buffers.release_idle)
        outcome = self._outcome
        if result.committed or outcome is None:
            return result
        reason = result.reason if outcome.group is not None else f"no group: {outcome.reason}"
        return dataclasses.replace(result, reason=reason, retry_at=outcome.retry_at,
                                   heal_to_hash=outcome.heal_to_hash)

    def serve_state(self, live: LivePeerState) -> None:
        if self.states is None:
            return

        @contextlib.contextmanager
        def snapshot() -> Iterator[tuple[int, StateSnapshot]]:
            with live() as state:  # views of the live tensors: StateServer serializes them inside
                params = _split(state.theta_global, self.param_shapes)
                momentum = {} if state.outer_momentum is None else _split(state.outer_momentum, self.param_shapes)
                yield state.version, StateSnapshot(round=state.round, params=params, momentum=momentum,
                                                   config=self.cfg, members=state.members)

        self.states.serve(snapshot)

    def publish_state(self, state: PeerState) -> None:
        self._state_hash = state.state_hash  # what this peer's next match entries announce

    def unreported_bytes(self) -> tuple[int, int]:
        return self.averager.unreported_bytes()

    async def fetch_state(self, endpoints: Sequence[str], *,
                          param_shapes: Sequence[tuple[str, tuple[int, ...]]] | None = None,
                          ) -> tuple[PeerState, tuple[str, ...]]:
        shapes = self.param_shapes if param_shapes is None else list(param_shapes)
        expected = {name: shape for name, shape in shapes}
        if len(endpoints) > 1:
            snap, served = await asyncio.to_thread(fetch_state_parallel, self.node, endpoints,
                                                   run_id=self.cfg.train.run_id, expected_shapes=expected,
                                                   timeout_s=self._fetch_timeout_s)
        else:
            snap = await asyncio.to_thread(fetch_state, self.node, endpoints, run_id=self.cfg.train.run_id,
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
        return PeerState(round=snap.round, theta_global=theta, outer_momentum=momentum, members=snap.members), served

    async def aclose(self) -> None:
        self._cancel_prematch()
        # Serve the means this peer reduced until its group has them (bounded), then stop.
        await asyncio.to_thread(self.averager.drain, timeout_s=self.cfg.averaging.contribution_window_s)
        await asyncio.to_thread(self.node.close)


async def _outcome_of(task: asyncio.Task[MatchOutcome]) -> MatchOutcome:
    return await task


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

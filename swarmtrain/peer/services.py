"""What a Peer is composed from: the state it serves, its data plane and services (protocols), its error."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from swarmtrain.averaging.group import Group
from swarmtrain.averaging.protocol import AverageResult, Delta
from swarmtrain.compress import Codec
from swarmtrain.config import DiscoveryConfig, RunConfig
from swarmtrain.discovery import Discovery
from swarmtrain.rpc.node import RpcNode

__all__ = ["DataPlane", "LivePeerState", "PeerError", "PeerServices", "PeerState"]


class PeerError(RuntimeError):
    """The peer cannot run: no run record found, a state it cannot use, a donor that never answered."""


@dataclass(frozen=True)
class PeerState:
    """What a joiner downloads from a live peer: the round it is at, θ_global and the outer momentum."""

    round: int
    theta_global: torch.Tensor  # (numel,) fp32
    outer_momentum: torch.Tensor | None  # (numel,) fp32; None when outer.momentum is 0
    state_hash: str = ""  # sha256 of theta_global (announced with this peer's Δ: a group shares one θ)
    members: tuple[str, ...] = ()  # the peers whose commit produced theta_global (empty = unknown)
    version: int = 0  # changes with every change of theta_global (the worker's theta_version)


LivePeerState = Callable[[], AbstractContextManager[PeerState]]
"""The peer's committed state with its own tensors, unchanged while the context is entered."""


class DataPlane(Protocol):
    """This peer's gRPC side: its endpoint, the round all-reduce, serving and fetching state."""

    @property
    def endpoint(self) -> str: ...

    async def average(self, round_index: int, delta: Delta, *, steps_per_s: float = 0.0, lag_s: float = 0.0,
                      electorate: tuple[str, ...] = (),
                      on_group: Callable[[Group], None] | None = None) -> AverageResult:
        """Round `round_index`'s group mean of `delta`; `steps_per_s` and `lag_s` (the last committed round's
        `comm_s`) are announced to the group (diloco.pace, diloco.pace_align).

        `electorate`: the peers a commit needs a strict majority of (round/rules.py; () = none).
        `on_group` is called on the caller's event loop once the round's group formed."""
        ...

    async def prematch(self, round_index: int, *, steps_per_s: float, lag_s: float = 0.0) -> None:
        """Start forming round `round_index`'s group now, in the background; the round's next
        `average` call adopts it (a time-paced peer matches while its last inner steps run)."""
        ...

    def serve_state(self, live: LivePeerState) -> None:
        """Serve joiners the state `live` yields when they ask (called once, before the first round).

        Its tensors are the peer's own: copy or serialize them inside the context (outer steps and
        heals wait until it is left), and keep nothing of them between requests."""
        ...

    def publish_state(self, state: PeerState) -> None:
        """θ_global changed (start, every commit, every heal): `state.state_hash` is what this peer's
        next match entries announce. `state`'s tensors are live: copy what you keep."""
        ...

    def unreported_bytes(self) -> tuple[int, int]:
        """(sent, received) data-plane bytes not yet in any round line's count."""
        ...

    async def fetch_state(self, endpoints: Sequence[str], *,
                          param_shapes: Sequence[tuple[str, tuple[int, ...]]] | None = None,
                          ) -> tuple[PeerState, tuple[str, ...]]:
        """The state of the donors at `endpoints`, verified: from several at once (a range each, the
        blob most of them serve) or from the one given; with the endpoints that served it.

        `param_shapes`: the (name, shape) the state must have, when it is another part's than this
        plane's (a stage server's copy of a neighbouring stage); by default this plane's."""
        ...

    async def aclose(self) -> None: ...


class PeerServices(Protocol):
    """How a Peer opens its control and data planes (the network by default, in-memory twins in tests)."""

    async def open_discovery(self, cfg: DiscoveryConfig, *, run_id: str, run_key: str) -> Discovery: ...

    async def open_data_plane(self, cfg: RunConfig, *, discovery: Discovery, codec: Codec,
                              param_shapes: Sequence[tuple[str, tuple[int, ...]]], role: str = "worker",
                              before_start: Callable[[RpcNode], None] | None = None) -> DataPlane:
        """`param_shapes`: the model's (name, shape) in θ's flat order, for named state transfer.

        `role`: of the peers this one averages with (a pipeline part: "stage_server" or "trainer", over a
        ScopedDiscovery); `before_start` adds services to the plane's node before it listens (a stage)."""
        ...

    async def visible_maddrs(self, discovery: Discovery) -> list[str]:
        """The control-plane addresses others can join through (for the READY line)."""
        ...

"""What a Peer is composed from: the services it opens its control and data planes with, and its error."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from swarmtrain.compress import Codec
from swarmtrain.config import DiscoveryConfig, RunConfig
from swarmtrain.discovery import Discovery
from swarmtrain.rpc.node import RpcNode

if TYPE_CHECKING:
    from swarmtrain.peer.network import NetworkPlane

__all__ = ["PeerError", "PeerServices"]


class PeerError(RuntimeError):
    """The peer cannot run: no run record found, a state it cannot use, a donor that never answered."""


class PeerServices(Protocol):
    """How a Peer opens its control and data planes (the network by default, in-memory twins in tests)."""

    async def open_discovery(self, cfg: DiscoveryConfig, *, run_id: str, run_key: str) -> Discovery: ...

    async def open_data_plane(self, cfg: RunConfig, *, discovery: Discovery, codec: Codec,
                              param_shapes: Sequence[tuple[str, tuple[int, ...]]], scope: str = "",
                              role: str = "worker", round_now: Callable[[], int] = lambda: 0,
                              before_start: Callable[[RpcNode], None] | None = None) -> NetworkPlane:
        """`param_shapes`: the model's (name, shape) in θ's flat order, for named state transfer.

        `scope`: the decision's scope ("" the whole model; a pipeline part's name); `role`: of the peers this
        one averages with (a pipeline part: "stage_server" or "trainer", over a ScopedDiscovery);
        `round_now()`: the part's round (its voter answers rounds near it); `before_start` adds services to
        the plane's node before it listens (a stage)."""
        ...

    async def visible_maddrs(self, discovery: Discovery) -> list[str]:
        """The control-plane addresses others can join through (for the READY line)."""
        ...

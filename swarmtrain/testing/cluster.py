"""An in-process cluster: real Peers with real matchmaking and the real all-reduce over loopback gRPC,
on an in-memory DHT twin (no hivemind processes), for tests that need the whole round in seconds."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from swarmtrain.compress import Codec
from swarmtrain.config import DiscoveryConfig, RunConfig, load_config
from swarmtrain.discovery import Discovery, InMemoryDiscovery, InMemoryRegistry
from swarmtrain.discovery.coordinator import RunPublisher
from swarmtrain.peer.network import NetworkPlane, NetworkServices
from swarmtrain.roles import Peer
from swarmtrain.rpc.errors import RpcUnavailable
from swarmtrain.rpc.node import RpcNode
from swarmtrain.telemetry.events import HealEvent, Line, RoundEvent, parse_line
from swarmtrain.testing.faults import FaultPlan, inject_faults

__all__ = ["TINY_RUN", "EventLog", "LoopbackServices", "Partition", "hashes_by_round", "publish_run", "run_peer",
           "story"]

T = TypeVar("T")

# The workload of the cluster tests (a ~0.1M-parameter model, a few inner steps per round, int8 Δs); each
# test adds its own timing and round count.
TINY_RUN = (
    "model.preset=tiny", "data.max_corpus_bytes=300000", "data.seq_len=32", "data.batch_size=4",
    "inner.warmup_steps=1", "diloco.inner_steps=3", "diloco.eval_batches=1", "averaging.min_peers=2",
    "compress.codec=int8",
)


class Partition:
    """A network partition of the in-process cluster: the DHT twin splits into one copy per side
    (`InMemoryRegistry.partition`), and every data-plane call across sides fails as an unreachable peer's
    would (`cut` wraps a node's calls from outside). Peers on no side reach everyone."""

    def __init__(self, registry: InMemoryRegistry) -> None:
        self.registry = registry
        self.peer_at: dict[str, str] = {}  # endpoint -> peer id, filled as data planes start
        self._side_of: dict[str, int] = {}
        self._lock = threading.Lock()

    def split(self, *sides: Sequence[str]) -> None:
        with self._lock:
            self._side_of = {p: i for i, side in enumerate(sides) for p in side}
        self.registry.partition(*sides)

    def heal(self) -> None:
        with self._lock:
            self._side_of = {}
        self.registry.heal()

    def cut(self, node: RpcNode) -> None:
        """Make every call `node` makes (each try of `RpcNode.retrying`, through which all of its data-plane
        calls go) fail as an unreachable peer's would while the partition separates it from the callee."""
        inner = node.retrying

        async def retrying(call: Callable[[], Awaitable[T]], *, endpoint: str, deadline: float, what: str) -> T:
            async def once() -> T:
                if not self(node.peer_id, endpoint):
                    raise RpcUnavailable(f"the link from {node.peer_id} to {endpoint} is cut (a partition)")
                return await call()
            return await inner(once, endpoint=endpoint, deadline=deadline, what=what)

        node.retrying = retrying  # type: ignore[method-assign]

    def __call__(self, source: str, endpoint: str) -> bool:
        """Whether `source` reaches the peer serving `endpoint`."""
        with self._lock:
            a, b = self._side_of.get(source), self._side_of.get(self.peer_at.get(endpoint, ""))
        return a is None or b is None or a == b


class LoopbackServices(NetworkServices):
    """`PeerServices` of the in-process cluster: one shared `InMemoryRegistry` as the DHT, and for
    each peer the real data plane of `NetworkServices` (a `NetworkPlane`: RpcNode on 127.0.0.1).

    A restarted peer keeps its id through `discovery.identity_path`, as with the real DHT.
    """

    def __init__(self, registry: InMemoryRegistry | None = None, *, faults: FaultPlan | None = None,
                 skews_s: Sequence[float] = ()) -> None:
        self.registry = registry if registry is not None else InMemoryRegistry()
        self.ids: dict[str, str] = {}
        self.skews_s = list(skews_s)  # the machine clocks of the peers, in the order they open discovery
        self.partition = Partition(self.registry)
        self.faults = faults  # consulted at every data-plane site of every peer (rpc/faults.py)

    async def open_data_plane(self, cfg: RunConfig, *, discovery: Discovery, codec: Codec,
                              param_shapes: Sequence[tuple[str, tuple[int, ...]]], scope: str = "",
                              role: str = "worker", round_now: Callable[[], int] = lambda: 0,
                              before_start: Callable[[RpcNode], None] | None = None) -> NetworkPlane:
        plane = await super().open_data_plane(cfg, discovery=discovery, codec=codec, param_shapes=param_shapes,
                                              scope=scope, role=role, round_now=round_now, before_start=before_start)
        self.partition.peer_at[plane.endpoint] = discovery.peer_id
        self.partition.cut(plane.node)
        if self.faults is not None:
            inject_faults(plane.averager, self.faults)
        return plane

    async def open_discovery(self, cfg: DiscoveryConfig, *, run_id: str, run_key: str) -> Discovery:
        peer_id = self.ids.setdefault(cfg.identity_path, self.registry.new_peer_id()) if cfg.identity_path else None
        skew_s = self.skews_s.pop(0) if self.skews_s else 0.0
        return InMemoryDiscovery(self.registry, run_id=run_id, record_ttl_s=cfg.record_ttl_s, peer_id=peer_id,
                                 skew_s=skew_s, run_key=run_key)

    async def visible_maddrs(self, discovery: Discovery) -> list[str]:
        return [f"/memory/{discovery.peer_id}"]


_publishers: list[asyncio.Task[None]] = []  # kept until their loop ends (the test's)


async def publish_run(registry: InMemoryRegistry, overrides: Sequence[str], *, run_key: str = "") -> RunConfig:
    """Run a coordinator's duty in the background, as `swarmtrain coordinator` does: publish the run record with
    `overrides` on the defaults, sealed with `run_key`, and keep it current, the scopes' genesis included, for
    as long as the calling event loop runs; returns its config."""
    cfg = load_config(overrides=list(overrides))
    coordinator = InMemoryDiscovery(registry, run_id=cfg.train.run_id, record_ttl_s=3600.0, peer_id="coordinator",
                                    run_key=run_key)
    publisher = RunPublisher(coordinator, cfg)
    await publisher.publish()
    task = asyncio.ensure_future(publisher.serve(asyncio.Event()))
    _publishers[:] = [t for t in _publishers if not t.done()] + [task]
    return cfg


class EventLog(io.StringIO):
    """A peer's stdout in memory (give it to `EventWriter`); `events()` parses what was written so far."""

    def events(self) -> list[Line]:
        return [e for x in self.getvalue().splitlines() if (e := parse_line(x)) is not None]

    def rounds(self) -> list[RoundEvent]:
        return [e for e in self.events() if isinstance(e, RoundEvent)]


def story(logs: Mapping[str, EventLog]) -> dict[str, list[tuple[object, ...]]]:
    """Each peer's round and heal lines in short form, for assertion messages."""
    return {n: [(e.round, "C" if e.committed else "A", len(e.members), e.hash[:8], e.reason[:60])
                if isinstance(e, RoundEvent) else ("heal", e.from_round, e.to_round, e.hash[:8])
                for e in log.events() if isinstance(e, (RoundEvent, HealEvent))] for n, log in logs.items()}


def hashes_by_round(logs: Mapping[str, EventLog]) -> dict[int, set[str]]:
    """The θ_global hashes each round committed with, over every peer: one per round when they agree."""
    by_round: dict[int, set[str]] = {}
    for log in logs.values():
        for e in log.rounds():
            if e.committed:
                by_round.setdefault(e.round, set()).add(e.hash)
    return by_round


async def run_peer(peer: Peer, stop: asyncio.Event, *, started: Callable[[Peer], None] | None = None) -> str:
    """Start `peer`, run it until done or `stop`, and always close it; returns why it ended.
    `started(peer)` runs between start and the rounds (a test installs its faults there)."""
    reason = "error"
    try:
        await peer.start()
        if started is not None:
            started(peer)
        reason = await peer.run(stop)
    finally:
        await peer.aclose(reason)
    return reason

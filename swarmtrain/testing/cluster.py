"""An in-process cluster: real Peers with real matchmaking and the real all-reduce over loopback gRPC,
on an in-memory DHT twin (no hivemind processes), for tests that need the whole round in seconds."""

from __future__ import annotations

from collections.abc import Sequence

from swarmtrain.config import DiscoveryConfig, RunConfig, load_config, to_dict
from swarmtrain.discovery import Discovery, InMemoryDiscovery, InMemoryRegistry, RunRecord
from swarmtrain.peer.network import NetworkServices

__all__ = ["LoopbackServices", "publish_run"]


class LoopbackServices(NetworkServices):
    """`PeerServices` of the in-process cluster: one shared `InMemoryRegistry` as the DHT, and for
    each peer the real data plane of `NetworkServices` (a `NetworkPlane`: RpcNode on 127.0.0.1).

    A restarted peer keeps its id through `discovery.identity_path`, as with the real DHT.
    """

    def __init__(self, registry: InMemoryRegistry | None = None) -> None:
        self.registry = registry if registry is not None else InMemoryRegistry()
        self.ids: dict[str, str] = {}

    async def open_discovery(self, cfg: DiscoveryConfig, *, run_id: str) -> Discovery:
        peer_id = self.ids.setdefault(cfg.identity_path, self.registry.new_peer_id()) if cfg.identity_path else None
        return InMemoryDiscovery(self.registry, run_id=run_id, record_ttl_s=cfg.record_ttl_s, peer_id=peer_id)

    async def visible_maddrs(self, discovery: Discovery) -> list[str]:
        return [f"/memory/{discovery.peer_id}"]


async def publish_run(registry: InMemoryRegistry, overrides: Sequence[str]) -> RunConfig:
    """Publish a run record (as a coordinator would) with `overrides` on the defaults; returns its config."""
    cfg = load_config(overrides=list(overrides))
    coordinator = InMemoryDiscovery(registry, run_id=cfg.train.run_id, record_ttl_s=3600.0, peer_id="coordinator")
    await coordinator.publish_run(RunRecord(run_id=cfg.train.run_id, coordinator_id="coordinator",
                                            config=to_dict(cfg), updated_at=registry.clock()), timeout_s=1.0)
    return cfg

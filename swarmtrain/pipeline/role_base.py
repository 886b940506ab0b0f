"""What both pipeline roles share: joining the run, a part's data plane and outer rounds, the peer record's
heartbeat; and reading the stage servers from the live peer records."""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from typing import Any

import torch

from swarmtrain.compress import codec_from_config
from swarmtrain.config import RunConfig
from swarmtrain.diloco.flat import param_shapes
from swarmtrain.discovery import Discovery, Heartbeat, PeerRecord, ScopedDiscovery
from swarmtrain.models.spec import check_run
from swarmtrain.peer.config import merge_run_config
from swarmtrain.peer.data import peer_seed
from swarmtrain.peer.joining import fetch_run_config
from swarmtrain.peer.services import DataPlane, PeerError, PeerServices
from swarmtrain.pipeline.cut import stage_blocks
from swarmtrain.pipeline.memory import MB, server_bytes
from swarmtrain.pipeline.outer import PartRounds
from swarmtrain.pipeline.routing import Server
from swarmtrain.rpc.node import RpcNode
from swarmtrain.telemetry import EventWriter
from swarmtrain.telemetry.tally import Tally
from swarmtrain.trust import resolve_run_key

__all__ = ["RoleBase", "fitting_stages", "least_served_stage", "servers_of"]

log = logging.getLogger(__name__)


def servers_of(peers: Sequence[PeerRecord], stages: int) -> tuple[list[Server], dict[Server, tuple[float, int]]]:
    """The stage servers among live peer records, with the (latency, queue) each published."""
    servers, hints = [], {}
    for p in peers:
        if p.role == "stage_server" and 0 <= p.stage < stages and p.endpoint:
            s = Server(p.peer_id, p.endpoint, p.stage)
            servers.append(s)
            hints[s] = (p.latency_s, p.queue)
    return servers, hints


def least_served_stage(peers: Sequence[PeerRecord], *, n_layer: int, stages: int,
                       allowed: Sequence[int] | None = None) -> int:
    """Of the `allowed` stages (default all), the one with the fewest live servers per block it holds (its
    demand: every micro-batch passes every block once); the earliest on a tie."""
    counts = [0] * stages
    for s in servers_of(peers, stages)[0]:
        counts[s.stage] += 1
    sizes = [len(blocks) for blocks in stage_blocks(n_layer, stages)]
    return min(range(stages) if allowed is None else allowed, key=lambda k: (counts[k] / sizes[k], k))


def fitting_stages(cfg: RunConfig) -> list[int]:
    """The stages whose training state fits this peer's `train.memory_budget_mb` (all without one)."""
    need = server_bytes(cfg.model, cfg.pipeline, seq_len=cfg.data.seq_len)
    budget = cfg.train.memory_budget_mb
    fitting = [k for k, b in enumerate(need) if not budget or b <= budget * MB]
    if not fitting:
        raise PeerError(f"no stage fits train.memory_budget_mb={budget}: the smallest needs "
                        f"{min(need) / MB:.0f} MB (docs/pipeline.md#memory); cut the model into more stages")
    return fitting


class RoleBase(abc.ABC):
    """What a server and a trainer share: joining the run, a part's data plane and rounds, the heartbeat."""

    role = ""

    def __init__(self, local: RunConfig, *, writer: EventWriter, services: PeerServices,
                 local_overrides: Sequence[str] = (), coordinator_id: str | None = None) -> None:
        self.local = local
        self.writer = writer
        self.services = services
        self.local_overrides = tuple(local_overrides)
        self.coordinator_id = coordinator_id
        self.cfg = local
        self.discovery: Discovery | None = None
        self.node: RpcNode | None = None  # the plane's: the role's calls, the all-reduce, its part's state
        self.plane: DataPlane | None = None
        self.rounds: PartRounds | None = None
        self.heartbeat: Heartbeat | None = None
        self.tally, self.metrics = Tally(), ""  # its work so far (record stats, /metrics at `metrics`: host:port)
        writer.listeners.append(self.tally.observe)

    async def _join(self) -> Discovery:
        discovery = await self.services.open_discovery(self.local.discovery, run_id=self.local.train.run_id,
                                                       run_key=resolve_run_key(self.local.rpc.run_key))
        self.discovery = discovery
        run = await fetch_run_config(discovery, self.local, coordinator_id=self.coordinator_id)
        # A part of another model (config.json, weights, tokenizer) must not join the stage's swarm
        self.cfg = check_run(merge_run_config(run, self.local, local_overrides=self.local_overrides))
        if self.cfg.pipeline.stages < 1:
            raise PeerError(f"run {self.cfg.train.run_id!r} has no pipeline (pipeline.stages = 0): join it without "
                            "--role, as a DiLoCo worker")
        if self.cfg.train.threads:
            torch.set_num_threads(self.cfg.train.threads)
        self.tally.seq_len, self.tally.peer, self.tally.role = self.cfg.data.seq_len, discovery.peer_id, self.role
        return discovery

    async def _open_plane(self, part: torch.nn.Module, *, scope: str, member: Any, role: str,
                          serve: Any = None) -> tuple[ScopedDiscovery, DataPlane, RpcNode]:
        """The data plane of `part`'s holders (its matchmaking under `scope`; `serve(node)` adds this role's
        own service before the node listens), with the scope's view of the DHT and the plane's node."""
        assert self.discovery is not None
        cfg = self.cfg
        scoped = ScopedDiscovery(self.discovery, scope=scope, member=member)
        codec = codec_from_config(cfg.compress, seed=peer_seed(cfg.train.seed + 2, self.discovery.peer_id))
        nodes: list[RpcNode] = []

        def before_start(node: RpcNode) -> None:
            nodes.append(node)
            if serve is not None:
                serve(node)

        plane = await self.services.open_data_plane(
            cfg, discovery=scoped, codec=codec, role=role, before_start=before_start,
            param_shapes=param_shapes(part))
        return scoped, plane, nodes[0]

    def _rounds(self, part: torch.nn.Module, plane: DataPlane, scoped: ScopedDiscovery, *, stage: int, still: Any,
                apply_now: bool, on_heal: Any = None, hold: Any = None) -> PartRounds:
        return PartRounds(list(part.parameters()), plane=plane, discovery=scoped, cfg=self.cfg, stage=stage,
                          still=still, emit=self.writer.emit, apply_now=apply_now, on_heal=on_heal, hold=hold)

    def _part_fields(self) -> dict[str, Any]:
        """The record's fields of this role's part: its outer round, θ_global's hash, when its round ends."""
        assert self.rounds is not None
        return {"round": self.rounds.round, "state_hash": self.rounds.hash,
                "round_ends_at": self.rounds.round_ends_at(), "stats": self.tally.stats()}

    def _metrics_info(self) -> dict[str, str]:
        return {"metrics": self.metrics} if self.metrics else {}

    @abc.abstractmethod
    def _record(self) -> PeerRecord:
        """The peer record this role announces by heartbeat."""

    async def _announce(self) -> None:
        assert self.discovery is not None
        cfg = self.cfg
        self.heartbeat = Heartbeat(self.discovery, current=self._record, heartbeat_s=cfg.discovery.heartbeat_s,
                                   now=self.discovery.now, timeout_s=cfg.rpc.call_timeout_s)
        await self.heartbeat.start()

    async def aclose(self, reason: str) -> None:
        """Stop beating, withdraw the record, close the data plane and the DHT node (each best effort)."""
        if self.heartbeat is not None:
            await self.heartbeat.aclose(withdraw=True)
        if self.rounds is not None:
            await self.rounds.aclose()
        if self.plane is not None:
            await self.plane.aclose()
        if self.discovery is not None:
            await self.discovery.aclose()
        log.info("%s left: %s", self.role, reason)

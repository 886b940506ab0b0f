"""Where a stage server goes, pure: the stage servers among the live records, the stage with the fewest servers
per block, and the stages that fit a peer's memory budget."""

from __future__ import annotations

from collections.abc import Sequence

from swarmtrain.config import RunConfig
from swarmtrain.discovery import PeerRecord
from swarmtrain.peer.services import PeerError
from swarmtrain.pipeline.cut import stage_blocks
from swarmtrain.pipeline.memory import MB, server_bytes
from swarmtrain.pipeline.routing import Server

__all__ = ["fitting_stages", "least_served_stage", "servers_of"]


def servers_of(peers: Sequence[PeerRecord], stages: int) -> tuple[list[Server], dict[Server, tuple[float, int]]]:
    """The stage servers among live peer records, with the (latency, queue) each published."""
    servers, hints = [], {}
    for p in peers:
        if p.server is not None and p.server.stage < stages and p.endpoint:
            s = Server(p.peer_id, p.endpoint, p.server.stage)
            servers.append(s)
            hints[s] = (p.server.latency_s, p.server.queue)
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

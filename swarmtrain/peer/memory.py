"""`train.memory_budget_mb` against what a DiLoCo worker holds: the whole model's training state."""

from __future__ import annotations

from swarmtrain.config import RunConfig
from swarmtrain.models.memory import MB, worker_bytes
from swarmtrain.peer.services import PeerError

__all__ = ["check_worker_budget"]


def check_worker_budget(cfg: RunConfig) -> None:
    """PeerError when the worker's training state exceeds the peer's budget, with what to do instead."""
    budget = cfg.train.memory_budget_mb
    if budget and (need := worker_bytes(cfg.model)) > budget * MB:
        hint = "join as a stage server (--role server)" if cfg.pipeline.stages else \
            "the run would have to cut the model into stages (pipeline.stages)"
        raise PeerError(f"the model needs {need / MB:.0f} MB to train on one peer, more than train.memory_budget_mb="
                        f"{budget}: {hint}")

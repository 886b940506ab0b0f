"""The bytes a model's training state takes in fp32, counted without allocating it.

Weights, gradients and AdamW's two moments (16 bytes a parameter), plus θ_global and the outer momentum
(8 more) for every holder of a part that runs outer rounds on what it holds. What a pipeline stage adds
is pipeline/memory.py; the budget check of a DiLoCo worker is peer/memory.py.
"""

from __future__ import annotations

from swarmtrain.config import ModelConfig

__all__ = ["MB", "OUTER_BYTES", "TRAIN_BYTES", "worker_bytes"]

MB = 1 << 20
TRAIN_BYTES = 16  # weights, gradients, AdamW's two moments
OUTER_BYTES = 8  # θ_global and the outer momentum


def worker_bytes(cfg: ModelConfig) -> int:
    """A DiLoCo worker: the whole model's training state and its outer state (any `model.arch`)."""
    from swarmtrain.models.build import count_params

    return count_params(cfg) * (TRAIN_BYTES + OUTER_BYTES)

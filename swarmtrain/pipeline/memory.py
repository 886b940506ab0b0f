"""What a part of the model needs in memory to train, against a peer's `train.memory_budget_mb`.

Counted: the training state only, in fp32 — weights, gradients and AdamW's two moments (16 bytes a
parameter); θ_global and the outer momentum (8 more) for every holder of a part, since a DiLoCo worker,
a stage server and a trainer all run outer rounds on what they hold; a stage server adds the inputs it
keeps for backwards (`pipeline.max_contexts` micro-batches). Not counted: the runtime
(Python, torch, gRPC, the DHT client: about 0.25 GB on a CPU machine) and transient buffers (the
activations of one micro-batch, encoded payloads), which measured peaks add on top
(docs/benchmarks.md#pipeline).
"""

from __future__ import annotations

import torch

from swarmtrain.config import ModelConfig, PipelineConfig, RunConfig
from swarmtrain.pipeline.cut import stage_blocks
from swarmtrain.pipeline.parts import ends_module, stage_module

__all__ = ["MB", "check_worker_budget", "server_bytes", "stage_params", "trainer_bytes", "worker_bytes"]

MB = 1 << 20
_TRAIN_BYTES = 16  # weights, gradients, AdamW's two moments
_OUTER_BYTES = 8  # θ_global and the outer momentum


def stage_params(cfg: ModelConfig, stages: int) -> list[int]:
    """Parameters of each stage (built on the meta device: nothing allocated)."""
    with torch.device("meta"):
        return [sum(p.numel() for p in stage_module(cfg, blocks).parameters())
                for blocks in stage_blocks(cfg.shape_value("n_layer"), stages)]


def worker_bytes(cfg: ModelConfig) -> int:
    """A DiLoCo worker: the whole model's training state and its outer state (any `model.arch`)."""
    from swarmtrain.models.build import count_params

    return count_params(cfg) * (_TRAIN_BYTES + _OUTER_BYTES)


def trainer_bytes(cfg: ModelConfig) -> int:
    """A pipeline trainer: the embeddings' and head's training state and their outer state."""
    with torch.device("meta"):
        ends = sum(p.numel() for p in ends_module(cfg).parameters())
    return ends * (_TRAIN_BYTES + _OUTER_BYTES)


def server_bytes(cfg: ModelConfig, pipe: PipelineConfig, *, seq_len: int) -> list[int]:
    """A stage server of each stage: its blocks' training and outer state and the inputs it keeps for backwards."""
    width = cfg.shape_value("n_embd")
    contexts = pipe.max_contexts * pipe.microbatch_size * seq_len * width * 4
    return [n * (_TRAIN_BYTES + _OUTER_BYTES) + contexts for n in stage_params(cfg, pipe.stages)]


def check_worker_budget(cfg: RunConfig) -> None:
    """A DiLoCo worker holds the whole model: PeerError when its training state exceeds the peer's budget."""
    from swarmtrain.peer.services import PeerError  # here: the peer package imports this module

    budget = cfg.train.memory_budget_mb
    if budget and (need := worker_bytes(cfg.model)) > budget * MB:
        hint = "join as a stage server (--role server)" if cfg.pipeline.stages else \
            "the run would have to cut the model into stages (pipeline.stages)"
        raise PeerError(f"the model needs {need / MB:.0f} MB to train on one peer, more than train.memory_budget_mb="
                        f"{budget}: {hint}")

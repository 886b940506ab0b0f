"""What a part of the model needs in memory to train, against a peer's `train.memory_budget_mb`.

Counted (models/memory.py): the training state only, in fp32 — weights, gradients and AdamW's two moments (16 bytes a
parameter); θ_global and the outer momentum (8 more) for every holder of a part, since a DiLoCo worker,
a stage server and a trainer all run outer rounds on what they hold; a stage server adds the inputs it
keeps for backwards (`pipeline.max_contexts` micro-batches). Not counted: the runtime
(Python, torch, gRPC, the DHT client: about 0.25 GB on a CPU machine) and transient buffers (the
activations of one micro-batch, encoded payloads), which measured peaks add on top
(docs/benchmarks.md#pipeline).
"""

from __future__ import annotations

import torch

from swarmtrain.config import ModelConfig, PipelineConfig
from swarmtrain.models.memory import MB, OUTER_BYTES, TRAIN_BYTES, worker_bytes
from swarmtrain.pipeline.cut import stage_blocks
from swarmtrain.pipeline.parts import ends_module, stage_module

__all__ = ["MB", "server_bytes", "stage_params", "trainer_bytes", "worker_bytes"]


def stage_params(cfg: ModelConfig, stages: int) -> list[int]:
    """Parameters of each stage (built on the meta device: nothing allocated)."""
    with torch.device("meta"):
        return [sum(p.numel() for p in stage_module(cfg, blocks).parameters())
                for blocks in stage_blocks(cfg.shape_value("n_layer"), stages)]


def trainer_bytes(cfg: ModelConfig) -> int:
    """A pipeline trainer: the embeddings' and head's training state and their outer state."""
    with torch.device("meta"):
        ends = sum(p.numel() for p in ends_module(cfg).parameters())
    return ends * (TRAIN_BYTES + OUTER_BYTES)


def server_bytes(cfg: ModelConfig, pipe: PipelineConfig, *, seq_len: int) -> list[int]:
    """A stage server of each stage: its blocks' training and outer state and the inputs it keeps for backwards."""
    width = cfg.shape_value("n_embd")
    contexts = pipe.max_contexts * pipe.microbatch_size * seq_len * width * 4
    return [n * (TRAIN_BYTES + OUTER_BYTES) + contexts for n in stage_params(cfg, pipe.stages)]

"""The model's parts in a pipeline: a stage's blocks (servers) and the two ends (trainers).

A block's initial weights depend on the run's seed and the block's index only, not on how the model
is cut: re-cutting a run keeps every block's weights. `assemble` puts parts back into one model (the
single-process reference of the tests, and an export of a pipeline's model). With `model.init_from`
each part reads only its own tensors from the file. The GPT's parts are here, the llama's in
llama_parts.py; `build_stage`, `build_ends`, `stage_module` and `assemble` take either.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from swarmtrain.config import ConfigError, ModelConfig
from swarmtrain.config_presets import GPTShape
from swarmtrain.models.gpt import GPT, Block, resolve_shape
from swarmtrain.pipeline.cut import stage_blocks
from swarmtrain.pipeline.llama_parts import (
    LlamaEnds,
    LlamaStage,
    assemble_llama,
    init_llama_part,
    llama_ends,
    llama_stage,
)

__all__ = ["Ends", "Stage", "StageBlocks", "TrainerEnds", "assemble", "build_ends", "build_stage", "ends_module",
           "stage_module"]

_STD = 0.02


class StageBlocks(nn.Module):
    """Blocks `blocks` of the model (a stage): (B, T, C) activations in, the same shape out."""

    def __init__(self, shape: GPTShape, blocks: range, *, dropout: float = 0.0) -> None:
        super().__init__()
        self.shape = shape
        self.block_ids = blocks
        self.blocks = nn.ModuleList(Block(shape, dropout) for _ in blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def state_names(self) -> dict[str, str]:
        """This part's state_dict names -> the full GPT's names."""
        return {name: f"blocks.{self.block_ids[int(name.split('.')[1])]}.{name.split('.', 2)[2]}"
                for name in self.state_dict()}


class TrainerEnds(nn.Module):
    """The embeddings before the first stage and the head after the last (tied to the token embedding)."""

    def __init__(self, shape: GPTShape, *, vocab_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.shape = shape
        self.tok_emb = nn.Embedding(vocab_size, shape.n_embd)
        self.pos_emb = nn.Embedding(shape.context_len, shape.n_embd)
        self.drop = nn.Dropout(dropout)
        self.ln_f = nn.LayerNorm(shape.n_embd)
        self.head = nn.Linear(shape.n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight

    def embed(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) tokens -> (B, T, C)
        t = idx.shape[1]
        if t > self.shape.context_len:
            raise ValueError(f"sequence length {t} exceeds the model's context_len {self.shape.context_len}")
        return self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device)))

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # the last stage's output -> mean CE
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def state_names(self) -> dict[str, str]:
        return {name: name for name in self.state_dict()}


Stage = StageBlocks | LlamaStage
Ends = TrainerEnds | LlamaEnds


def stage_module(cfg: ModelConfig, blocks: range) -> Stage:
    """Blocks `blocks` of `cfg`'s model, torch's constructor init (build it on the meta device to count)."""
    if cfg.arch == "llama":
        return llama_stage(cfg, blocks)
    return StageBlocks(resolve_shape(cfg), blocks, dropout=cfg.dropout)


def ends_module(cfg: ModelConfig) -> Ends:
    """The trainers' part of `cfg`'s model, torch's constructor init."""
    if cfg.arch == "llama":
        return llama_ends(cfg)
    return TrainerEnds(resolve_shape(cfg), vocab_size=cfg.vocab_size, dropout=cfg.dropout)


def _generator(seed: int, what: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{what}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


@torch.no_grad()
def _init(module: nn.Module, generator: torch.Generator, n_layer: int) -> None:
    """GPT-2's init (models/gpt.py): N(0, 0.02) weights, zero biases, residual projections scaled down."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=_STD, generator=generator)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, nn.LayerNorm):
            m.reset_parameters()
    for name, p in module.named_parameters():
        if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
            nn.init.normal_(p, mean=0.0, std=_STD / math.sqrt(2 * n_layer), generator=generator)


def build_stage(cfg: ModelConfig, stage: int, stages: int, *, seed: int) -> Stage:
    """Stage `stage` of `stages`, each block initialized from (seed, its index), or read from `init_from`."""
    n_layer = cfg.shape_value("n_layer")
    blocks = stage_blocks(n_layer, stages)[stage]
    with torch.device("meta"):
        part = stage_module(cfg, blocks)
    part.to_empty(device="cpu")
    for block_id, block in zip(blocks, part.blocks, strict=True):
        generator = _generator(seed, f"block/{block_id}")
        if isinstance(part, LlamaStage):
            init_llama_part(block, generator)
        else:
            _init(block, generator, n_layer)
    if cfg.init_from:
        _load(part, cfg.init_from, part.state_names())
    return part


def build_ends(cfg: ModelConfig, *, seed: int) -> Ends:
    """The trainer's part, initialized from (seed, "ends"), or read from `init_from`."""
    with torch.device("meta"):
        part = ends_module(cfg)
    part.to_empty(device="cpu")
    if isinstance(part, LlamaEnds):
        part.retie()
        init_llama_part(part, _generator(seed, "ends"))
    else:
        part.head.weight = part.tok_emb.weight
        _init(part, _generator(seed, "ends"), cfg.shape_value("n_layer"))
    if cfg.init_from:
        _load(part, cfg.init_from, part.state_names())
    return part


def _load(part: nn.Module, path: str, names: dict[str, str]) -> None:
    """This part's tensors of a full GPT state_dict in a safetensors file (only those are read)."""
    from safetensors import SafetensorError, safe_open

    if not Path(path).is_file():
        raise ConfigError(f"model.init_from: {path}: no such file")
    own = part.state_dict()
    try:
        with safe_open(path, framework="pt") as f:
            present = set(f.keys())
            missing = sorted(full for full in names.values() if full not in present)
            if missing:
                raise ConfigError(f"model.init_from: {path} lacks {missing[:5]} of this part")
            tensors = {mine: f.get_tensor(full) for mine, full in names.items()}
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"model.init_from: {path}: not a readable safetensors file ({e})") from e
    wrong = [f"{k} {tuple(t.shape)} != {tuple(own[k].shape)}" for k, t in tensors.items() if t.shape != own[k].shape]
    if wrong:
        raise ConfigError(f"model.init_from: {path} does not fit this part: {wrong[:5]}")
    part.load_state_dict({k: t.to(own[k].dtype) for k, t in tensors.items()})


def assemble(ends: Ends, stages: Sequence[Stage], *, vocab_size: int) -> nn.Module:
    """One model holding copies of the parts' weights (stages in order, covering every block)."""
    state = {full: ends.state_dict()[mine].detach().clone() for mine, full in ends.state_names().items()}
    for part in stages:
        own = part.state_dict()
        state.update({full: own[mine].detach().clone() for mine, full in part.state_names().items()})
    if isinstance(ends, LlamaEnds):
        llama_stages = [p for p in stages if isinstance(p, LlamaStage)]
        assert len(llama_stages) == len(stages)
        return assemble_llama(ends, state, theta=llama_stages[0].theta if llama_stages else 10000.0)
    model = GPT(ends.shape, vocab_size=vocab_size)
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise ValueError(f"assemble: the parts do not cover {missing[:5]}")
    model.load_state_dict(state)
    return model

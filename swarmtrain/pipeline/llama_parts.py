"""The built-in llama's parts in a pipeline: a stage's decoder layers (servers) and the two ends (trainers).

Names map to `Llama`'s (`layers.i.…` of a stage -> `model.layers.{block}.…`; `embed_tokens`, `norm` ->
`model.…`; `lm_head`), so `assemble` gives the model a single process trains and exports. A block's weights
depend on the run's seed and its index only (transformers' init: N(0, 0.02) matrices, unit norms).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swarmtrain.config import ModelConfig
from swarmtrain.config_presets import LlamaShape
from swarmtrain.models.llama import INIT_STD, Llama, LlamaLayer, RMSNorm, llama_shape, rope_tables

__all__ = ["LlamaEnds", "LlamaStage", "assemble_llama", "init_llama_part", "llama_ends", "llama_stage"]


class LlamaStage(nn.Module):
    """Decoder layers `blocks` (a stage): (B, T, C) activations in, the same shape out."""

    def __init__(self, shape: LlamaShape, blocks: range, *, eps: float, theta: float) -> None:
        super().__init__()
        self.shape, self.block_ids, self.theta = shape, blocks, theta
        self.blocks = nn.ModuleList(LlamaLayer(shape, eps=eps) for _ in blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(x.shape[1], self.shape.n_embd // self.shape.n_head, theta=self.theta, device=x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return x

    def state_names(self) -> dict[str, str]:
        """This part's state_dict names -> the full Llama's names."""
        return {name: f"model.layers.{self.block_ids[int(name.split('.')[1])]}.{name.split('.', 2)[2]}"
                for name in self.state_dict()}


class LlamaEnds(nn.Module):
    """The token embedding before the first stage; the final norm and the head after the last."""

    def __init__(self, shape: LlamaShape, *, vocab_size: int, eps: float, tie: bool) -> None:
        super().__init__()
        self.shape, self.tie = shape, tie
        self.embed_tokens = nn.Embedding(vocab_size, shape.n_embd)
        self.norm = RMSNorm(shape.n_embd, eps=eps)
        self.lm_head = nn.Linear(shape.n_embd, vocab_size, bias=False)
        self.retie()

    def retie(self) -> None:
        if self.tie:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) tokens -> (B, T, C)
        if idx.shape[1] > self.shape.context_len:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds the model's context_len {self.shape.context_len}")
        return self.embed_tokens(idx)

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # the last stage's output -> mean CE
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def state_names(self) -> dict[str, str]:
        return {name: name if name.startswith("lm_head") else f"model.{name}" for name in self.state_dict()}


@torch.no_grad()
def init_llama_part(module: nn.Module, generator: torch.Generator) -> None:
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            nn.init.normal_(p, mean=0.0, std=INIT_STD, generator=generator)


def llama_stage(cfg: ModelConfig, blocks: range) -> LlamaStage:
    return LlamaStage(llama_shape(cfg), blocks, eps=cfg.norm_eps, theta=cfg.rope_theta)


def llama_ends(cfg: ModelConfig) -> LlamaEnds:
    return LlamaEnds(llama_shape(cfg), vocab_size=cfg.vocab_size, eps=cfg.norm_eps, tie=cfg.tie_embeddings)


def assemble_llama(ends: LlamaEnds, state: dict[str, torch.Tensor], *, theta: float) -> Llama:
    """The whole Llama of `state` (every part's tensors under the full model's names)."""
    model = Llama(ends.shape, vocab_size=ends.embed_tokens.num_embeddings, rope_theta=theta, norm_eps=ends.norm.eps,
                  tie_embeddings=ends.tie)
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise ValueError(f"assemble: the parts do not cover {missing[:5]}")
    model.load_state_dict(state)
    return model

"""A small, readable GPT: pre-norm blocks, causal SDPA attention, tied embeddings."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from swarmtrain.config import ConfigError, ModelConfig
from swarmtrain.config_presets import PRESETS, GPTShape

__all__ = ["GPT", "build_gpt", "load_init_weights", "resolve_shape", "save_init_weights"]


def resolve_shape(cfg: ModelConfig) -> GPTShape:
    """The preset's shape with any explicit (> 0) fields of `cfg` taking precedence."""
    base = PRESETS[cfg.preset]
    shape = GPTShape(
        n_layer=cfg.n_layer or base.n_layer,
        n_head=cfg.n_head or base.n_head,
        n_embd=cfg.n_embd or base.n_embd,
        context_len=cfg.context_len or base.context_len,
    )
    if shape.n_embd % shape.n_head:
        raise ValueError(f"model.n_embd ({shape.n_embd}) must be divisible by model.n_head ({shape.n_head})")
    return shape


class CausalSelfAttention(nn.Module):
    def __init__(self, shape: GPTShape, dropout: float) -> None:
        super().__init__()
        self.n_head = shape.n_head
        self.qkv = nn.Linear(shape.n_embd, 3 * shape.n_embd, bias=False)
        self.proj = nn.Linear(shape.n_embd, shape.n_embd, bias=False)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, shape: GPTShape, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(shape.n_embd)
        self.attn = CausalSelfAttention(shape, dropout)
        self.ln2 = nn.LayerNorm(shape.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(shape.n_embd, 4 * shape.n_embd, bias=False),
            nn.GELU(),
            nn.Linear(4 * shape.n_embd, shape.n_embd, bias=False),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer over `vocab_size` tokens; `forward(idx, targets)` -> (logits, loss)."""

    def __init__(self, shape: GPTShape, *, vocab_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.shape = shape
        self.vocab_size = vocab_size
        self.tok_emb = nn.Embedding(vocab_size, shape.n_embd)
        self.pos_emb = nn.Embedding(shape.context_len, shape.n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(shape, dropout) for _ in range(shape.n_layer))
        self.ln_f = nn.LayerNorm(shape.n_embd)
        self.head = nn.Linear(shape.n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied embeddings
        self.activation_checkpointing = False  # train.activation_checkpointing, set by the builder
        self._init_weights(generator=None)

    @torch.no_grad()
    def _init_weights(self, *, generator: torch.Generator | None) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02, generator=generator)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.shape.n_layer), generator=generator)

    @torch.no_grad()
    def _seeded_init(self, seed: int) -> None:
        """Initialise from a private generator: the same bits `torch.manual_seed(seed)` + `GPT(...)` gave.

        The torch layers' own constructor init is replayed first (its values are overwritten, but it
        advances the generator), so the weights equal those of a model built on the global RNG.
        """
        generator = torch.Generator().manual_seed(seed)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.kaiming_uniform_(m.weight, a=math.sqrt(5), generator=generator)
                if m.bias is not None:
                    bound = 1 / math.sqrt(m.in_features)
                    nn.init.uniform_(m.bias, -bound, bound, generator=generator)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, generator=generator)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()
        self._init_weights(generator=generator)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # idx (B, T) -> logits (B, T, V)
        _, t = idx.shape
        if t > self.shape.context_len:
            raise ValueError(f"sequence length {t} exceeds the model's context_len {self.shape.context_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = (checkpoint(block, x, use_reentrant=False) if self.activation_checkpointing and self.training
                 else block(x))
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build_gpt(cfg: ModelConfig, *, seed: int | None = None) -> GPT:
    """Build a GPT from config; with `seed` the initial weights are reproducible.

    With `cfg.init_from` the weights come from that safetensors state_dict instead (after the
    seeded init, so buffers and RNG use are the same either way).
    """
    shape = resolve_shape(cfg)
    if seed is None:
        model = GPT(shape, vocab_size=cfg.vocab_size, dropout=cfg.dropout)
    else:
        # Not via torch's global RNG: peers sharing a process build models while others train, and
        # training swaps the global RNG state (worker.train_inner's fork_rng). A seeded init drawing
        # from it then differed between peers, which started the swarm from different θ.
        with torch.device("meta"):  # no storage, no RNG draws
            model = GPT(shape, vocab_size=cfg.vocab_size, dropout=cfg.dropout)
        model.to_empty(device="cpu")
        model.head.weight = model.tok_emb.weight  # to_empty gives each module its own tensor
        model._seeded_init(seed)
    if cfg.init_from:
        load_init_weights(model, cfg.init_from)
    return model


def load_init_weights(model: nn.Module, path: str) -> None:
    """Load `model.init_from`: every tensor of the model's state_dict, same names and shapes, nothing else."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise ConfigError(f"model.init_from: {path}: no such file")
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"model.init_from: {path}: not a readable safetensors file ({e})") from e
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or extra:
        raise ConfigError(f"model.init_from: {path} does not fit this model: missing {missing[:5]}, "
                          f"unexpected {extra[:5]}")
    wrong = [f"{k} {tuple(tensors[k].shape)} != {tuple(v.shape)}" for k, v in own.items()
             if tensors[k].shape != v.shape]
    if wrong:
        raise ConfigError(f"model.init_from: {path} does not fit this model: {wrong[:5]}")
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in tensors.items()})


def save_init_weights(model: nn.Module, path: str | Path) -> None:
    """Write `model`'s weights where `model.init_from` can read them (tied tensors saved once each name)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}, str(path))

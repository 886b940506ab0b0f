"""A Llama-style decoder in plain torch: RoPE, RMSNorm, SwiGLU, grouped-query attention, tied or untied head.

Parameter names, shapes and the arithmetic follow `transformers.LlamaForCausalLM` (`model.embed_tokens`,
`model.layers.N.self_attn.q_proj`, ..., `model.norm`, `lm_head`; rotary halves, not interleaved pairs), so
its state_dict is a Hugging Face checkpoint as it stands and an export is a plain save (sync/export.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from swarmtrain.config import ModelConfig
from swarmtrain.config_presets import LlamaShape

__all__ = ["Llama", "LlamaLayer", "RMSNorm", "llama_shape", "rope_tables"]

INIT_STD = 0.02  # transformers' LlamaConfig.initializer_range


def llama_shape(cfg: ModelConfig) -> LlamaShape:
    """The preset's shape with any explicit (> 0) fields of `cfg` taking precedence."""
    keys = ("n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size", "context_len")
    return LlamaShape(**{k: cfg.shape_value(k) for k in keys})


class RMSNorm(nn.Module):
    def __init__(self, width: int, *, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # the mean square in fp32 whatever the autocast dtype, as transformers does
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(seq_len: int, head_dim: int, *, theta: float,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of the rotary embedding for positions 0..seq_len-1, each (T, head_dim), fp32.

    Computed per call rather than kept as buffers: a few thousand values, and nothing to re-create after a
    model is built on the meta device or moved.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = shape.n_head, shape.n_kv_head
        self.head_dim = shape.n_embd // shape.n_head
        self.q_proj = nn.Linear(shape.n_embd, shape.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(shape.n_embd, shape.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(shape.n_embd, shape.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(shape.n_head * self.head_dim, shape.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_head * self.head_dim))


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.n_embd, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.n_embd, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    """One decoder layer (transformers' `LlamaDecoderLayer`): pre-norm attention, then pre-norm SwiGLU."""

    def __init__(self, shape: LlamaShape, *, eps: float) -> None:
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.n_embd, eps=eps)
        self.post_attention_layernorm = RMSNorm(shape.n_embd, eps=eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    """`LlamaForCausalLM.model`: the embedding, the layers and the final norm (names as transformers')."""

    def __init__(self, shape: LlamaShape, *, vocab_size: int, eps: float) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, shape.n_embd)
        self.layers = nn.ModuleList(LlamaLayer(shape, eps=eps) for _ in range(shape.n_layer))
        self.norm = RMSNorm(shape.n_embd, eps=eps)


class Llama(nn.Module):
    """Decoder-only Llama over `vocab_size` tokens; `forward(idx, targets)` -> (logits, loss)."""

    def __init__(self, shape: LlamaShape, *, vocab_size: int, rope_theta: float = 10000.0, norm_eps: float = 1e-5,
                 tie_embeddings: bool = False) -> None:
        super().__init__()
        self.shape = shape
        self.vocab_size = vocab_size
        self.rope_theta = rope_theta
        self.norm_eps = norm_eps
        self.tie_embeddings = tie_embeddings
        self.activation_checkpointing = False  # train.activation_checkpointing, set by the builder
        self.model = _Body(shape, vocab_size=vocab_size, eps=norm_eps)
        self.lm_head = nn.Linear(shape.n_embd, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def seeded_init(self, generator: torch.Generator | None) -> None:
        """transformers' init: N(0, 0.02) matrices and embeddings, unit norms; drawn from `generator` in
        parameter order (a tied head is drawn once, as the embedding)."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                nn.init.normal_(p, mean=0.0, std=INIT_STD, generator=generator)

    def retie(self) -> None:
        """Tie the head to the embedding again (`to_empty` gives each module its own tensor)."""
        if self.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def layers(self) -> Iterator[LlamaLayer]:
        yield from self.model.layers  # type: ignore[misc]

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # idx (B, T) -> logits (B, T, V)
        t = idx.shape[1]
        if t > self.shape.context_len:
            raise ValueError(f"sequence length {t} exceeds the model's context_len {self.shape.context_len}")
        cos, sin = rope_tables(t, self.shape.n_embd // self.shape.n_head, theta=self.rope_theta, device=idx.device)
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            if self.activation_checkpointing and self.training:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        logits = self.lm_head(self.model.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

"""Named GPT shapes, from a ~0.1M-parameter test model to GPT-2 small's 124M."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRESETS", "GPTShape"]


@dataclass(frozen=True)
class GPTShape:
    n_layer: int
    n_head: int
    n_embd: int
    context_len: int


# Parameter counts are for the byte-level vocabulary (256); `gpt2-124m` is 124M with GPT-2's
# 50257-token vocabulary and ~86M with bytes.
PRESETS: dict[str, GPTShape] = {
    "tiny": GPTShape(n_layer=2, n_head=4, n_embd=64, context_len=256),  # ~0.12M, unit tests
    "small": GPTShape(n_layer=4, n_head=4, n_embd=128, context_len=256),  # ~0.85M, benchmarks
    "base": GPTShape(n_layer=6, n_head=8, n_embd=256, context_len=256),  # ~4.8M
    "medium": GPTShape(n_layer=8, n_head=8, n_embd=512, context_len=512),  # ~25M
    "gpt2-124m": GPTShape(n_layer=12, n_head=12, n_embd=768, context_len=1024),
}

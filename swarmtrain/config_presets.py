"""Named model shapes of each built-in architecture, from test sizes to OpenDiLoCo's 150M and a 1B Llama."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LLAMA_PRESETS", "PRESETS", "GPTShape", "LlamaShape", "presets_of"]


@dataclass(frozen=True)
class GPTShape:
    n_layer: int
    n_head: int
    n_embd: int
    context_len: int


@dataclass(frozen=True)
class LlamaShape:
    n_layer: int
    n_head: int
    n_kv_head: int  # grouped-query attention: n_head / n_kv_head query heads share one key/value head
    n_embd: int
    intermediate_size: int  # SwiGLU's hidden width
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

# Counts without the embeddings (they depend on the tokenizer's vocabulary).
LLAMA_PRESETS: dict[str, LlamaShape] = {
    "tiny": LlamaShape(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=192, context_len=256),  # ~0.1M
    "small": LlamaShape(n_layer=4, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=384,
                        context_len=256),  # ~0.7M
    "base": LlamaShape(n_layer=6, n_head=8, n_kv_head=4, n_embd=256, intermediate_size=768,
                       context_len=512),  # ~4.3M
    # OpenDiLoCo's 150M shape (hidden 1024, 12 layers, 16 heads, SwiGLU 2688): ~149M without embeddings.
    "150m": LlamaShape(n_layer=12, n_head=16, n_kv_head=16, n_embd=1024, intermediate_size=2688,
                       context_len=1024),
    # TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 query / 4 key-value heads, SwiGLU 5632): ~0.97B.
    "1b": LlamaShape(n_layer=22, n_head=32, n_kv_head=4, n_embd=2048, intermediate_size=5632, context_len=2048),
}


def presets_of(arch: str) -> dict[str, GPTShape] | dict[str, LlamaShape]:
    """The presets of a built-in architecture (`gpt` or `llama`)."""
    if arch == "gpt":
        return PRESETS
    if arch == "llama":
        return LLAMA_PRESETS
    raise ValueError(f"model.arch {arch!r} has no presets (only gpt and llama do)")

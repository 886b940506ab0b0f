"""Validation figures beside the loss: perplexity, and bits per byte, which compares runs across tokenizers.

Bits per byte = the validation loss (nats per token) × tokens per byte / ln 2, where tokens per byte is that
of the fixed validation windows: their target tokens against the UTF-8 bytes of the text they decode to
(exactly 1 for byte tokens).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from swarmtrain.data.tokenizer import BytesTokenizer, Tokenizer

__all__ = ["bits_per_byte", "bytes_per_token", "perplexity"]


def bytes_per_token(batches: Sequence[tuple[torch.Tensor, torch.Tensor]], tokenizer: Tokenizer) -> float:
    """UTF-8 bytes of text per target token of `batches`."""
    if isinstance(tokenizer, BytesTokenizer):
        return 1.0
    tokens = sum(y.numel() for _, y in batches)
    text_bytes = sum(len(tokenizer.decode(row).encode("utf-8")) for _, y in batches for row in y.tolist())
    if not tokens or not text_bytes:
        raise ValueError("bytes_per_token: the validation batches decode to no text")
    return text_bytes / tokens


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))


def bits_per_byte(loss: float, *, bytes_per_token: float) -> float:
    return loss / (math.log(2) * bytes_per_token)

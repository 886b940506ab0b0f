"""Activations and gradients on the wire: the run's activation codec, sizes checked before decoding."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from swarmtrain.compress import get_codec
from swarmtrain.compress.codec import Codec, CodecError
from swarmtrain.pipeline.errors import BadActivation

__all__ = ["TensorCodec"]

_HEADER_BYTES = 4096  # more than any codec's header and checksum


class TensorCodec:
    """Encodes (B, T, C) float32 tensors with a codec; decodes only shapes within `max_shape`."""

    def __init__(self, name: str, *, max_shape: tuple[int, int, int]) -> None:
        self.codec: Codec = get_codec(name)
        self.max_shape = max_shape

    @property
    def max_bytes(self) -> int:
        """The largest encoding of a tensor within `max_shape` (fp32, the widest codec, and its header)."""
        return math.prod(self.max_shape) * 4 + _HEADER_BYTES

    def encode(self, t: torch.Tensor) -> tuple[list[int], bytes]:
        return list(t.shape), self.codec.encode(t.detach().reshape(-1).to(torch.float32).contiguous())

    def decode(self, shape: Sequence[int], data: bytes, *, what: str) -> torch.Tensor:
        """The tensor of `shape` in `data`; BadActivation naming `what` when either is off."""
        if len(shape) != 3 or any(not 1 <= d <= m for d, m in zip(shape, self.max_shape, strict=True)):
            raise BadActivation(f"{what}: shape {tuple(shape)} is not within {self.max_shape}")
        try:
            flat = self.codec.decode(data)
        except CodecError as e:
            raise BadActivation(f"{what}: {e}") from None
        if flat.numel() != math.prod(shape):
            raise BadActivation(f"{what}: {flat.numel()} values for shape {tuple(shape)}")
        if not bool(torch.isfinite(flat).all()):
            raise BadActivation(f"{what} holds NaN or Inf")
        return flat.reshape(*shape)

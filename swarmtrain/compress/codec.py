"""The Codec protocol: tensors <-> self-describing bytes, plus the reducer's decode-accumulate."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol, overload, runtime_checkable

import torch

__all__ = ["Allocator", "Codec", "CodecError", "CodecOptionError"]

Allocator = Callable[[int], memoryview]  # n -> n writable bytes the caller owns (e.g. pooled memory)


class CodecError(ValueError):
    """Encoded bytes are malformed (bad header, truncated, oversized, non-finite scales...), or a
    tensor cannot be encoded (NaN/Inf, fp16 overflow) or decoded into the given `out`."""


class CodecOptionError(ValueError):
    """A codec was asked for with an unknown name or an invalid option; the message names which."""


@runtime_checkable
class Codec(Protocol):
    """Encodes a tensor into the versioned wire format and back.

    `decode` returns a new fp32 tensor of the encoded shape; `decode_accumulate` adds the decoded
    values into `out` (fp32, same number of elements) without allocating the decoded tensor.
    Both raise `CodecError` on any malformed input and never return a wrong tensor.
    """

    name: str
    device: torch.device  # where it quantizes and decodes: `decode_accumulate`'s `out` lives there
    # A flat tensor cut at multiples of `alignment` elements encodes piece by piece exactly as the
    # whole does (the quantization blocks line up), so shards of an all-reduce lose what the
    # whole-tensor round trip says they lose: error feedback depends on it.
    alignment: int

    @overload
    def encode(self, tensor: torch.Tensor) -> bytes: ...

    @overload
    def encode(self, tensor: torch.Tensor, *, into: Allocator) -> memoryview: ...

    def encode(self, tensor: torch.Tensor, *, into: Allocator | None = None) -> bytes | memoryview:
        """The encoded message: new bytes, or with `into` the same bytes written into memory it gives (one
        round's pushes and means in reused buffers, not fresh pages each round)."""
        ...

    @overload
    def encode_from(self, read: Callable[[int, int], torch.Tensor], numel: int) -> bytes: ...

    @overload
    def encode_from(self, read: Callable[[int, int], torch.Tensor], numel: int, *, into: Allocator) -> memoryview: ...

    def encode_from(self, read: Callable[[int, int], torch.Tensor], numel: int, *,
                    into: Allocator | None = None) -> bytes | memoryview:
        """`encode(read(0, numel))` to the bit, for a flat fp32 source read a piece at a time."""
        ...

    def decode(self, data: bytes | bytearray | memoryview) -> torch.Tensor: ...

    def decode_accumulate(self, data: bytes | bytearray | memoryview, out: torch.Tensor, *,
                          checked: bool = False) -> None:
        """`out += decode(data)`, to the bit; `checked` as for `decode_pieces`."""
        ...

    def decode_pieces(self, data: bytes | bytearray | memoryview, *, numel: int,
                      checked: bool = False) -> Iterator[tuple[int, torch.Tensor]]:
        """The decoded flat tensor as (offset, values) pieces of a few MB, in order, the same bits as
        `decode`; each piece's values are overwritten by the next (one piece, the whole, where the codec
        cannot decode a range). `checked`: `data` passed `validate` before and has not changed since (a
        round's material, named by its digest): its checksum and wire values are not checked again."""
        ...

    def validate(self, data: bytes | bytearray | memoryview, *, numel: int) -> None:
        """CodecError unless `data` decodes to `numel` finite values: what `decode` would refuse or yield
        as NaN or Inf, found without a decoded tensor where the payload tells (block scales, wire values)."""
        ...

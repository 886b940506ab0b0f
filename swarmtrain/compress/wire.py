"""The versioned wire format of one encoded tensor: header layout, decode limits, checksum, framing.

Layout (little endian; docs/wire-format.md has the byte table):
  fixed header (32 B) | shape (8 B per dim) | payload (`payload_len` bytes, zstd-compressed if flagged)
The checksum (xxh3-64) covers every byte of the message except the checksum field itself.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum, IntFlag

import numpy as np
import torch
import xxhash

from swarmtrain.compress.codec import CodecError

__all__ = [
    "DTYPE_CODES",
    "HEADER_SIZE_BYTES",
    "MAGIC",
    "MAX_NDIM",
    "VERSION",
    "CodecId",
    "DecodeLimits",
    "Flags",
    "Header",
    "frame",
    "parse",
]

if sys.byteorder != "little":  # payloads are raw tensor memory; a big-endian host would need byte swaps
    raise ImportError("swarmtrain.compress needs a little-endian host")

MAGIC = b"SWTC"
VERSION = 1
MAX_NDIM = 8
MAX_BLOCK_SIZE = 1 << 20
_FIXED = struct.Struct("<4sBBBBIB3xQQ")  # magic ver codec flags dtype block_size ndim pad payload_len checksum
HEADER_SIZE_BYTES = _FIXED.size
_CHECKSUM_OFFSET = 24
assert HEADER_SIZE_BYTES == 32


class CodecId(IntEnum):
    """Codec identifiers on the wire (never renumber: the golden-bytes test pins them)."""

    FP32 = 1
    FP16 = 2
    BF16 = 3
    INT8 = 4
    INT4 = 5
    SPARSE = 6


class Flags(IntFlag):
    """Header flag bits; any other bit set is a CodecError."""

    ZSTD = 1
    SCALE_FP16 = 2
    STOCHASTIC = 4  # informational: the sender used stochastic rounding


DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


@dataclass(frozen=True)
class DecodeLimits:
    """What a decoder accepts before allocating anything (a peer's bytes are untrusted)."""

    max_numel: int = 1 << 31
    max_bytes: int = 1 << 33

    def __post_init__(self) -> None:
        if self.max_numel < 0 or self.max_bytes < HEADER_SIZE_BYTES:
            raise ValueError(f"DecodeLimits: max_numel must be >= 0 and max_bytes >= {HEADER_SIZE_BYTES}")


@dataclass(frozen=True)
class Header:
    """A parsed, validated header. `payload_len` is the on-wire (possibly compressed) payload size."""

    codec_id: CodecId
    flags: Flags
    dtype: torch.dtype
    block_size: int
    shape: tuple[int, ...]
    payload_len: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def header_len(self) -> int:
        return HEADER_SIZE_BYTES + 8 * len(self.shape)


def frame(header: Header, payload: Sequence[memoryview], *,
          into: Callable[[int], memoryview] | None = None) -> bytes | memoryview:
    """Joins header, shape and payload parts (flat byte buffers) into one message with its checksum: new bytes,
    or written into `into(size)` (memory the caller reuses; the parts are copied without the GIL)."""
    if len(header.shape) > MAX_NDIM:
        raise CodecError(f"tensor has {len(header.shape)} dims; the wire format allows at most {MAX_NDIM}")
    size = sum(p.nbytes for p in payload)
    assert size == header.payload_len, (size, header.payload_len)
    fixed = bytearray(_pack_fixed(header, checksum=0))
    shape_bytes = struct.pack(f"<{len(header.shape)}Q", *header.shape)
    h = xxhash.xxh3_64(memoryview(fixed)[:_CHECKSUM_OFFSET])
    h.update(shape_bytes)
    for part in payload:
        h.update(part)
    struct.pack_into("<Q", fixed, _CHECKSUM_OFFSET, h.intdigest())
    if into is None:
        return b"".join([fixed, shape_bytes, *payload])
    out = into(len(fixed) + len(shape_bytes) + size)
    at = 0
    for part in (memoryview(fixed), memoryview(shape_bytes), *payload):
        n = part.nbytes
        if n:
            np.copyto(np.frombuffer(out, dtype=np.uint8, count=n, offset=at), np.frombuffer(part, dtype=np.uint8))
        at += n
    return out


def _pack_fixed(header: Header, *, checksum: int) -> bytes:
    return _FIXED.pack(MAGIC, VERSION, int(header.codec_id), int(header.flags), DTYPE_CODES[header.dtype],
                       header.block_size, len(header.shape), header.payload_len, checksum)


def parse(data: bytes | bytearray | memoryview, *, limits: DecodeLimits,
          verify_checksum: bool = True) -> tuple[Header, memoryview]:
    """Validates everything the header claims and returns it with the (still encoded) payload view.
    `verify_checksum=False` only for bytes that passed it before and are known unchanged since.

    Checks run cheapest first so garbage is rejected before any hashing; nothing is allocated
    from a size the sender chose until the checksum and the limits have passed.
    """
    mv = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
    if mv.nbytes < HEADER_SIZE_BYTES:
        raise CodecError(f"truncated: {mv.nbytes} bytes is shorter than the {HEADER_SIZE_BYTES}-byte header")
    if mv.nbytes > limits.max_bytes:
        raise CodecError(f"oversized: message of {mv.nbytes} bytes exceeds max_bytes={limits.max_bytes}")
    magic, version, codec_id, flags, dtype_code, block_size, ndim, payload_len, checksum = _FIXED.unpack_from(mv)
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise CodecError(f"unsupported wire version {version} (this build reads {VERSION})")
    if codec_id not in CodecId._value2member_map_:
        raise CodecError(f"unknown codec id {codec_id}")
    if flags & ~int(Flags.ZSTD | Flags.SCALE_FP16 | Flags.STOCHASTIC):
        raise CodecError(f"unknown flag bits 0x{flags:02x}")
    if dtype_code not in _CODE_DTYPES:
        raise CodecError(f"unknown dtype code {dtype_code}")
    if ndim > MAX_NDIM:
        raise CodecError(f"ndim {ndim} exceeds the maximum of {MAX_NDIM}")
    header_len = HEADER_SIZE_BYTES + 8 * ndim
    if mv.nbytes < header_len:
        raise CodecError(f"truncated: {mv.nbytes} bytes cannot hold a header with {ndim} dims")
    shape = struct.unpack_from(f"<{ndim}Q", mv, HEADER_SIZE_BYTES)
    if any(d >= 1 << 63 for d in shape):  # torch sizes are int64, even beside a 0 dim
        raise CodecError(f"shape {shape} has a dimension >= 2^63")
    numel = 1
    for d in shape:
        numel *= d  # Python ints: no overflow; compared to the limit below
    if numel > limits.max_numel:
        raise CodecError(f"oversized: shape {shape} has {numel} elements, max_numel={limits.max_numel}")
    got = mv.nbytes - header_len
    if payload_len > got:
        raise CodecError(f"truncated: header declares {payload_len} payload bytes, {got} present")
    if payload_len < got:
        raise CodecError(f"trailing bytes: {got - payload_len} bytes after the declared payload")
    h = xxhash.xxh3_64(mv[:_CHECKSUM_OFFSET]) if verify_checksum else None
    if h is not None:
        h.update(mv[HEADER_SIZE_BYTES:])
    if h is not None and h.intdigest() != checksum:
        raise CodecError(f"checksum mismatch (xxh3-64 {h.intdigest():#018x}, header says {checksum:#018x})")
    header = Header(CodecId(codec_id), Flags(flags), _CODE_DTYPES[dtype_code], block_size, shape, payload_len)
    return header, mv[header_len:]

"""Reference chunked top-k sparsification with low-bit values: the contract the fused kernels match bit for bit.

A flat fp32 tensor of n values is cut into chunks of C values; the last one may be shorter (r values).
Per chunk:

* kept: the k_c values of largest |x| (k_c = k for a full chunk, min(r, ceil(k·r/C)) for a shorter last
  one). Ties go to the lower index: the order is the bits of |x| as an unsigned integer, then the index
  reversed. Their offsets within the chunk are sent in ascending order.
* scales: lo = min |kept| and hi = max |kept|, each rounded to bfloat16 (to nearest, ties to even).
* magnitudes: L = 2^(bits-1) levels, step = (hi - lo) / L (fp32). Level j decodes to lo + step · (j + 0.5),
  an fp32 multiply then an fp32 add (never fused). A kept x gets j = floor((|x| - lo) / step) (IEEE
  division) clamped to [0, L-1]; j = 0 where step is 0.
* code: (x < 0) << (bits - 1) | j.

Body layout: scales (2 bf16 per chunk: lo, hi) | codes | offsets. A chunk's codes take ceil(k_c·bits/8)
bytes and its offsets ceil(k_c·w/8) bytes, w = the bit width of C - 1 (at least 1); both are bit-packed
from the least significant bit (value i at bit i·width of its chunk's bytes), the unused high bits of a
chunk's last byte zero. Every chunk but the last is full, so chunk c's codes and offsets start at c times
a full chunk's size in their region.

Decoding adds ±level to out[chunk start + offset]. It refuses scales that are not finite or negative or
with lo > hi, offsets not strictly ascending or not below the chunk's length, and nonzero padding bits.
Non-finite input, or a kept value whose magnitude rounds to infinity in bfloat16, is refused on encode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from swarmtrain.compress.codec import CodecError

__all__ = [
    "SPARSE_BITS",
    "SparseBackend",
    "SparseLayout",
    "sparse_decode",
    "sparse_decode_accumulate",
    "sparse_encode",
    "sparse_layout",
]

SPARSE_BITS = (2, 4, 8)
MAX_CHUNK = 1 << 16


@dataclass(frozen=True)
class SparseLayout:
    """Where everything sits in a body of `numel` values cut into chunks of `chunk`, k kept per full chunk."""

    numel: int
    chunk: int
    k: int
    bits: int
    nchunks: int
    last_len: int  # values in the last chunk (0 when numel is 0)
    last_k: int  # values kept in the last chunk
    index_bits: int  # w
    code_stride: int  # bytes of a full chunk's codes
    offset_stride: int  # bytes of a full chunk's offsets
    codes_at: int  # byte where the codes start (after the scales)
    offsets_at: int  # byte where the offsets start
    body_bytes: int

    @property
    def kept(self) -> int:
        """Values sent in all."""
        return 0 if self.nchunks == 0 else (self.nchunks - 1) * self.k + self.last_k


def sparse_layout(numel: int, *, chunk: int, k: int, bits: int) -> SparseLayout:
    """The layout of a body; a ValueError names an impossible parameter."""
    if bits not in SPARSE_BITS:
        raise ValueError(f"sparse: bits {bits} is not one of {SPARSE_BITS}")
    if not 2 <= chunk <= MAX_CHUNK:
        raise ValueError(f"sparse: chunk {chunk} is not in [2, {MAX_CHUNK}]")
    if not 1 <= k <= chunk:
        raise ValueError(f"sparse: k {k} is not in [1, chunk {chunk}]")
    if numel < 0:
        raise ValueError(f"sparse: numel {numel} < 0")
    nchunks = -(-numel // chunk)
    last_len = numel - (nchunks - 1) * chunk if nchunks else 0
    last_k = min(last_len, -(-k * last_len // chunk))
    w = max(1, (chunk - 1).bit_length())
    code_stride, offset_stride = -(-k * bits // 8), -(-k * w // 8)
    codes_at = 4 * nchunks
    codes_bytes = (max(nchunks - 1, 0)) * code_stride + -(-last_k * bits // 8)
    offsets_at = codes_at + codes_bytes
    offsets_bytes = (max(nchunks - 1, 0)) * offset_stride + -(-last_k * w // 8)
    return SparseLayout(numel, chunk, k, bits, nchunks, last_len, last_k, w, code_stride, offset_stride,
                        codes_at, offsets_at, offsets_at + offsets_bytes)


class SparseBackend(Protocol):
    """What the sparse codec calls: this module (the reference) or fused kernels with the same functions."""

    def sparse_encode(self, x: torch.Tensor, *, chunk: int, k: int, bits: int) -> torch.Tensor: ...

    def sparse_decode_accumulate(self, body: torch.Tensor, *, numel: int, chunk: int, k: int, bits: int,
                                 out: torch.Tensor) -> None: ...


# -- encode ----------------------------------------------------------------------------------------

def _pack(values: torch.Tensor, width: int) -> torch.Tensor:
    """(rows, m) non-negative int64 < 2**width -> (rows, ceil(m·width/8)) uint8, LSB first, zero padded."""
    rows, m = values.shape
    shifts = torch.arange(width, device=values.device)
    bits = ((values[:, :, None] >> shifts) & 1).reshape(rows, m * width)
    pad = -(m * width) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(rows, pad)], dim=1)
    weights = 1 << torch.arange(8, device=values.device)
    return (bits.view(rows, -1, 8) * weights).sum(dim=2).to(torch.uint8)


def _select(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending offsets of the k values of largest |x| in each row (ties to the lower offset)."""
    width = rows.shape[1]
    key = rows.abs().view(torch.int32).to(torch.int64) * width
    key += torch.arange(width - 1, -1, -1, device=rows.device)
    return key.topk(k, dim=1, sorted=False).indices.sort(dim=1).values


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 (nearest, ties to even) as a float32 tensor of the rounded values; CodecError on Inf."""
    rounded = x.to(torch.bfloat16)
    if not bool(torch.isfinite(rounded).all()):
        raise CodecError("sparse: a kept value's magnitude overflows bfloat16 (> 3.39e38)")
    return rounded


def _levels(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    """(step per row as fp32, L): the divisor is a 0-dim tensor so CUDA divides instead of multiplying by
    a reciprocal."""
    levels = 1 << (bits - 1)
    return (hi - lo) / torch.full((), float(levels), dtype=torch.float32, device=lo.device), levels


def _encode_rows(rows: torch.Tensor, k: int, bits: int, width: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """(scales bf16 (rows, 2), packed codes, packed offsets) of equally long chunks."""
    offsets = _select(rows, k)
    kept = rows.gather(1, offsets)
    mags = kept.abs()
    scales = _bf16_bits(torch.stack([mags.amin(dim=1), mags.amax(dim=1)], dim=1))
    lo, hi = scales[:, 0].float(), scales[:, 1].float()
    step, levels = _levels(lo, hi, bits)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    j = torch.floor((mags - lo[:, None]) / safe[:, None]).clamp_(0, levels - 1)
    j = torch.where(step[:, None] > 0, j, torch.zeros_like(j)).to(torch.int64)
    codes = ((kept < 0).to(torch.int64) << (bits - 1)) | j
    return scales, _pack(codes, bits), _pack(offsets, width)


def sparse_encode(x: torch.Tensor, *, chunk: int, k: int, bits: int) -> torch.Tensor:
    """Flat fp32 x -> the body (uint8, on x's device). CodecError on NaN/Inf or a bfloat16 overflow."""
    assert x.dim() == 1 and x.dtype == torch.float32, (x.shape, x.dtype)
    lay = sparse_layout(x.numel(), chunk=chunk, k=k, bits=bits)
    body = torch.zeros(lay.body_bytes, dtype=torch.uint8, device=x.device)
    if lay.nchunks == 0:
        return body
    if x.numel():
        lo, hi = torch.aminmax(x)
        if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
            raise CodecError("non-finite input: the tensor holds NaN or Inf")
    full = lay.nchunks - 1
    scale_rows: list[torch.Tensor] = []
    code_parts: list[torch.Tensor] = []
    offset_parts: list[torch.Tensor] = []
    if full:
        s, c, o = _encode_rows(x[: full * chunk].view(full, chunk), k, bits, lay.index_bits)
        scale_rows.append(s)
        code_parts.append(c.reshape(-1))
        offset_parts.append(o.reshape(-1))
    s, c, o = _encode_rows(x[full * chunk:].view(1, lay.last_len), lay.last_k, bits, lay.index_bits)
    scale_rows.append(s)
    code_parts.append(c.reshape(-1))
    offset_parts.append(o.reshape(-1))
    body[: lay.codes_at] = torch.cat(scale_rows).reshape(-1).view(torch.uint8)
    body[lay.codes_at: lay.offsets_at] = torch.cat(code_parts)
    body[lay.offsets_at:] = torch.cat(offset_parts)
    return body


# -- decode ----------------------------------------------------------------------------------------

def _unpack(packed: torch.Tensor, m: int, width: int, *, what: str) -> torch.Tensor:
    """(rows, nbytes) uint8 -> (rows, m) int64; CodecError when a padding bit is set."""
    rows = packed.shape[0]
    bits = ((packed[:, :, None].to(torch.int64) >> torch.arange(8, device=packed.device)) & 1).reshape(rows, -1)
    if bool(bits[:, m * width:].any()):
        raise CodecError(f"sparse: padding bits after the {what} are not zero")
    shifts = torch.arange(width, device=packed.device)
    return (bits[:, : m * width].view(rows, m, width) << shifts).sum(dim=2)


def _decode_rows(scales: torch.Tensor, codes: torch.Tensor, offsets: torch.Tensor, *, k: int, bits: int,
                 width: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets (rows, k) int64, values (rows, k) fp32) of equally long chunks, after checking them."""
    lo, hi = scales[:, 0].float(), scales[:, 1].float()
    if scales.numel():
        if not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
            raise CodecError("sparse: non-finite (NaN/Inf) chunk scale")
        if bool((lo < 0).any()) or bool((lo > hi).any()):
            raise CodecError("sparse: a chunk's scales are negative or lo > hi")
    offs = _unpack(offsets, k, width, what="offsets")
    if bool((offs >= length).any()):
        raise CodecError(f"sparse: an offset is not below its chunk's length {length}")
    if k > 1 and bool((offs[:, 1:] <= offs[:, :-1]).any()):
        raise CodecError("sparse: offsets within a chunk are not strictly ascending")
    code = _unpack(codes, k, bits, what="codes")
    step, _ = _levels(lo, hi, bits)
    j = (code & ((1 << (bits - 1)) - 1)).to(torch.float32)
    mags = step[:, None] * (j + 0.5)
    mags = mags + lo[:, None]
    return offs, torch.where((code >> (bits - 1)) == 1, -mags, mags)


def sparse_decode_accumulate(body: torch.Tensor, *, numel: int, chunk: int, k: int, bits: int,
                             out: torch.Tensor) -> None:
    """out (fp32, contiguous, numel values, on body's device) += the decoded values. CodecError when the
    body is malformed (out is then untouched)."""
    lay = sparse_layout(numel, chunk=chunk, k=k, bits=bits)
    assert body.dtype == torch.uint8 and body.numel() == lay.body_bytes, (body.dtype, body.numel(), lay.body_bytes)
    assert out.dtype == torch.float32 and out.is_contiguous() and out.numel() == numel, (out.dtype, out.shape)
    if lay.nchunks == 0:
        return
    full = lay.nchunks - 1
    scales = body[: lay.codes_at].view(torch.bfloat16).view(lay.nchunks, 2)
    codes, offsets = body[lay.codes_at: lay.offsets_at], body[lay.offsets_at:]
    index: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    if full:
        offs, vals = _decode_rows(scales[:full], codes[: full * lay.code_stride].view(full, lay.code_stride),
                                  offsets[: full * lay.offset_stride].view(full, lay.offset_stride), k=k, bits=bits,
                                  width=lay.index_bits, length=chunk)
        base = torch.arange(full, device=body.device)[:, None] * chunk
        index.append((offs + base).reshape(-1))
        values.append(vals.reshape(-1))
    offs, vals = _decode_rows(scales[full:], codes[full * lay.code_stride:].view(1, -1),
                              offsets[full * lay.offset_stride:].view(1, -1), k=lay.last_k, bits=bits,
                              width=lay.index_bits, length=lay.last_len)
    index.append((offs + full * chunk).reshape(-1))
    values.append(vals.reshape(-1))
    idx, val = torch.cat(index), torch.cat(values)
    flat = out.view(-1)
    flat[idx] += val  # offsets are unique: one add per element


def sparse_decode(body: torch.Tensor, *, numel: int, chunk: int, k: int, bits: int) -> torch.Tensor:
    """The decoded values as a new fp32 tensor (zeros where nothing was kept)."""
    out = torch.zeros(numel, dtype=torch.float32, device=body.device)
    sparse_decode_accumulate(body, numel=numel, chunk=chunk, k=k, bits=bits, out=out)
    return out

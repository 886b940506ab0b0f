"""Reference blockwise int8/int4 quantization on flat fp32 tensors: the contract fused kernels must match.

Plain torch, any device. Blocks are `block_size` consecutive elements (the last may be partial).
scale_b = absmax_b / qmax (IEEE fp32 division; qmax 127 for int8, 7 for int4); with fp16 scales the
scale is rounded to the nearest fp16 and bumped one fp16 step up if that fell below the fp32 scale,
so |q| <= qmax always holds. q = rint(x / scale) (round half to even) or floor(x / scale + u) with
u ~ U[0, 1) (stochastic), clamped to [-qmax, qmax]; a block whose scale is 0 gets q = 0.
Decode is one fp32 multiply per element, float(q) * scale, added to `out` by the accumulate form.
int4 stores nibble = q + 8; byte j holds element 2j in its low nibble and 2j+1 in its high nibble.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from swarmtrain.compress.codec import CodecError

__all__ = [
    "INT4_QMAX",
    "INT8_QMAX",
    "QuantBackend",
    "int4_dequantize",
    "int4_dequantize_accumulate",
    "int4_quantize",
    "int8_dequantize",
    "int8_dequantize_accumulate",
    "int8_quantize",
    "num_blocks",
]

INT8_QMAX = 127
INT4_QMAX = 7
_CHUNK_ELEMENTS = 1 << 20  # bounds the fp32 temporary of the accumulate path


class QuantBackend(Protocol):
    """What codecs call: this module (the reference) or a fused-kernel backend with the same functions."""

    def int8_quantize(self, x: torch.Tensor, *, block_size: int, scale_fp16: bool, stochastic: bool,
                      generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def int8_dequantize(self, q: torch.Tensor, scales: torch.Tensor, *, block_size: int) -> torch.Tensor: ...

    def int8_dequantize_accumulate(self, q: torch.Tensor, scales: torch.Tensor, *, block_size: int,
                                   out: torch.Tensor) -> None: ...

    def int4_quantize(self, x: torch.Tensor, *, block_size: int, scale_fp16: bool, stochastic: bool,
                      generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def int4_dequantize(self, packed: torch.Tensor, scales: torch.Tensor, *, numel: int,
                        block_size: int) -> torch.Tensor: ...

    def int4_dequantize_accumulate(self, packed: torch.Tensor, scales: torch.Tensor, *, block_size: int,
                                   out: torch.Tensor) -> None: ...


def num_blocks(numel: int, *, block_size: int) -> int:
    return -(-numel // block_size)


def _padded_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """(nblocks, block_size) view of flat x, zero-padded (zeros change no absmax and quantize to 0)."""
    assert x.dim() == 1 and x.dtype == torch.float32, (x.shape, x.dtype)
    pad = -x.numel() % block_size
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, block_size)


def _scales(absmax: torch.Tensor, *, qmax: int, scale_fp16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales as sent: fp32 or fp16, the same scales as fp32 for quantizing)."""
    if not bool(torch.isfinite(absmax).all()):
        raise CodecError("non-finite input: the tensor holds NaN or Inf")
    # a 0-dim tensor divisor, not a Python number: CUDA turns division by a host scalar into a
    # multiplication by its reciprocal, which is not IEEE division and would break kernel parity
    scale = absmax / torch.full((), float(qmax), dtype=torch.float32, device=absmax.device)
    if not scale_fp16:
        return scale, scale
    s16 = scale.to(torch.float16)
    low = s16.float() < scale
    # scales are >= 0, so the next fp16 value up is the next bit pattern
    s16 = torch.where(low, (s16.view(torch.int16) + 1).view(torch.float16), s16)
    if not bool(torch.isfinite(s16).all()):
        raise CodecError(f"block scale overflows fp16 (absmax > {65504 * qmax:g}): use fp32 scales")
    return s16, s16.float()


def _quantize(x: torch.Tensor, *, qmax: int, block_size: int, scale_fp16: bool, stochastic: bool,
              generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q as int8 over the padded blocks, shape (nblocks, block_size); scales as sent)."""
    xb = _padded_blocks(x, block_size)
    sent, scale = _scales(xb.abs().amax(dim=1), qmax=qmax, scale_fp16=scale_fp16)
    y = xb / scale[:, None]
    if stochastic:
        u = torch.rand(xb.shape, generator=generator, dtype=torch.float32, device=xb.device)
        q = torch.floor(y.add_(u))
    else:
        q = torch.round(y)  # round half to even, like rintf / __float2int_rn
    q = q.clamp_(-qmax, qmax).masked_fill_((scale == 0)[:, None], 0)
    return q.to(torch.int8), sent


def int8_quantize(x: torch.Tensor, *, block_size: int, scale_fp16: bool, stochastic: bool,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat fp32 x (n) -> (q int8 (n), scales fp32 or fp16 (nblocks)). Raises CodecError on NaN/Inf."""
    q, scales = _quantize(x, qmax=INT8_QMAX, block_size=block_size, scale_fp16=scale_fp16,
                          stochastic=stochastic, generator=generator)
    return q.view(-1)[: x.numel()], scales


def int4_quantize(x: torch.Tensor, *, block_size: int, scale_fp16: bool, stochastic: bool,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat fp32 x (n) -> (packed uint8 (ceil(n/2)), scales fp32 or fp16 (nblocks)); block_size even."""
    assert block_size % 2 == 0, block_size
    q, scales = _quantize(x, qmax=INT4_QMAX, block_size=block_size, scale_fp16=scale_fp16,
                          stochastic=stochastic, generator=generator)
    nib = (q.view(-1, 2) + 8).to(torch.uint8)  # padding elements have q = 0 -> nibble 8
    packed = nib[:, 0] | (nib[:, 1] << 4)
    return packed[: -(-x.numel() // 2)], scales


def _check_out(out: torch.Tensor, numel: int) -> None:
    assert out.dtype == torch.float32 and out.is_contiguous() and out.numel() == numel, (out.dtype, out.shape)


def _accumulate(decode_chunk: Callable[[int, int], torch.Tensor], n: int, *, block_size: int,
                out: torch.Tensor) -> None:
    """Runs decode_chunk(start, stop) -> fp32 values for out[start:stop] in block-aligned chunks."""
    flat = out.view(-1)
    step = max(_CHUNK_ELEMENTS // block_size, 1) * block_size
    for start in range(0, n, step):
        stop = min(start + step, n)
        flat[start:stop].add_(decode_chunk(start, stop))


def _int8_chunk(q: torch.Tensor, scales: torch.Tensor, block_size: int, start: int, stop: int) -> torch.Tensor:
    s = scales[start // block_size: num_blocks(stop, block_size=block_size)].float()
    vals = q[start:stop].float()
    full = (stop - start) // block_size * block_size
    vals[:full].view(-1, block_size).mul_(s[: full // block_size, None])
    if full < stop - start:
        vals[full:].mul_(s[-1])
    return vals


def int8_dequantize(q: torch.Tensor, scales: torch.Tensor, *, block_size: int) -> torch.Tensor:
    """x̂ (fp32, flat) = float(q) * scale of its block."""
    return _int8_chunk(q, scales, block_size, 0, q.numel())


def int8_dequantize_accumulate(q: torch.Tensor, scales: torch.Tensor, *, block_size: int,
                               out: torch.Tensor) -> None:
    """out (fp32, contiguous, numel n) += float(q) * scale, without a full-size temporary."""
    _check_out(out, q.numel())
    _accumulate(lambda a, b: _int8_chunk(q, scales, block_size, a, b), q.numel(), block_size=block_size, out=out)


def _int4_chunk(packed: torch.Tensor, scales: torch.Tensor, block_size: int, start: int,
                stop: int) -> torch.Tensor:
    """Decoded values of elements [start, stop); start is block- (hence byte-) aligned."""
    bytes_ = packed[start // 2: -(-stop // 2)]
    nib = torch.stack([bytes_ & 0x0F, bytes_ >> 4], dim=1).view(-1)[: stop - start]
    q = nib.to(torch.int8) - 8
    return _int8_chunk(q, scales[start // block_size:], block_size, 0, stop - start)


def int4_dequantize(packed: torch.Tensor, scales: torch.Tensor, *, numel: int, block_size: int) -> torch.Tensor:
    """x̂ (fp32, flat, numel) = (nibble - 8) * scale of its block."""
    return _int4_chunk(packed, scales, block_size, 0, numel)


def int4_dequantize_accumulate(packed: torch.Tensor, scales: torch.Tensor, *, block_size: int,
                               out: torch.Tensor) -> None:
    """out (fp32, contiguous) += (nibble - 8) * scale; numel is out.numel()."""
    n = out.numel()
    _check_out(out, n)
    assert packed.numel() == -(-n // 2), (packed.numel(), n)
    _accumulate(lambda a, b: _int4_chunk(packed, scales, block_size, a, b), n, block_size=block_size, out=out)

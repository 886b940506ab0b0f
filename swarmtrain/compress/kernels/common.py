"""What the CPU and CUDA kernel wrappers share: the public QuantBackend methods, status codes, stochastic seeds."""

from __future__ import annotations

import abc

import torch

from swarmtrain.compress.codec import CodecError
from swarmtrain.compress.quant import INT8_QMAX

__all__ = ["FusedKernels", "KernelStatus", "check_status", "stochastic_seed"]


class KernelStatus:
    """Status bits every kernel returns (mirrors the enums in quant_cpu.cpp, sparse_cpu.cpp, quant_cuda.cu)."""

    OK = 0
    NON_FINITE = 1
    OVERFLOW = 2
    BAD_SCALE = 4
    BAD_OFFSET = 8  # sparse: an offset not below its chunk's length, or not strictly ascending
    BAD_PADDING = 16  # sparse: a padding bit after a chunk's codes or offsets is set
    SCALE_OVERFLOW = 32  # sparse: a kept magnitude overflows bfloat16


def check_status(status: int, *, what: str, qmax: int = INT8_QMAX) -> None:
    """Raises the CodecError the torch reference raises for the same input."""
    if status == KernelStatus.OK:
        return
    if status & KernelStatus.NON_FINITE:
        raise CodecError("non-finite input: the tensor holds NaN or Inf")
    if status & KernelStatus.OVERFLOW:
        raise CodecError(f"block scale overflows fp16 (absmax > {65504 * qmax:g}): use fp32 scales")
    if status & KernelStatus.BAD_SCALE:
        raise CodecError(f"{what}: non-finite (NaN/Inf) or negative block scale, or lo > hi")
    if status & KernelStatus.BAD_OFFSET:
        raise CodecError(f"{what}: an offset is not below its chunk's length or not strictly ascending")
    if status & KernelStatus.BAD_PADDING:
        raise CodecError(f"{what}: padding bits after a chunk's codes or offsets are not zero")
    if status & KernelStatus.SCALE_OVERFLOW:
        raise CodecError(f"{what}: a kept value's magnitude overflows bfloat16 (> 3.39e38)")
    raise AssertionError(f"{what}: unknown kernel status {status}")


def stochastic_seed(generator: torch.Generator | None) -> int:
    """A 63-bit seed drawn from `generator` (torch's default one if None): one draw per encode."""
    device = generator.device if generator is not None else torch.device("cpu")
    return int(torch.randint(0, 2**63 - 1, (1,), generator=generator, dtype=torch.int64, device=device).item())


class FusedKernels(abc.ABC):
    """`quant.QuantBackend`'s six public methods over a device's two fused entry points.

    A subclass implements `_quantize` (encode) and `_dequantize` (decode into `out`, or add into
    it); outputs are allocated on the input's device.
    """

    name: str

    @abc.abstractmethod
    def _quantize(self, x: torch.Tensor, *, int4: bool, block_size: int, scale_fp16: bool, stochastic: bool,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abc.abstractmethod
    def _dequantize(self, q: torch.Tensor, scales: torch.Tensor, *, int4: bool, numel: int, block_size: int,
                    out: torch.Tensor, accumulate: bool) -> None: ...

    def int8_quantize(self, x: torch.Tensor, *, block_size: int, scale_fp16: bool, stochastic: bool,
                      generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._quantize(x, int4=False, block_size=block_size, scale_fp16=scale_fp16, stochastic=stochastic,
                              generator=generator)

    def int4_quantize(self, x: torch.Tensor, *, block_size: int, scale_fp16: bool, stochastic: bool,
                      generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._quantize(x, int4=True, block_size=block_size, scale_fp16=scale_fp16, stochastic=stochastic,
                              generator=generator)

    def int8_dequantize(self, q: torch.Tensor, scales: torch.Tensor, *, block_size: int) -> torch.Tensor:
        out = torch.empty(q.numel(), dtype=torch.float32, device=q.device)
        self._dequantize(q, scales, int4=False, numel=q.numel(), block_size=block_size, out=out, accumulate=False)
        return out

    def int8_dequantize_accumulate(self, q: torch.Tensor, scales: torch.Tensor, *, block_size: int,
                                   out: torch.Tensor) -> None:
        self._dequantize(q, scales, int4=False, numel=q.numel(), block_size=block_size, out=out, accumulate=True)

    def int4_dequantize(self, packed: torch.Tensor, scales: torch.Tensor, *, numel: int,
                        block_size: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=torch.float32, device=packed.device)
        self._dequantize(packed, scales, int4=True, numel=numel, block_size=block_size, out=out, accumulate=False)
        return out

    def int4_dequantize_accumulate(self, packed: torch.Tensor, scales: torch.Tensor, *, block_size: int,
                                   out: torch.Tensor) -> None:
        self._dequantize(packed, scales, int4=True, numel=out.numel(), block_size=block_size, out=out,
                         accumulate=True)

"""What the CPU and CUDA kernel wrappers share: kernel status codes -> CodecError, stochastic seeds."""

from __future__ import annotations

import torch

from swarmtrain.compress.codec import CodecError
from swarmtrain.compress.quant import INT8_QMAX

__all__ = ["KernelStatus", "check_status", "stochastic_seed"]


class KernelStatus:
    """Status bits every kernel returns (mirrors the enum in quant_cpu.cpp and quant_cuda.cu)."""

    OK = 0
    NON_FINITE = 1
    OVERFLOW = 2
    BAD_SCALE = 4


def check_status(status: int, *, what: str, qmax: int = INT8_QMAX) -> None:
    """Raises the CodecError the torch reference raises for the same input."""
    if status == KernelStatus.OK:
        return
    if status & KernelStatus.NON_FINITE:
        raise CodecError("non-finite input: the tensor holds NaN or Inf")
    if status & KernelStatus.OVERFLOW:
        raise CodecError(f"block scale overflows fp16 (absmax > {65504 * qmax:g}): use fp32 scales")
    if status & KernelStatus.BAD_SCALE:
        raise CodecError(f"{what}: non-finite (NaN/Inf) or negative block scale")
    raise AssertionError(f"{what}: unknown kernel status {status}")


def stochastic_seed(generator: torch.Generator | None) -> int:
    """A 63-bit seed drawn from `generator` (torch's default one if None): one draw per encode."""
    device = generator.device if generator is not None else torch.device("cpu")
    return int(torch.randint(0, 2**63 - 1, (1,), generator=generator, dtype=torch.int64, device=device).item())

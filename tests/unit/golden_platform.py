"""What a golden θ hash is bit-exact on: torch's version, its CPU kernel set and the CPU's matrix extensions.

torch reports AVX512 alike on CPUs whose oneDNN/MKL kernels round differently in the last bit (an AMX Xeon
and one without it gave two hashes for the same trajectory), so the CPU flags that select those kernels are
part of the key; elsewhere only the losses are compared.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["golden_platform"]

_KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def golden_platform() -> dict[str, str]:
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_flags": " ".join(f for f in _KERNEL_FLAGS if f in flags)}

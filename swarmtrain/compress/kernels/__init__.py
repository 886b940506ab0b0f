"""Fused CPU and CUDA kernels for the codecs, built at run time, and the choice of which path runs.

_build.py: run-time build into a per-user cache keyed by source/flags/CPU hash. quant_cpu.cpp +
sparse_cpu.cpp + cpu.py: the fused CPU backend (C ABI via ctypes). quant_cuda.cu + sparse_cuda.cu +
cuda.py: the CUDA backend. Both cover int8/int4 and the sparse codec. common.py: status codes and
stochastic seeds. `get_backend(device)` returns a `quant.QuantBackend`: the fused kernels when they
build, otherwise the torch reference (swarmtrain.compress.quant), with one log line saying which path
runs on that device type and why. `SWARMTRAIN_KERNELS=torch` forces the reference.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from swarmtrain.compress import quant
from swarmtrain.compress.kernels._build import KernelBuildError, cache_root

__all__ = ["KernelBuildError", "backend_name", "cache_root", "fused_backend", "get_backend"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_chosen: dict[str, quant.QuantBackend] = {}


def fused_backend(device: torch.device | str) -> quant.QuantBackend:
    """The fused kernels for device's type, built now if needed; KernelBuildError says why not."""
    kind = torch.device(device).type
    if kind == "cpu":
        from swarmtrain.compress.kernels.cpu import CpuKernels

        return CpuKernels()
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise KernelBuildError("torch has no usable CUDA device")
        from swarmtrain.compress.kernels.cuda import CudaKernels

        return CudaKernels()
    raise KernelBuildError(f"no fused kernels for device type {kind!r}")


def get_backend(device: torch.device | str) -> quant.QuantBackend:
    """The quantization backend for tensors on `device`, chosen (and logged) once per device type."""
    kind = torch.device(device).type
    with _lock:
        if kind in _chosen:
            return _chosen[kind]
        forced = os.environ.get("SWARMTRAIN_KERNELS", "auto")
        if forced not in ("auto", "torch"):
            raise ValueError(f"SWARMTRAIN_KERNELS={forced!r}: expected 'auto' or 'torch'")
        backend: quant.QuantBackend
        if forced == "torch":
            backend = quant
            log.info("codec kernels on %s: torch reference path (SWARMTRAIN_KERNELS=torch)", kind)
        else:
            try:
                backend = fused_backend(kind)
                log.info("codec kernels on %s: %s path (kernel cache %s)", kind, backend_name(backend), cache_root())
            except KernelBuildError as exc:
                backend = quant
                log.warning("codec kernels on %s: torch reference path, fused kernels unavailable: %s", kind, exc)
        _chosen[kind] = backend
        return backend


def backend_name(backend: quant.QuantBackend) -> str:
    """'cpu-fused', 'cuda-fused' or 'torch-reference'."""
    return str(getattr(backend, "name", "torch-reference"))

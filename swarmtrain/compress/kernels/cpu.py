"""The fused CPU backend: quant_cpu.cpp (int8/int4) and sparse_cpu.cpp (chunked top-k) built at run time into
one library, called through ctypes (the GIL is released)."""

from __future__ import annotations

import ctypes

import torch

from swarmtrain.compress.kernels._build import build_shared_library
from swarmtrain.compress.kernels.common import FusedKernels, check_status, stochastic_seed
from swarmtrain.compress.quant import INT4_QMAX, INT8_QMAX, num_blocks
from swarmtrain.compress.sparse import sparse_layout

__all__ = ["CPU_CFLAGS", "CpuKernels"]

# Exact IEEE results: no FMA contraction, no fast-math. -fno-trapping-math/-fno-math-errno only let gcc
# vectorize floorf/rintf (they change no value); -march=native is why the cache key holds the CPU flags.
CPU_CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp")
_LDFLAGS = ("-fopenmp",)  # libgomp.so.1: the loader reuses the copy torch already loaded


_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_SIGNATURES: dict[str, list[type]] = {
    "st_int8_encode": [_P, _I64, _I64, _INT, _INT, ctypes.c_uint64, _P, _P, _INT],
    "st_int4_encode": [_P, _I64, _I64, _INT, _INT, ctypes.c_uint64, _P, _P, _INT],
    "st_int8_decode": [_P, _I64, _I64, _P, _INT, _P, _INT, _INT],
    "st_int4_decode": [_P, _I64, _I64, _P, _INT, _P, _INT, _INT],
    "st_sparse_encode": [_P, _I64, _INT, _INT, _INT, _P, _INT],
    "st_sparse_decode": [_P, _I64, _INT, _INT, _INT, _P, _INT],
}


def _flat_f32(x: torch.Tensor) -> torch.Tensor:
    assert x.dtype == torch.float32 and x.device.type == "cpu", (x.dtype, x.device)
    return x.reshape(-1).contiguous()


def _scale_args(scales: torch.Tensor) -> tuple[torch.Tensor, int]:
    assert scales.dtype in (torch.float32, torch.float16), scales.dtype
    return scales.contiguous(), int(scales.dtype == torch.float16)


class CpuKernels(FusedKernels):
    """`quant.QuantBackend` and `sparse.SparseBackend` on CPU tensors with fused, vectorized, OpenMP-threaded
    C++ kernels.

    Uses torch.get_num_threads() threads. Results equal swarmtrain.compress.quant and .sparse bit for bit,
    except stochastic rounding, whose noise comes from a counter-based hash instead of torch.rand.
    """

    name = "cpu-fused"

    def __init__(self) -> None:
        self._lib = build_shared_library("swarmtrain_quant_cpu", sources=["quant_cpu.cpp", "sparse_cpu.cpp"],
                                         cflags=CPU_CFLAGS, ldflags=_LDFLAGS)
        for fn, argtypes in _SIGNATURES.items():
            getattr(self._lib, fn).argtypes = argtypes
            getattr(self._lib, fn).restype = ctypes.c_int

    def _quantize(self, x: torch.Tensor, *, int4: bool, block_size: int, scale_fp16: bool, stochastic: bool,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        x = _flat_f32(x)
        n = x.numel()
        q = torch.empty(-(-n // 2) if int4 else n, dtype=torch.uint8 if int4 else torch.int8)
        scales = torch.empty(num_blocks(n, block_size=block_size),
                             dtype=torch.float16 if scale_fp16 else torch.float32)
        seed = stochastic_seed(generator) if stochastic else 0
        fn = self._lib.st_int4_encode if int4 else self._lib.st_int8_encode
        status = fn(x.data_ptr(), n, block_size, int(scale_fp16), int(stochastic), seed, q.data_ptr(),
                    scales.data_ptr(), torch.get_num_threads())
        check_status(status, what="int4" if int4 else "int8", qmax=INT4_QMAX if int4 else INT8_QMAX)
        return q, scales

    def _dequantize(self, q: torch.Tensor, scales: torch.Tensor, *, int4: bool, numel: int, block_size: int,
                    out: torch.Tensor, accumulate: bool) -> None:
        assert q.device.type == "cpu" and q.dtype == (torch.uint8 if int4 else torch.int8), (q.device, q.dtype)
        assert q.numel() == (-(-numel // 2) if int4 else numel), (q.numel(), numel)
        assert scales.numel() == num_blocks(numel, block_size=block_size), (scales.numel(), numel, block_size)
        assert out.dtype == torch.float32 and out.is_contiguous() and out.numel() == numel, (out.dtype, out.shape)
        q = q.contiguous()
        scales, fp16 = _scale_args(scales)
        fn = self._lib.st_int4_decode if int4 else self._lib.st_int8_decode
        status = fn(q.data_ptr(), numel, block_size, scales.data_ptr(), fp16, out.data_ptr(), int(accumulate),
                    torch.get_num_threads())
        check_status(status, what="int4" if int4 else "int8")

    def sparse_encode(self, x: torch.Tensor, *, chunk: int, k: int, bits: int) -> torch.Tensor:
        """Flat fp32 x -> the sparse body (uint8). CodecError on NaN/Inf or a bfloat16 overflow."""
        assert x.dim() == 1 and x.dtype == torch.float32, (x.shape, x.dtype)
        x = _flat_f32(x)
        lay = sparse_layout(x.numel(), chunk=chunk, k=k, bits=bits)
        body = torch.empty(lay.body_bytes, dtype=torch.uint8)
        status = self._lib.st_sparse_encode(x.data_ptr(), x.numel(), chunk, k, bits, body.data_ptr(),
                                            torch.get_num_threads())
        check_status(status, what="sparse")
        return body

    def sparse_decode_accumulate(self, body: torch.Tensor, *, numel: int, chunk: int, k: int, bits: int,
                                 out: torch.Tensor) -> None:
        """out += the decoded values; CodecError when the body is malformed (out is then untouched)."""
        lay = sparse_layout(numel, chunk=chunk, k=k, bits=bits)
        assert body.dtype == torch.uint8 and body.numel() == lay.body_bytes, (body.dtype, body.numel(),
                                                                               lay.body_bytes)
        assert out.dtype == torch.float32 and out.is_contiguous() and out.numel() == numel, (out.dtype,
                                                                                              out.shape)
        assert body.device.type == "cpu" and out.device.type == "cpu", (body.device, out.device)
        body = body.contiguous()
        status = self._lib.st_sparse_decode(body.data_ptr(), numel, chunk, k, bits, out.data_ptr(),
                                            torch.get_num_threads())
        check_status(status, what="sparse")

"""The CUDA backend: quant_cuda.cu and sparse_cuda.cu built at run time with nvcc, launched through ctypes on
torch's stream."""

from __future__ import annotations

import ctypes

import torch

from swarmtrain.compress.codec import CodecError
from swarmtrain.compress.kernels._build import build_shared_library
from swarmtrain.compress.kernels.common import FusedKernels, check_status, stochastic_seed
from swarmtrain.compress.quant import INT4_QMAX, INT8_QMAX, num_blocks
from swarmtrain.compress.sparse import sparse_layout

__all__ = ["CUDA_CFLAGS", "CudaKernels"]

# --fmad=false: q * scale + out must round twice, like the reference (the kernels also spell it with _rn).
CUDA_CFLAGS = ("-O3", "--fmad=false")
_SEGMENT = 1024  # kSegment in quant_cuda.cu: larger blocks need absmax scratch

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_SIGNATURES: dict[str, list[type]] = {
    "st_cuda_int8_encode": [_P, _I64, _I64, _INT, _INT, ctypes.c_uint64, _P, _P, _P, _P, _P],
    "st_cuda_int4_encode": [_P, _I64, _I64, _INT, _INT, ctypes.c_uint64, _P, _P, _P, _P, _P],
    "st_cuda_int8_decode": [_P, _I64, _I64, _P, _INT, _P, _INT, _P, _P],
    "st_cuda_int4_decode": [_P, _I64, _I64, _P, _INT, _P, _INT, _P, _P],
    "st_cuda_sparse_encode": [_P, _I64, _INT, _INT, _INT, _P, _P, _P],
    "st_cuda_sparse_decode": [_P, _I64, _INT, _INT, _INT, _P, _P, _P],
}


def _check_launch(rc: int, *, what: str) -> None:
    if rc == -8:
        hint = " (int4 needs an even block size)" if what == "int4" else ""
        raise ValueError(f"{what}: bad argument{hint}")
    if rc != 0:
        raise RuntimeError(f"{what}: CUDA launch failed with cudaError {rc}")


class CudaKernels(FusedKernels):
    """`quant.QuantBackend` and `sparse.SparseBackend` on CUDA tensors: fused encode / decode(-accumulate).

    Launches on the tensor's device and torch's current stream, then reads the kernel status back
    (one sync), so errors surface as the same CodecError the reference raises.
    """

    name = "cuda-fused"

    def __init__(self) -> None:
        self._lib = build_shared_library("swarmtrain_quant_cuda", sources=["quant_cuda.cu", "sparse_cuda.cu"],
                                         cflags=("-O3",), cuda_cflags=CUDA_CFLAGS)
        for fn, argtypes in _SIGNATURES.items():
            getattr(self._lib, fn).argtypes = argtypes
            getattr(self._lib, fn).restype = ctypes.c_int

    def _quantize(self, x: torch.Tensor, *, int4: bool, block_size: int, scale_fp16: bool, stochastic: bool,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        assert x.dtype == torch.float32 and x.device.type == "cuda", (x.dtype, x.device)
        x = x.reshape(-1).contiguous()
        n = x.numel()
        nb = num_blocks(n, block_size=block_size)
        dev = x.device
        q = torch.empty(-(-n // 2) if int4 else n, dtype=torch.uint8 if int4 else torch.int8, device=dev)
        scales = torch.empty(nb, dtype=torch.float16 if scale_fp16 else torch.float32, device=dev)
        scratch = torch.empty(nb if block_size > _SEGMENT else 0, dtype=torch.int32, device=dev)
        status = torch.zeros(1, dtype=torch.int32, device=dev)
        seed = stochastic_seed(generator) if stochastic else 0
        fn = self._lib.st_cuda_int4_encode if int4 else self._lib.st_cuda_int8_encode
        what = "int4" if int4 else "int8"
        with torch.cuda.device(dev):
            rc = fn(x.data_ptr(), n, block_size, int(scale_fp16), int(stochastic), seed, q.data_ptr(),
                    scales.data_ptr(), scratch.data_ptr() or None, status.data_ptr(),
                    torch.cuda.current_stream(dev).cuda_stream)
        _check_launch(rc, what=what)
        check_status(int(status.item()), what=what, qmax=INT4_QMAX if int4 else INT8_QMAX)
        return q, scales

    def _dequantize(self, q: torch.Tensor, scales: torch.Tensor, *, int4: bool, numel: int, block_size: int,
                    out: torch.Tensor, accumulate: bool) -> None:
        assert q.dtype == (torch.uint8 if int4 else torch.int8), q.dtype
        assert q.numel() == (-(-numel // 2) if int4 else numel), (q.numel(), numel)
        assert scales.numel() == num_blocks(numel, block_size=block_size), (scales.numel(), numel, block_size)
        assert scales.dtype in (torch.float32, torch.float16), scales.dtype
        assert out.dtype == torch.float32 and out.is_contiguous() and out.numel() == numel, (out.dtype, out.shape)
        dev = out.device
        if q.device != dev or scales.device != dev:
            raise CodecError(f"q on {q.device}, scales on {scales.device}, out on {dev}: all must share a device")
        q, scales = q.contiguous(), scales.contiguous()
        status = torch.zeros(1, dtype=torch.int32, device=dev)
        fn = self._lib.st_cuda_int4_decode if int4 else self._lib.st_cuda_int8_decode
        what = "int4" if int4 else "int8"
        with torch.cuda.device(dev):
            rc = fn(q.data_ptr(), numel, block_size, scales.data_ptr(), int(scales.dtype == torch.float16),
                    out.data_ptr(), int(accumulate), status.data_ptr(), torch.cuda.current_stream(dev).cuda_stream)
        _check_launch(rc, what=what)
        check_status(int(status.item()), what=what)

    def sparse_encode(self, x: torch.Tensor, *, chunk: int, k: int, bits: int) -> torch.Tensor:
        """`sparse.sparse_encode`: flat fp32 x -> the body (uint8, on x's device)."""
        assert x.dim() == 1 and x.dtype == torch.float32 and x.device.type == "cuda", (x.shape, x.dtype, x.device)
        x = x.contiguous()
        lay = sparse_layout(x.numel(), chunk=chunk, k=k, bits=bits)
        dev = x.device
        words = torch.empty(-(-lay.body_bytes // 4), dtype=torch.int32, device=dev)  # the kernel ORs 32-bit words
        body = words.view(torch.uint8)[: lay.body_bytes]
        if lay.nchunks == 0:
            return body
        status = torch.zeros(1, dtype=torch.int32, device=dev)
        with torch.cuda.device(dev):
            rc = self._lib.st_cuda_sparse_encode(x.data_ptr(), x.numel(), chunk, k, bits, words.data_ptr(),
                                                 status.data_ptr(), torch.cuda.current_stream(dev).cuda_stream)
        _check_launch(rc, what="sparse")
        check_status(int(status.item()), what="sparse")
        return body

    def sparse_decode_accumulate(self, body: torch.Tensor, *, numel: int, chunk: int, k: int, bits: int,
                                 out: torch.Tensor) -> None:
        """`sparse.sparse_decode_accumulate`: out += the decoded values; CodecError (out untouched) on a
        malformed body."""
        lay = sparse_layout(numel, chunk=chunk, k=k, bits=bits)
        assert body.dtype == torch.uint8 and body.numel() == lay.body_bytes, (body.dtype, body.numel(), lay.body_bytes)
        assert out.dtype == torch.float32 and out.is_contiguous() and out.numel() == numel, (out.dtype, out.shape)
        dev = out.device
        if body.device != dev:
            raise CodecError(f"body on {body.device}, out on {dev}: both must share a device")
        if lay.nchunks == 0:
            return
        body = body.contiguous()
        status = torch.zeros(1, dtype=torch.int32, device=dev)
        with torch.cuda.device(dev):
            rc = self._lib.st_cuda_sparse_decode(body.data_ptr(), numel, chunk, k, bits, out.data_ptr(),
                                                 status.data_ptr(), torch.cuda.current_stream(dev).cuda_stream)
        _check_launch(rc, what="sparse")
        check_status(int(status.item()), what="sparse")

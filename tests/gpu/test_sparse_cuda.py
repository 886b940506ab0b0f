"""The CUDA sparse kernels equal the torch reference (on the same GPU and on the CPU) bit for bit; skips
without CUDA."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.compress import CodecError, sparse
from swarmtrain.compress.kernels import fused_backend
from swarmtrain.compress.kernels.cuda import CudaKernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CHUNKS = [2, 64, 1000, 4096, 65536]
BITS = [2, 4, 8]


@pytest.fixture(scope="module")
def gpu() -> CudaKernels:
    backend = fused_backend("cuda")
    assert isinstance(backend, CudaKernels)
    return backend


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    a, b = a.cpu(), b.cpu()
    view = {4: torch.int32, 1: torch.uint8}[a.element_size()]
    diff = (a.view(view) != b.view(view)).nonzero()
    assert diff.numel() == 0, f"{diff.numel()} elements differ, first at {diff[:5].view(-1).tolist()}"


def _data(n: int, *, seed: int) -> torch.Tensor:
    """Magnitudes from subnormal to 1e38, many exact ties, runs of zeros and negative zeros (on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, generator=g, dtype=torch.float64) * torch.pow(
        10.0, torch.randint(-45, 37, (n,), generator=g).double())
    x = wide.float()
    pick = torch.rand(n, generator=g)
    ties = (torch.randint(-6, 7, (n,), generator=g).float() / 2)
    x = torch.where(pick < 0.3, ties, x)
    x = torch.where((pick >= 0.3) & (pick < 0.4), torch.randn(n, generator=g), x)
    x[(torch.arange(n) // 97) % 7 == 3] = 0.0
    x[(torch.arange(n) // 89) % 11 == 5] = -0.0
    x[(torch.arange(n) // 53) % 13 == 7] = 2.5e-42  # one subnormal, tied many times
    return x


def _cases() -> list[tuple[int, int, int]]:
    """(numel, chunk, k): empty, tiny, around one chunk, several chunks with a short tail."""
    out = []
    for chunk in CHUNKS:
        ks = sorted({1, max(1, round(0.01 * chunk)), max(1, round(0.03 * chunk)), max(1, chunk // 2), chunk})
        sizes = sorted({0, 1, 3, chunk - 1, chunk, chunk + 1, 3 * chunk + chunk // 3 + 1})
        out += [(n, chunk, k) for n in sizes for k in ks]
    return out


def _check(gpu: CudaKernels, x_cpu: torch.Tensor, *, chunk: int, k: int, bits: int, cpu_reference: bool = True) -> None:
    x = x_cpu.cuda()
    kw = {"chunk": chunk, "k": k, "bits": bits}
    body = gpu.sparse_encode(x, **kw)
    ref_gpu = sparse.sparse_encode(x, **kw)
    assert body.device == x.device and body.numel() == sparse.sparse_layout(x.numel(), **kw).body_bytes
    _same(body, ref_gpu)
    if cpu_reference:
        _same(body, sparse.sparse_encode(x_cpu, **kw))
    base = torch.randn(x.numel(), generator=torch.Generator().manual_seed(x.numel())).cuda()
    out_k, out_ref = base.clone(), base.clone()
    gpu.sparse_decode_accumulate(body, numel=x.numel(), out=out_k, **kw)
    sparse.sparse_decode_accumulate(ref_gpu, numel=x.numel(), out=out_ref, **kw)
    _same(out_k, out_ref)
    if cpu_reference:
        out_cpu = base.cpu()
        sparse.sparse_decode_accumulate(body.cpu(), numel=x.numel(), out=out_cpu, **kw)
        _same(out_k, out_cpu)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(("numel", "chunk", "k"), _cases(), ids=lambda v: str(v))
def test_sparse_cuda_matches_reference(gpu: CudaKernels, numel: int, chunk: int, k: int, bits: int) -> None:
    _check(gpu, _data(numel, seed=numel * 7 + chunk + k), chunk=chunk, k=k, bits=bits)


@pytest.mark.parametrize(("chunk", "k", "bits"), [(4096, 41, 2), (4096, 123, 4), (65536, 655, 8), (1000, 500, 2)])
def test_sparse_cuda_matches_reference_large(gpu: CudaKernels, chunk: int, k: int, bits: int) -> None:
    x = _data(3_000_001, seed=chunk + k)
    _check(gpu, x, chunk=chunk, k=k, bits=bits, cpu_reference=chunk == 4096 and bits == 2)
    _check(gpu, torch.randn(3_000_001, generator=torch.Generator().manual_seed(k)), chunk=chunk, k=k, bits=bits,
           cpu_reference=False)


@pytest.mark.parametrize("pattern", ["zeros", "neg_zeros", "equal", "alternating", "ramp_ties", "subnormal", "huge"])
@pytest.mark.parametrize("chunk", [64, 4096, 65536])
def test_sparse_cuda_special_data(gpu: CudaKernels, pattern: str, chunk: int) -> None:
    n = 2 * chunk + chunk // 2 + 3
    idx = torch.arange(n)
    x = {
        "zeros": torch.zeros(n),
        "neg_zeros": torch.full((n,), -0.0),
        "equal": torch.full((n,), 1.5),
        "alternating": torch.where(idx % 2 == 0, 1.0, -1.0),
        "ramp_ties": ((idx % 17).float() - 8) * 0.25,
        "subnormal": (idx % 5).float() * 1.4e-45,
        "huge": torch.where(idx % 3 == 0, 1e38, -3e37) * (((idx % 7).float() + 1) / 7),
    }[pattern]
    for k in (1, max(1, chunk // 100), chunk // 2, chunk):
        for bits in BITS:
            _check(gpu, x.float(), chunk=chunk, k=k, bits=bits, cpu_reference=chunk < 65536)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 3.4e38, -3.4e38])
def test_sparse_cuda_encode_refusals(gpu: CudaKernels, bad: float) -> None:
    x = torch.randn(10_000, device="cuda")
    x[7777] = bad
    for backend in (gpu, sparse):
        with pytest.raises(CodecError):
            backend.sparse_encode(x, chunk=1000, k=10, bits=2)


def _set_bits(body: bytearray, bit: int, width: int, value: int) -> None:
    """Writes `value` into the `width` bits at `bit` (LSB first), like sparse._pack."""
    for i in range(width):
        byte, sh = divmod(bit + i, 8)
        body[byte] = (body[byte] & ~(1 << sh)) | (((value >> i) & 1) << sh)


def _get_bits(body: bytearray, bit: int, width: int) -> int:
    return sum(((body[(bit + i) // 8] >> ((bit + i) % 8)) & 1) << i for i in range(width))


def _malformed(kind: str, body: bytearray, lay: sparse.SparseLayout) -> None:
    """Breaks `body` in one way the decoder must refuse (in the last chunk, which is short)."""
    c = lay.nchunks - 1
    off_bit = 8 * (lay.offsets_at + c * lay.offset_stride)
    code_end = 8 * (lay.codes_at + c * lay.code_stride) + lay.last_k * lay.bits
    w = lay.index_bits
    if kind in ("nan_scale", "inf_scale", "neg_scale", "lo_gt_hi"):
        lo, hi = {"nan_scale": (0x7FC0, 0x3F80), "inf_scale": (0x3F80, 0x7F80), "neg_scale": (0xBF80, 0x3F80),
                  "lo_gt_hi": (0x4000, 0x3F80)}[kind]
        body[4 * c: 4 * c + 4] = bytes([lo & 255, lo >> 8, hi & 255, hi >> 8])
    elif kind == "offset_range":
        _set_bits(body, off_bit + (lay.last_k - 1) * w, w, lay.last_len)
    elif kind == "offset_order":
        _set_bits(body, off_bit + w, w, _get_bits(body, off_bit, w))
    elif kind in ("code_padding", "offset_padding"):
        end = code_end if kind == "code_padding" else off_bit + lay.last_k * w
        assert end % 8, "this body has no padding bits there"
        body[end // 8] |= 0x80
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["nan_scale", "inf_scale", "neg_scale", "lo_gt_hi", "offset_range", "offset_order",
                                  "code_padding", "offset_padding"])
def test_sparse_cuda_decode_refusals(gpu: CudaKernels, kind: str) -> None:
    # chunk 1000: 10-bit offsets; last chunk 700 long keeps 7 (7·2 code bits and 7·10 offset bits leave padding)
    numel, kw = 3700, {"chunk": 1000, "k": 10, "bits": 2}
    lay = sparse.sparse_layout(numel, **kw)
    body = bytearray(bytes(sparse.sparse_encode(torch.randn(numel), **kw).numpy()))
    _malformed(kind, body, lay)
    bad = torch.frombuffer(body, dtype=torch.uint8).clone()
    for backend, device in ((gpu, "cuda"), (sparse, "cuda"), (sparse, "cpu")):
        out = torch.full((numel,), 0.25, device=device)
        with pytest.raises(CodecError):
            backend.sparse_decode_accumulate(bad.to(device), numel=numel, out=out, **kw)
        assert bool((out == 0.25).all())


def test_sparse_cuda_decode_kinds_set_their_status_bits(gpu: CudaKernels) -> None:
    numel, kw = 3700, {"chunk": 1000, "k": 10, "bits": 2}
    lay = sparse.sparse_layout(numel, **kw)
    clean = bytearray(bytes(sparse.sparse_encode(torch.randn(numel), **kw).numpy()))
    for kind, message in (("lo_gt_hi", "scale"), ("offset_order", "ascending"), ("code_padding", "padding")):
        body = bytearray(clean)
        _malformed(kind, body, lay)
        out = torch.zeros(numel, device="cuda")
        with pytest.raises(CodecError, match=message):
            gpu.sparse_decode_accumulate(torch.frombuffer(body, dtype=torch.uint8).cuda(), numel=numel, out=out, **kw)

"""The CUDA kernels equal the torch reference (run on the same GPU) bit for bit; skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.compress import CodecError, get_codec, quant
from swarmtrain.compress import codecs as codecs_mod
from swarmtrain.compress.kernels import fused_backend
from swarmtrain.compress.kernels.cuda import CudaKernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def gpu() -> CudaKernels:
    backend = fused_backend("cuda")
    assert isinstance(backend, CudaKernels)
    return backend


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    view = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[a.element_size()]
    diff = (a.view(view) != b.view(view)).nonzero()
    assert diff.numel() == 0, f"{diff.numel()} elements differ, first at {diff[:5].view(-1).tolist()}"


def _data(n: int, *, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.pow(10.0, torch.randint(-30, 20, (n,), generator=g).float() / 10)
    ties = torch.randint(-254, 255, (n,), generator=g).float() / 2
    x = torch.where(torch.rand(n, generator=g) < 0.25, ties, x)
    x[(torch.arange(n) // 97) % 5 == 3] = 0.0
    return x.cuda()


SHAPES = [(0,), (1,), (3,), (63,), (64,), (65,), (1000,), (4097,), (33, 129), (1 << 20,), (3_000_001,), (7, 11, 13)]


@pytest.mark.parametrize("scale_fp16", [False, True], ids=["s32", "s16"])
@pytest.mark.parametrize("block_size", [2, 64, 256, 1024, 1026, 4096, 65536])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cuda_matches_reference(gpu: CudaKernels, shape: tuple[int, ...], block_size: int, scale_fp16: bool) -> None:
    n = 1
    for d in shape:
        n *= d
    x = _data(n, seed=n + block_size)
    if scale_fp16:
        x = x.clamp(-4e5, 4e5)
    kw = {"block_size": block_size, "scale_fp16": scale_fp16, "stochastic": False, "generator": None}
    for qf, df, af, extra in (("int8_quantize", "int8_dequantize", "int8_dequantize_accumulate", {}),
                              ("int4_quantize", "int4_dequantize", "int4_dequantize_accumulate", {"numel": n})):
        q_ref, s_ref = getattr(quant, qf)(x, **kw)
        q_k, s_k = getattr(gpu, qf)(x, **kw)
        _same(q_k, q_ref)
        _same(s_k, s_ref)
        _same(getattr(gpu, df)(q_ref, s_ref.float(), block_size=block_size, **extra),
              getattr(quant, df)(q_ref, s_ref.float(), block_size=block_size, **extra))
        base = torch.randn(n, device="cuda")
        out_ref, out_k = base.clone(), base.clone()
        getattr(quant, af)(q_ref, s_ref, block_size=block_size, out=out_ref)
        getattr(gpu, af)(q_ref, s_ref, block_size=block_size, out=out_k)
        _same(out_k, out_ref)


def test_cuda_stochastic_equals_cpu_kernel_for_one_seed(gpu: CudaKernels) -> None:
    x = _data(100_003, seed=1)
    kw = {"block_size": 64, "scale_fp16": False, "stochastic": True}
    q_gpu, s_gpu = gpu.int8_quantize(x, generator=torch.Generator().manual_seed(5), **kw)
    q_cpu, s_cpu = fused_backend("cpu").int8_quantize(x.cpu(), generator=torch.Generator().manual_seed(5), **kw)
    _same(q_gpu.cpu(), q_cpu)
    _same(s_gpu.cpu(), s_cpu)


def test_cuda_errors_match_reference(gpu: CudaKernels) -> None:
    x = torch.randn(1000, device="cuda")
    x[500] = float("nan")
    kw = {"block_size": 64, "scale_fp16": False, "stochastic": False, "generator": None}
    with pytest.raises(CodecError, match="non-finite"):
        gpu.int8_quantize(x, **kw)
    q, s = gpu.int8_quantize(torch.randn(640, device="cuda"), **kw)
    s[2] = float("inf")
    out = torch.ones(640, device="cuda")
    with pytest.raises(CodecError, match="block scale"):
        gpu.int8_dequantize_accumulate(q, s, block_size=64, out=out)
    assert bool((out == 1).all())


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_cuda_codec_bytes_equal_cpu_reference(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    x = torch.randn(513, 77)
    on_gpu = get_codec(name, block_size=128, device="cuda").encode(x.cuda())
    monkeypatch.setattr(codecs_mod, "quant_backend", lambda device: quant)
    assert on_gpu == get_codec(name, block_size=128).encode(x)

"""The fused CPU kernels equal the torch reference (swarmtrain.compress.quant) bit for bit."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmtrain.compress import CodecError, get_codec, kernels, quant
from swarmtrain.compress import codecs as codecs_mod
from swarmtrain.compress.kernels import KernelBuildError, fused_backend
from swarmtrain.compress.kernels.cpu import CpuKernels

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def cpu() -> CpuKernels:
    """One build (or cache hit) shared by every test here."""
    backend = fused_backend("cpu")
    assert isinstance(backend, CpuKernels)
    return backend


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Exact comparison that also tells -0.0 from 0.0."""
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    diff = (_bits(a) != _bits(b)).nonzero()
    assert diff.numel() == 0, f"{diff.numel()} elements differ, first at {diff[:5].view(-1).tolist()}"


def _data(n: int, *, seed: int) -> torch.Tensor:
    """Normal data with block-to-block magnitudes from 1e-38 to 1e30, exact .5 ties, zero runs, subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    mag = torch.pow(10.0, torch.randint(-38, 30, (max(n // 50 + 1, 1),), generator=g).float())
    x *= mag.repeat_interleave(50)[:n]
    ties = torch.randint(-254, 255, (n,), generator=g).float() / 2  # absmax 127 -> scale 1 -> k + 0.5
    pick = torch.randint(0, 4, (n,), generator=g)
    x = torch.where(pick == 0, ties, x)
    x[(torch.arange(n) // 97) % 5 == 3] = 0.0
    if n > 10:
        x[7] = 1e-45
        x[9] = -3e-39
    return x


SIZES = [0, 1, 2, 3, 63, 64, 65, 127, 1000, 4097, 70001]
BLOCKS = [2, 4, 64, 66, 128, 1000, 4096]


@pytest.mark.parametrize("scale_fp16", [False, True], ids=["s32", "s16"])
@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
def test_int8_and_int4_match_reference(cpu: CpuKernels, n: int, block_size: int, scale_fp16: bool) -> None:
    x = _data(n, seed=n * 31 + block_size)
    if scale_fp16:
        x = x.clamp(-4e5, 4e5)  # keep int4 scales (absmax / 7) inside fp16
    for q_fn, deq, acc, codec in (
        ("int8_quantize", "int8_dequantize", "int8_dequantize_accumulate", "int8"),
        ("int4_quantize", "int4_dequantize", "int4_dequantize_accumulate", "int4"),
    ):
        kw = {"block_size": block_size, "scale_fp16": scale_fp16, "stochastic": False, "generator": None}
        q_ref, s_ref = getattr(quant, q_fn)(x, **kw)
        q_k, s_k = getattr(cpu, q_fn)(x, **kw)
        _assert_same(q_k, q_ref)
        _assert_same(s_k, s_ref)
        extra = {"numel": n} if codec == "int4" else {}
        for scales in (s_ref, s_ref.float()):  # codecs hand over fp32 scales; direct callers may not
            _assert_same(getattr(cpu, deq)(q_ref, scales, block_size=block_size, **extra),
                         getattr(quant, deq)(q_ref, scales, block_size=block_size, **extra))
        base = torch.randn(n, generator=torch.Generator().manual_seed(1))
        out_ref, out_k = base.clone(), base.clone()
        getattr(quant, acc)(q_ref, s_ref, block_size=block_size, out=out_ref)
        getattr(cpu, acc)(q_ref, s_ref, block_size=block_size, out=out_k)
        _assert_same(out_k, out_ref)


@pytest.mark.parametrize("block_size", [3, 5, 63, 1001])
def test_odd_block_sizes_match_reference_math(cpu: CpuKernels, block_size: int) -> None:
    """The codecs only send even blocks, but the kernels take any size: int8 via the reference, int4 by hand."""
    n = 5003
    x = _data(n, seed=block_size)
    kw = {"block_size": block_size, "scale_fp16": False, "stochastic": False, "generator": None}
    q_ref, s_ref = quant.int8_quantize(x, **kw)
    q_k, s_k = cpu.int8_quantize(x, **kw)
    _assert_same(q_k, q_ref)
    _assert_same(s_k, s_ref)
    p_k, s4_k = cpu.int4_quantize(x, **kw)
    nib = torch.cat([p_k & 15, p_k >> 4], 0).view(2, -1).t().reshape(-1)[:n].to(torch.int8) - 8
    scale = s4_k.repeat_interleave(block_size)[:n]
    absmax = torch.cat([x, x.new_zeros(-n % block_size)]).view(-1, block_size).abs().amax(1)
    _assert_same(s4_k, absmax / torch.tensor(7.0))
    expect = torch.where(scale == 0, 0.0, torch.round(x / scale).clamp(-7, 7)).to(torch.int8)
    _assert_same(nib, expect)
    assert int(p_k[-1]) >> 4 == 8  # odd n: the unused high nibble
    _assert_same(cpu.int4_dequantize(p_k, s4_k, numel=n, block_size=block_size), nib.float() * scale)


def test_many_threads_match_one_thread(cpu: CpuKernels) -> None:
    x = _data(300_001, seed=5)
    kw = {"block_size": 64, "scale_fp16": True, "stochastic": False, "generator": None}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        q2, s2 = cpu.int4_quantize(x.clamp(-1e5, 1e5), **kw)
        out2 = torch.zeros(x.numel())
        cpu.int4_dequantize_accumulate(q2, s2, block_size=64, out=out2)
    finally:
        torch.set_num_threads(before)
    q1, s1 = quant.int4_quantize(x.clamp(-1e5, 1e5), **kw)
    _assert_same(q2, q1)
    _assert_same(s2, s1)
    out1 = torch.zeros(x.numel())
    quant.int4_dequantize_accumulate(q1, s1, block_size=64, out=out1)
    _assert_same(out2, out1)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3000), half_block=st.integers(1, 300), scale_fp16=st.booleans(),
       exponent=st.integers(-40, 30), seed=st.integers(0, 2**31 - 1))
def test_property_parity(cpu: CpuKernels, n: int, half_block: int, scale_fp16: bool, exponent: int,
                         seed: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 10.0**exponent
    if scale_fp16 and exponent > 4:
        x = x.clamp(-4e5, 4e5)
    kw = {"block_size": 2 * half_block, "scale_fp16": scale_fp16, "stochastic": False, "generator": None}
    for fn in ("int8_quantize", "int4_quantize"):
        q_ref, s_ref = getattr(quant, fn)(x, **kw)
        q_k, s_k = getattr(cpu, fn)(x, **kw)
        _assert_same(q_k, q_ref)
        _assert_same(s_k, s_ref)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("fn", ["int8_quantize", "int4_quantize"])
def test_non_finite_input_raises_like_reference(cpu: CpuKernels, fn: str, bad: float) -> None:
    x = torch.randn(1000)
    x[777] = bad
    kw = {"block_size": 64, "scale_fp16": False, "stochastic": False, "generator": None}
    with pytest.raises(CodecError, match="non-finite") as ref:
        getattr(quant, fn)(x, **kw)
    with pytest.raises(CodecError, match="non-finite") as got:
        getattr(cpu, fn)(x, **kw)
    assert str(got.value) == str(ref.value)


def test_fp16_scale_overflow_raises_like_reference(cpu: CpuKernels) -> None:
    x = torch.zeros(256)
    x[100] = 65504 * 127 * 1.01
    kw = {"block_size": 64, "scale_fp16": True, "stochastic": False, "generator": None}
    with pytest.raises(CodecError, match="use fp32 scales") as ref:
        quant.int8_quantize(x, **kw)
    with pytest.raises(CodecError, match="use fp32 scales") as got:
        cpu.int8_quantize(x, **kw)
    assert str(got.value) == str(ref.value)
    q, s = cpu.int8_quantize(x, block_size=64, scale_fp16=False, stochastic=False, generator=None)
    assert torch.isfinite(s).all() and int(q[100]) == 127


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_decode_rejects_bad_scales_before_touching_out(cpu: CpuKernels, bad: float) -> None:
    q, s = cpu.int8_quantize(torch.randn(640), block_size=64, scale_fp16=False, stochastic=False, generator=None)
    s[3] = bad
    out = torch.ones(640)
    with pytest.raises(CodecError, match="block scale"):
        cpu.int8_dequantize_accumulate(q, s, block_size=64, out=out)
    assert bool((out == 1).all())


def test_stochastic_rounding_is_unbiased_and_seeded(cpu: CpuKernels) -> None:
    x = torch.randn(64 * 64, generator=torch.Generator().manual_seed(3))
    kw = {"block_size": 64, "scale_fp16": False, "stochastic": True}
    q_a, s = cpu.int8_quantize(x, generator=torch.Generator().manual_seed(9), **kw)
    q_b, _ = cpu.int8_quantize(x, generator=torch.Generator().manual_seed(9), **kw)
    _assert_same(q_a, q_b)
    y = x / s.repeat_interleave(64)
    assert bool(((q_a.float() == y.floor()) | (q_a.float() == y.ceil())).all())
    g = torch.Generator().manual_seed(11)
    total = torch.zeros_like(x)
    rounds = 200
    for _ in range(rounds):
        q, s = cpu.int8_quantize(x, generator=g, **kw)
        total += q.float()
    mean_err = (total / rounds - y).abs().mean().item()
    assert mean_err < 0.05, mean_err  # nearest rounding alone would leave ~0.25 per element
    frac_up = ((total / rounds) - y.floor()).mean().item()
    assert abs(frac_up - (y - y.floor()).mean().item()) < 0.01


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_codec_bytes_identical_with_either_backend(cpu: CpuKernels, monkeypatch: pytest.MonkeyPatch,
                                                   name: str) -> None:
    x = torch.randn(3, 1001)[:, ::2]  # non-contiguous
    fused = get_codec(name, block_size=64, scale_dtype="fp16")
    monkeypatch.setattr(codecs_mod, "quant_backend", lambda device: quant)
    reference = get_codec(name, block_size=64, scale_dtype="fp16")
    assert fused.encode(x) == reference.encode(x)
    data = reference.encode(x)
    _assert_same(fused.decode(data), reference.decode(data))


def test_build_failure_falls_back_with_one_log_line(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SWARMTRAIN_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(KernelBuildError, match="no-such-compiler"):
        fused_backend("cpu")
    monkeypatch.setattr(kernels, "_chosen", {})
    with caplog.at_level(logging.INFO, logger="swarmtrain.compress.kernels"):
        assert kernels.get_backend("cpu") is quant
        assert kernels.get_backend(torch.device("cpu")) is quant
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "torch reference path" in lines[0] and "no-such-compiler" in lines[0], lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cuda_backend_without_a_device_says_so(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(KernelBuildError, match="no usable CUDA device"):
        fused_backend("cuda")
    monkeypatch.setattr(kernels, "_chosen", {})
    with caplog.at_level(logging.INFO, logger="swarmtrain.compress.kernels"):
        assert kernels.get_backend("cuda") is quant
    assert [r.getMessage() for r in caplog.records] == [
        "codec kernels on cuda: torch reference path, fused kernels unavailable: torch has no usable CUDA device"]

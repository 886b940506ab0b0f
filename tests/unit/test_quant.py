"""The reference int8/int4 math (compress/quant.py) against an independent numpy model of the contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmtrain.compress import CodecError, quant

pytestmark = pytest.mark.unit

# Slack over half a quantization step s/2 (see docs/wire-format.md, "Error bounds"):
# fl(x / s) is off by <= 2^-24 relative (|x / s| <= qmax): <= absmax * 2^-24 after scaling back;
# fl(q * s) adds <= qmax * s * 2^-24 ~ absmax * 2^-24; a clamp after fl(absmax / qmax) rounded down
# costs <= absmax * 2^-23. A subnormal fp32 scale loses absolute precision: 2^-150 per unit of q,
# so at most qmax * 2^-150 < 2^-142 (this also covers scale == 0, where absmax < qmax * 2^-150).
REL_SLACK = 2.0**-21
ABS_SLACK = 2.0**-142


def _np_reference(x: np.ndarray, *, qmax: int, block_size: int, scale_fp16: bool) -> tuple[np.ndarray, np.ndarray]:
    """The contract written out in numpy, element by element semantics, no torch."""
    n = x.size
    nb = -(-n // block_size)
    xp = np.zeros(nb * block_size, np.float32)
    xp[:n] = x
    blocks = xp.reshape(nb, block_size)
    absmax = np.abs(blocks).max(axis=1) if nb else np.zeros(0, np.float32)
    scale = (absmax / np.float32(qmax)).astype(np.float32)
    if scale_fp16:
        s16 = scale.astype(np.float16)
        low = s16.astype(np.float32) < scale
        s16[low] = np.nextafter(s16[low], np.float16(np.inf))
        scale = s16.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(blocks / scale[:, None])
    q = np.clip(np.nan_to_num(q), -qmax, qmax)
    q[scale == 0] = 0
    return q.astype(np.int8).reshape(-1)[:n], scale


def _random_tensor(n: int, *, seed: int, log10_scale: float, zero_block: bool, block_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * float(10.0**log10_scale)
    if zero_block and n:
        x[: block_size] = 0.0
    return x


_shapes = st.integers(min_value=0, max_value=700)
_block_sizes = st.sampled_from([2, 4, 6, 64, 128, 250])


@settings(max_examples=120, deadline=None)
@given(n=_shapes, block_size=_block_sizes, scale_fp16=st.booleans(), seed=st.integers(0, 2**31),
       log10_scale=st.floats(-44, 36), zero_block=st.booleans(), qmax=st.sampled_from([127, 7]))
def test_quantize_matches_numpy_contract_and_bound(n: int, block_size: int, scale_fp16: bool, seed: int,
                                                   log10_scale: float, zero_block: bool, qmax: int) -> None:
    if scale_fp16:
        log10_scale = min(log10_scale, 4.0)  # absmax beyond 65504 * qmax must use fp32 scales (tested below)
    x = _random_tensor(n, seed=seed, log10_scale=log10_scale, zero_block=zero_block, block_size=block_size)
    fn = quant.int8_quantize if qmax == 127 else quant.int4_quantize
    q, scales = fn(x, block_size=block_size, scale_fp16=scale_fp16, stochastic=False, generator=None)
    q_ref, scale_ref = _np_reference(x.numpy(), qmax=qmax, block_size=block_size, scale_fp16=scale_fp16)
    assert scales.dtype == (torch.float16 if scale_fp16 else torch.float32)
    np.testing.assert_array_equal(scales.float().numpy(), scale_ref)
    if qmax == 127:
        np.testing.assert_array_equal(q.numpy(), q_ref)
        xhat = quant.int8_dequantize(q, scales, block_size=block_size)
    else:
        assert q.dtype == torch.uint8 and q.numel() == -(-n // 2)
        xhat = quant.int4_dequantize(q, scales, numel=n, block_size=block_size)
        unpacked = torch.stack([q & 0x0F, q >> 4], dim=1).view(-1)
        np.testing.assert_array_equal(unpacked[:n].numpy().astype(np.int16) - 8, q_ref)
        if n % 2:
            assert int(q[-1]) >> 4 == 8
    # per element: |x - x̂| <= s_b / 2 + slack
    s_el = torch.from_numpy(np.repeat(scale_ref, block_size)[:n])
    absmax_el = s_el * qmax
    assert torch.all((x - xhat).abs() <= s_el / 2 + absmax_el * REL_SLACK + ABS_SLACK)
    # decode is exactly one fp32 multiply per element
    np.testing.assert_array_equal(xhat.numpy(), q_ref.astype(np.float32) * s_el.numpy())


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 300), block_size=_block_sizes, seed=st.integers(0, 2**31), qmax=st.sampled_from([127, 7]))
def test_dequantize_accumulate_is_out_plus_dequantize(n: int, block_size: int, seed: int, qmax: int) -> None:
    x = _random_tensor(n, seed=seed, log10_scale=0.0, zero_block=False, block_size=block_size)
    out = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1))
    expected = out.clone()
    if qmax == 127:
        q, s = quant.int8_quantize(x, block_size=block_size, scale_fp16=False, stochastic=False, generator=None)
        expected += quant.int8_dequantize(q, s, block_size=block_size)
        quant.int8_dequantize_accumulate(q, s, block_size=block_size, out=out)
    else:
        q, s = quant.int4_quantize(x, block_size=block_size, scale_fp16=False, stochastic=False, generator=None)
        expected += quant.int4_dequantize(q, s, numel=n, block_size=block_size)
        quant.int4_dequantize_accumulate(q, s, block_size=block_size, out=out)
    assert torch.equal(out, expected)


def test_accumulate_crosses_chunk_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 12)  # several chunks, a partial tail block
    x = torch.randn(103)
    for qfn, dfn, afn in ((quant.int8_quantize, quant.int8_dequantize, quant.int8_dequantize_accumulate),
                          (quant.int4_quantize, quant.int4_dequantize, quant.int4_dequantize_accumulate)):
        q, s = qfn(x, block_size=4, scale_fp16=False, stochastic=False, generator=None)
        ref = dfn(q, s, block_size=4) if qfn is quant.int8_quantize else dfn(q, s, numel=103, block_size=4)
        out = torch.zeros(103)
        afn(q, s, block_size=4, out=out)
        assert torch.equal(out, ref)


def test_int4_packing_layout_is_low_nibble_first() -> None:
    x = torch.tensor([7.0, -7.0, 1.0, 0.0, 3.0])  # one block: scale 1
    packed, scales = quant.int4_quantize(x, block_size=6, scale_fp16=False, stochastic=False, generator=None)
    assert scales.tolist() == [1.0]
    # nibbles 15, 1 | 9, 8 | 11, pad 8
    assert packed.tolist() == [15 | (1 << 4), 9 | (8 << 4), 11 | (8 << 4)]


def test_rounding_is_half_to_even() -> None:
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5])
    q, s = quant.int8_quantize(x, block_size=6, scale_fp16=False, stochastic=False, generator=None)
    assert s.tolist() == [1.0] and q.tolist() == [127, 0, 2, 2, 0, -2]


def test_fp16_scale_is_smallest_fp16_not_below_the_fp32_scale() -> None:
    x = torch.tensor([1.0, 127.0 * 1.0001, 0.0, 3e-3, 1e-30, -5.0]).repeat_interleave(2)
    _, s16 = quant.int8_quantize(x, block_size=2, scale_fp16=True, stochastic=False, generator=None)
    scale = x.view(-1, 2).abs().amax(1) / 127
    assert s16.dtype == torch.float16 and torch.all(s16.float() >= scale)
    below = (s16.view(torch.int16) - 1).clamp(min=0).view(torch.float16).float()
    assert torch.all((below < scale) | (s16 == 0))


def test_fp16_scale_overflow_asks_for_fp32_scales() -> None:
    x = torch.tensor([65504.0 * 127 * 1.01, 1.0])
    with pytest.raises(CodecError, match="use fp32 scales"):
        quant.int8_quantize(x, block_size=2, scale_fp16=True, stochastic=False, generator=None)
    q, _ = quant.int8_quantize(x, block_size=2, scale_fp16=False, stochastic=False, generator=None)
    assert q.tolist() == [127, 0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("fn", [quant.int8_quantize, quant.int4_quantize])
def test_non_finite_input_is_rejected(bad: float, fn: object) -> None:
    x = torch.ones(10)
    x[7] = bad
    with pytest.raises(CodecError, match="non-finite"):
        fn(x, block_size=4, scale_fp16=False, stochastic=False, generator=None)  # type: ignore[operator]


@pytest.mark.parametrize("qmax", [127, 7])
def test_stochastic_rounding_is_unbiased_and_within_one_step(qmax: int) -> None:
    x = torch.linspace(-1, 1, 64).repeat(400)  # each value seen 400 times, one block each
    g = torch.Generator().manual_seed(3)
    fn = quant.int8_quantize if qmax == 127 else quant.int4_quantize
    q, s = fn(x, block_size=64, scale_fp16=False, stochastic=True, generator=g)
    xhat = (quant.int8_dequantize(q, s, block_size=64) if qmax == 127
            else quant.int4_dequantize(q, s, numel=x.numel(), block_size=64))
    step = 1.0 / qmax
    assert torch.all((xhat - x).abs() < step * (1 + 1e-5))
    bias = (xhat - x).view(400, 64).mean(0)  # mean over draws per value; sd of the mean <= step / (2 sqrt(400))
    assert bias.abs().max() < 5 * step / (2 * 20)
    q2, _ = fn(x, block_size=64, scale_fp16=False, stochastic=True, generator=torch.Generator().manual_seed(3))
    assert torch.equal(q, q2)

"""The fused CPU sparse kernels equal the torch reference (swarmtrain.compress.sparse) bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmtrain.compress import CodecError, sparse
from swarmtrain.compress.kernels import fused_backend
from swarmtrain.compress.kernels.cpu import CpuKernels
from swarmtrain.compress.sparse import SparseLayout, sparse_layout

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def cpu() -> CpuKernels:
    """One build (or cache hit) shared by every test here."""
    backend = fused_backend("cpu")
    assert isinstance(backend, CpuKernels)
    return backend


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exact comparison; fp32 as int32 so that -0.0 and 0.0 differ."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    diff = (a != b).nonzero()
    assert diff.numel() == 0, f"{diff.numel()} elements differ, first at {diff[:5].view(-1).tolist()}"


def _data(n: int, *, seed: int, kind: str) -> torch.Tensor:
    """normal: N(0, 1). ties: few distinct magnitudes, so the k-th one is shared. mixed: runs of magnitudes
    from 1e-45 to 1e37 with zeros, negative zeros and subnormals."""
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, generator=g)
    if kind == "ties":
        x = torch.randint(-4, 5, (n,), generator=g).float() * 0.75
        x[torch.rand(n, generator=g) < 0.2] = -0.0
        return x
    assert kind == "mixed", kind
    x = torch.randn(n, generator=g)
    mag = torch.pow(10.0, torch.randint(-45, 38, (n // 37 + 1,), generator=g).double()).float()
    x *= mag.repeat_interleave(37)[:n]
    x[(torch.arange(n) // 13) % 7 == 2] = 0.0
    x[(torch.arange(n) // 11) % 9 == 4] = -0.0
    if n > 20:
        x[3], x[5], x[17] = 1e-45, -3e-39, 3.3e38  # the smallest subnormal, a subnormal, near the bf16 limit
    return x


def _check_parity(cpu: CpuKernels, x: torch.Tensor, *, chunk: int, k: int, bits: int) -> None:
    kw = {"chunk": chunk, "k": k, "bits": bits}
    ref = sparse.sparse_encode(x, **kw)
    got = cpu.sparse_encode(x, **kw)
    _assert_same(got, ref)
    base = torch.randn(x.numel(), generator=torch.Generator().manual_seed(7))
    base[::5] = -0.0  # adding -level or +level to -0.0 and 0.0 keeps its sign rules
    out_ref, out_got = base.clone(), base.clone()
    sparse.sparse_decode_accumulate(ref, numel=x.numel(), out=out_ref, **kw)
    cpu.sparse_decode_accumulate(ref, numel=x.numel(), out=out_got, **kw)
    _assert_same(out_got, out_ref)


def _grid() -> list[tuple[int, int]]:
    """(chunk, k): k = 1, ~1%, ~3%, half and all of the chunk."""
    cases: set[tuple[int, int]] = set()
    for chunk in (2, 64, 1000, 4096, 65536):
        for k in (1, round(0.01 * chunk), round(0.03 * chunk), chunk // 2, chunk):
            cases.add((chunk, max(1, k)))
    return sorted(cases)


@pytest.mark.parametrize("bits", sparse.SPARSE_BITS)
@pytest.mark.parametrize(("chunk", "k"), _grid())
def test_matches_reference(cpu: CpuKernels, chunk: int, k: int, bits: int) -> None:
    sizes = [0, 1, 3, chunk - 1, chunk, chunk + 1, 3 * chunk + chunk // 3 + 1]
    if chunk == 65536:
        sizes = [0, 1, chunk - 1, chunk + 1, 2 * chunk + 999]  # the reference takes a while at this size
    for i, n in enumerate(sizes):
        for kind in ("normal", "ties", "mixed"):
            x = _data(n, seed=n * 7 + chunk + k + bits + i, kind=kind)
            _check_parity(cpu, x, chunk=chunk, k=k, bits=bits)


@pytest.mark.parametrize("kind", ["normal", "ties", "mixed"])
def test_matches_reference_at_3m(cpu: CpuKernels, kind: str) -> None:
    _check_parity(cpu, _data(3_000_017, seed=11, kind=kind), chunk=4096, k=41, bits=2)


def test_two_threads_match_reference(cpu: CpuKernels) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for kind in ("normal", "ties"):
            _check_parity(cpu, _data(300_001, seed=5, kind=kind), chunk=4096, k=123, bits=4)
    finally:
        torch.set_num_threads(before)


def test_every_body_byte_is_written(cpu: CpuKernels) -> None:
    """The body comes from torch.empty: whatever it held before, the kernel overwrites it all."""
    x = _data(10_000, seed=3, kind="mixed")
    lay = sparse_layout(x.numel(), chunk=1000, k=13, bits=2)
    body = torch.full((lay.body_bytes,), 0xFF, dtype=torch.uint8)
    status = cpu._lib.st_sparse_encode(x.data_ptr(), x.numel(), 1000, 13, 2, body.data_ptr(), 1)
    assert status == 0
    _assert_same(body, sparse.sparse_encode(x, chunk=1000, k=13, bits=2))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3000), chunk=st.integers(2, 700), density=st.floats(0.0, 1.0),
       bits=st.sampled_from(sparse.SPARSE_BITS), exponent=st.integers(-44, 36), ties=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_property_parity(cpu: CpuKernels, n: int, chunk: int, density: float, bits: int, exponent: int,
                         ties: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (n,), generator=g).float() if ties else torch.randn(n, generator=g)
    x = x * 10.0**exponent
    _check_parity(cpu, x, chunk=chunk, k=max(1, min(chunk, round(density * chunk))), bits=bits)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 3.4e38, -3.4e38])
def test_bad_input_raises_like_reference(cpu: CpuKernels, bad: float) -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    x[4321] = bad
    kw = {"chunk": 1000, "k": 10, "bits": 2}
    with pytest.raises(CodecError) as ref:
        sparse.sparse_encode(x, **kw)
    with pytest.raises(CodecError) as got:
        cpu.sparse_encode(x, **kw)
    assert str(got.value) == str(ref.value)
    assert ("non-finite" if abs(bad) == float("inf") or bad != bad else "bfloat16") in str(got.value)


def test_scales_round_half_to_even(cpu: CpuKernels) -> None:
    """Kept extremes exactly halfway between two bfloat16 values: the even one wins, up or down."""
    halfway = torch.tensor([0x3F808000, 0x3F818000, 0x40A08000, 0x40A18000, 0x00008000, 0x00018000],
                           dtype=torch.int32).view(torch.float32)
    x = torch.zeros(6 * 64)
    for i, v in enumerate(halfway.tolist()):  # chunk i keeps v (its max) and v / 2 (its min)
        x[64 * i + 10], x[64 * i + 40] = v, -v / 2
    lay = sparse_layout(x.numel(), chunk=64, k=2, bits=4)
    body = cpu.sparse_encode(x, chunk=64, k=2, bits=4)
    _assert_same(body, sparse.sparse_encode(x, chunk=64, k=2, bits=4))
    hi = body[: lay.codes_at].view(torch.int16).view(-1, 2)[:, 1].tolist()
    assert hi == [0x3F80, 0x3F82, 0x40A0, 0x40A2, 0x0000, 0x0002]
    _check_parity(cpu, x, chunk=64, k=2, bits=4)


def test_largest_value_bfloat16_keeps_is_accepted(cpu: CpuKernels) -> None:
    x = torch.zeros(100)
    x[7] = 3.3961e38  # rounds down to bf16 0x7f7f, the largest finite
    _check_parity(cpu, x, chunk=64, k=3, bits=8)


# -- malformed bodies ------------------------------------------------------------------------------

CHUNK, K, BITS, NUMEL = 64, 5, 2, 3 * 64 + 36  # codes 10 bits and offsets 30 bits a chunk: both padded


def _layout() -> SparseLayout:
    return sparse_layout(NUMEL, chunk=CHUNK, k=K, bits=BITS)


def _set_field(body: torch.Tensor, start: int, i: int, width: int, value: int) -> None:
    """Writes value i (width bits, LSB first) of the packed run at byte `start`."""
    for b in range(width):
        pos = i * width + b
        byte = start + pos // 8
        bit = 1 << (pos % 8)
        body[byte] = (int(body[byte]) | bit) if value >> b & 1 else (int(body[byte]) & ~bit)


def _get_field(body: torch.Tensor, start: int, i: int, width: int) -> int:
    positions = [i * width + b for b in range(width)]
    return sum(((int(body[start + p // 8]) >> (p % 8)) & 1) << b for b, p in enumerate(positions))


def _set_scale(body: torch.Tensor, chunk_index: int, which: int, value: float) -> None:
    at = 4 * chunk_index + 2 * which
    body[at: at + 2] = torch.tensor([value], dtype=torch.bfloat16).view(torch.uint8)


def _malformed(kind: str) -> torch.Tensor:
    lay = _layout()
    body = sparse.sparse_encode(_data(NUMEL, seed=2, kind="normal"), chunk=CHUNK, k=K, bits=BITS)
    w = lay.index_bits
    last = lay.nchunks - 1
    last_offsets = lay.offsets_at + last * lay.offset_stride
    if kind == "scale nan":
        _set_scale(body, 1, 0, float("nan"))
    elif kind == "scale inf":
        _set_scale(body, 2, 1, float("inf"))
    elif kind == "scale negative":
        _set_scale(body, 0, 0, -1.0)
    elif kind == "lo > hi":
        _set_scale(body, 1, 0, 4.0)
        _set_scale(body, 1, 1, 2.0)
    elif kind == "offset past the chunk":
        _set_field(body, last_offsets, lay.last_k - 1, w, lay.last_len)  # fits w bits, past the last chunk
    elif kind == "offset repeated":
        at = lay.offsets_at + lay.offset_stride
        _set_field(body, at, 2, w, _get_field(body, at, 1, w))
    elif kind == "offsets descending":
        at = lay.offsets_at
        first, second = _get_field(body, at, 0, w), _get_field(body, at, 1, w)
        _set_field(body, at, 0, w, second)
        _set_field(body, at, 1, w, first)
    elif kind == "code padding":
        body[lay.codes_at + lay.code_stride - 1] |= 0x80
    elif kind == "offset padding":
        body[last_offsets + -(-lay.last_k * w // 8) - 1] |= 0x80
    else:
        raise AssertionError(kind)
    return body


MALFORMED = ["scale nan", "scale inf", "scale negative", "lo > hi", "offset past the chunk",
             "offset repeated", "offsets descending", "code padding", "offset padding"]


@pytest.mark.parametrize("kind", MALFORMED)
def test_malformed_body_raises_like_reference_and_leaves_out_alone(cpu: CpuKernels, kind: str) -> None:
    body = _malformed(kind)
    kw = {"numel": NUMEL, "chunk": CHUNK, "k": K, "bits": BITS}
    base = torch.randn(NUMEL, generator=torch.Generator().manual_seed(4))
    for decode in (sparse.sparse_decode_accumulate, cpu.sparse_decode_accumulate):
        out = base.clone()
        with pytest.raises(CodecError):
            decode(body, out=out, **kw)
        _assert_same(out, base)


def test_every_one_byte_corruption_is_judged_like_reference(cpu: CpuKernels) -> None:
    """Flip bits of each byte in turn: both refuse, or both add the same values."""
    kw = {"numel": NUMEL, "chunk": CHUNK, "k": K, "bits": BITS}
    valid = sparse.sparse_encode(_data(NUMEL, seed=9, kind="normal"), chunk=CHUNK, k=K, bits=BITS)
    base = torch.randn(NUMEL, generator=torch.Generator().manual_seed(8))
    g = torch.Generator().manual_seed(10)
    refused = 0
    for at in range(valid.numel()):
        for flip in (1 << int(torch.randint(0, 8, (1,), generator=g)), 0xFF):
            body = valid.clone()
            body[at] ^= flip
            results = []
            for decode in (sparse.sparse_decode_accumulate, cpu.sparse_decode_accumulate):
                out = base.clone()
                try:
                    decode(body, out=out, **kw)
                    results.append(out)
                except CodecError:
                    _assert_same(out, base)
                    results.append(None)
            if results[0] is None or results[1] is None:
                assert results[0] is None and results[1] is None, f"byte {at} ^ {flip:#x}: only one refused"
                refused += 1
            else:
                _assert_same(results[1], results[0])
    assert refused > valid.numel() // 2

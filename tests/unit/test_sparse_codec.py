"""The sparse codec (compress/sparse.py, sparse_codec.py): what it keeps, how it decodes, what it refuses."""

from __future__ import annotations

import struct

import pytest
import torch
import xxhash

from swarmtrain.compress import CodecError, CodecOptionError, get_codec
from swarmtrain.compress.sparse import sparse_decode, sparse_encode, sparse_layout
from swarmtrain.compress.sparse_codec import sparse_k

pytestmark = pytest.mark.unit

HEADER = 32 + 8  # fixed header + one shape dimension
PREFIX = 8


def _resign(b: bytearray) -> bytes:
    h = xxhash.xxh3_64(bytes(b[:24]))
    h.update(bytes(b[32:]))
    struct.pack_into("<Q", b, 24, h.intdigest())
    return bytes(b)


def test_each_chunk_keeps_its_k_largest_magnitudes_with_their_signs() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1000, generator=g)  # chunks of 64: 15 full, a last one of 40
    codec = get_codec("sparse", chunk_size=64, density=0.1, bits=2)
    assert codec.k == sparse_k(0.1, 64) == 6
    y = codec.decode(codec.encode(x))
    for lo in range(0, 1000, 64):
        chunk, got = x[lo:lo + 64], y[lo:lo + 64]
        k = 6 if len(chunk) == 64 else -(-6 * len(chunk) // 64)
        kept = set(chunk.abs().topk(k).indices.tolist())
        assert set(got.nonzero().view(-1).tolist()) == kept
        idx = torch.tensor(sorted(kept))
        assert torch.equal(got[idx].sign(), chunk[idx].sign())
        mags = chunk[idx].abs()
        lo_s, hi_s = float(mags.min().bfloat16()), float(mags.max().bfloat16())
        assert bool((got[idx].abs() >= lo_s).all() and (got[idx].abs() <= hi_s).all())


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_more_bits_lose_less_of_the_kept_values(bits: int) -> None:
    x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(0))
    y = sparse_decode(sparse_encode(x, chunk=256, k=64, bits=bits), numel=x.numel(), chunk=256, k=64, bits=bits)
    kept = y != 0
    err = float((x[kept] - y[kept]).abs().max())
    spread = float(x.abs().max())
    # the step is (hi − lo) / 2^(bits−1) per chunk: the error of a kept value is at most one step
    assert err <= spread / (1 << (bits - 1)) * 1.01


def test_ties_go_to_the_lower_offset_and_zeros_fill_a_short_chunk() -> None:
    x = torch.tensor([1.0, -1.0, 1.0, 1.0, 0.0, 0.0, -0.0, 2.0])
    y = sparse_decode(sparse_encode(x, chunk=8, k=3, bits=8), numel=8, chunk=8, k=3, bits=8)
    assert y.nonzero().view(-1).tolist() == [0, 1, 7]
    z = torch.zeros(5)
    assert torch.equal(sparse_decode(sparse_encode(z, chunk=4, k=2, bits=2), numel=5, chunk=4, k=2, bits=2), z)


def test_the_layout_is_what_the_docstring_says() -> None:
    lay = sparse_layout(4096 * 3 + 100, chunk=4096, k=41, bits=2)
    assert (lay.nchunks, lay.last_len, lay.last_k, lay.index_bits) == (4, 100, 2, 12)  # ceil(41 · 100 / 4096)
    assert (lay.code_stride, lay.offset_stride) == (11, 62)
    assert lay.body_bytes == 4 * 4 + 3 * 11 + 1 + 3 * 62 + 3
    codec = get_codec("sparse")  # 1% of 4096, 2 bits
    assert len(codec.encode(torch.randn(4096 * 3 + 100))) == HEADER + PREFIX + lay.body_bytes


def test_chunk_aligned_pieces_encode_like_the_whole() -> None:
    codec = get_codec("sparse", chunk_size=128, density=0.05)
    x = torch.randn(1000)
    whole = codec.decode(codec.encode(x))
    for lo, hi in ((0, 256), (256, 640), (640, 1000)):
        assert torch.equal(codec.decode(codec.encode(x[lo:hi])), whole[lo:hi])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 3.4e38])
def test_encode_refuses_non_finite_input_and_a_scale_bfloat16_cannot_hold(bad: float) -> None:
    x = torch.ones(10)
    x[4] = bad
    with pytest.raises(CodecError, match=r"non-finite|bfloat16"):
        get_codec("sparse", chunk_size=8, density=0.5).encode(x)


def _message() -> tuple[bytearray, int, int]:
    codec = get_codec("sparse", chunk_size=16, density=0.25, bits=2)  # k = 4: 1 code byte, 2 offset bytes
    x = torch.arange(1, 33, dtype=torch.float32) * torch.tensor([1.0, -1.0]).repeat(16)
    data = bytearray(codec.encode(x))
    lay = sparse_layout(32, chunk=16, k=4, bits=2)
    return data, HEADER + PREFIX + lay.codes_at, HEADER + PREFIX + lay.offsets_at


def _scale(value: float) -> bytes:
    return torch.tensor([value], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()


MALFORMED = {
    "nan scale": lambda b, c, o: b.__setitem__(slice(HEADER + PREFIX, HEADER + PREFIX + 2), _scale(float("nan"))),
    "negative scale": lambda b, c, o: b.__setitem__(slice(HEADER + PREFIX, HEADER + PREFIX + 2), _scale(-1.0)),
    "lo > hi": lambda b, c, o: b.__setitem__(slice(HEADER + PREFIX, HEADER + PREFIX + 2), _scale(1e30)),
    "offset out of order": lambda b, c, o: b.__setitem__(slice(o, o + 2), bytes([0xFF, 0x00])),  # offsets 15, 0
    "repeated offset": lambda b, c, o: b.__setitem__(slice(o, o + 2), bytes([0x11, 0x11])),  # 1, 1, 1, 1
    "bad bits": lambda b, c, o: b.__setitem__(HEADER, 3),
    "k above the chunk": lambda b, c, o: b.__setitem__(slice(HEADER + 4, HEADER + 8), struct.pack("<I", 17)),
    "reserved byte": lambda b, c, o: b.__setitem__(HEADER + 1, 1),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_a_malformed_body_is_refused_and_out_is_untouched(kind: str) -> None:
    data, codes_at, offsets_at = _message()
    MALFORMED[kind](data, codes_at, offsets_at)
    out = torch.full((32,), 7.0)
    with pytest.raises(CodecError, match="sparse"):
        get_codec("sparse").decode_accumulate(_resign(data), out)
    assert torch.equal(out, torch.full((32,), 7.0))


def test_a_set_padding_bit_is_refused() -> None:
    codec = get_codec("sparse", chunk_size=16, density=3 / 16, bits=2)  # k = 3: 6 code bits, 2 padding bits
    data = bytearray(codec.encode(torch.randn(16)))
    data[HEADER + PREFIX + 4] |= 0x80
    with pytest.raises(CodecError, match="padding"):
        codec.decode(_resign(data))


def test_options_are_checked() -> None:
    for options, what in (({"density": 0.0}, "density"), ({"bits": 3}, "bits"), ({"chunk_size": 1}, "chunk_size"),
                          ({"zstd_level": 3}, "zstd"), ({"block_size": 64}, "block_size")):
        with pytest.raises(CodecOptionError, match=what):
            get_codec("sparse", **options)

"""Fuzz: >= 100k mutated or random byte strings through decode/decode_accumulate -> only CodecError."""

from __future__ import annotations

import collections
import random
import struct
import time

import pytest
import torch
import xxhash

from swarmtrain.compress import CodecError, DecodeLimits, get_codec
from swarmtrain.compress.codec import Codec
from swarmtrain.compress.wire import CodecId

pytestmark = pytest.mark.unit

N_INPUTS = 100_000
# (offset, struct format) of every header field the mutator rewrites; checksum (24) left to resign()
FIELDS = [(0, "<4s"), (4, "<B"), (5, "<B"), (6, "<B"), (7, "<B"), (8, "<I"), (12, "<B"), (16, "<Q"), (32, "<Q"),
          (40, "<Q")]
EDGE = [0, 1, 2, 3, 7, 8, 9, 127, 128, 255, 256, 65535, 2**31 - 1, 2**32 - 1, 2**63, 2**64 - 1]


def resign(data: bytes | bytearray) -> bytes:
    """Recomputes the checksum (xxh3-64 of all bytes but 24..32) so a mutation reaches deeper checks."""
    b = bytearray(data)
    if len(b) >= 32:
        h = xxhash.xxh3_64(bytes(b[:24]))
        h.update(bytes(b[32:]))
        struct.pack_into("<Q", b, 24, h.intdigest())
    return bytes(b)


def _corpus(rng: random.Random) -> list[bytes]:
    msgs = []
    shapes = [(0,), (1,), (2,), (5,), (3, 7), (2, 1, 3), (), (4, 0, 2), (33,)]
    for name in ("fp32", "fp16", "bf16", "int8", "int4"):
        for zstd_level in (0, 1):
            for scale_dtype in (("fp32", "fp16") if name.startswith("int") else (None,)):
                opts = {"zstd_level": zstd_level}
                if scale_dtype:
                    opts.update(block_size=rng.choice([2, 4, 64]), scale_dtype=scale_dtype)
                codec = get_codec(name, **opts)
                for shape in shapes:
                    msgs.append(codec.encode(torch.randn(shape) * rng.choice([1e-3, 1.0, 100.0])))
    for bits in (2, 4, 8):
        codec = get_codec("sparse", chunk_size=rng.choice([2, 16, 100]), density=rng.choice([0.05, 0.3, 1.0]),
                          bits=bits)
        for shape in shapes:
            msgs.append(codec.encode(torch.randn(shape) * rng.choice([1e-3, 1.0, 100.0])))
    return msgs


def _mutate(rng: random.Random, msg: bytes, corpus: list[bytes]) -> bytes:
    kind = rng.randrange(9)
    b = bytearray(msg)
    if kind == 0:  # bit flips; half re-signed so they reach the checks behind the checksum
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return resign(b) if rng.random() < 0.5 else bytes(b)
    if kind == 1:  # header field set to an edge or random value
        off, fmt = rng.choice(FIELDS)
        if off + struct.calcsize(fmt) > len(b):
            return bytes(b)
        if fmt == "<4s":
            struct.pack_into(fmt, b, off, rng.randbytes(4))
        else:
            limit = 256 ** struct.calcsize(fmt)
            struct.pack_into(fmt, b, off, rng.choice([*EDGE, rng.randrange(limit)]) % limit)
        return resign(b)
    if kind == 2:  # truncation
        return resign(b[: rng.randrange(len(b))]) if rng.random() < 0.5 else bytes(b[: rng.randrange(len(b))])
    if kind == 3:  # extension
        return resign(b + rng.randbytes(rng.randint(1, 40)))
    if kind == 4:  # payload bytes overwritten (reaches value/scale/nibble checks and zstd)
        i = rng.randrange(32, len(b)) if len(b) > 32 else 0
        j = min(len(b), i + rng.randint(1, 8))
        b[i:j] = rng.randbytes(j - i)
        return resign(b)
    if kind == 5:  # special floats planted in the payload
        if len(b) >= 52:
            i = rng.randrange(48, len(b) - 3)
            b[i: i + 4] = rng.choice([struct.pack("<f", v) for v in (float("nan"), float("inf"), -1.0, 1e38)]
                                     + [struct.pack("<e", float("inf")) * 2, b"\x80\x80\x80\x80", b"\x00" * 4])
        return resign(b)
    if kind == 6:  # splice of two valid messages
        other = rng.choice(corpus)
        return resign(b[: rng.randrange(len(b))] + other[rng.randrange(len(other)):])
    if kind == 7:  # random bytes behind a valid magic and version
        return resign(b"SWTC\x01" + rng.randbytes(rng.randint(0, 80)))
    return rng.randbytes(rng.randint(0, 120))  # plain garbage


CATEGORIES = ("truncated", "trailing", "oversized", "bad magic", "version", "unknown codec", "codec mismatch",
              "unknown flag", "dtype code", "ndim", "dimension", "block size", "scale flags", "checksum",
              "shape mismatch", "zstd", "non-finite", "nan or inf", "negative", "too large", "-128", "nibble",
              "out has", "padding", "offset", "lo > hi", "prefix", "reserved")


def _category(err: CodecError) -> str:
    msg = str(err).lower()
    return next((c for c in CATEGORIES if c in msg), f"other: {msg}")


def test_fuzz_decode_only_raises_codec_error() -> None:
    rng = random.Random(20240604)
    corpus = _corpus(rng)
    decoders: dict[int, Codec] = {int(c): get_codec(c.name.lower(), limits=DecodeLimits(max_numel=1 << 16,
                                                                                        max_bytes=1 << 20))
                                  for c in CodecId}
    outcomes: collections.Counter[str] = collections.Counter()
    deadline = time.monotonic() + 120  # pytest-timeout would also stop a hang; this names the count reached
    for i in range(N_INPUTS):
        msg = _mutate(rng, rng.choice(corpus), corpus)
        codec = decoders[msg[5]] if len(msg) > 5 and msg[5] in decoders else decoders[rng.choice(list(decoders))]
        try:
            if i % 4:
                y = codec.decode(msg)
                assert y.dtype == torch.float32
                assert y.numel() == 0 or bool(torch.isfinite(y).all()), "decode returned NaN/Inf"
            else:
                numel = struct.unpack_from("<Q", msg, 32)[0] if len(msg) >= 40 and msg[12] == 1 else 7
                out = torch.zeros(min(numel, 1 << 16))
                codec.decode_accumulate(msg, out)
                assert bool(torch.isfinite(out).all())
            outcomes["decoded"] += 1
        except CodecError as e:
            outcomes[_category(e)] += 1
        assert time.monotonic() < deadline, f"fuzz too slow: {i} inputs"
    print(dict(outcomes.most_common()))  # shown with -s: which checks the fuzz reached
    assert sum(outcomes.values()) == N_INPUTS
    assert not [k for k in outcomes if k.startswith("other")], outcomes
    # the mutations must get past the cheap checks: deep rejections and real decodes both occur
    for deep in ("checksum", "shape mismatch", "zstd", "non-finite", "nan or inf", "negative", "too large", "-128",
                 "nibble", "block size", "out has"):
        assert outcomes[deep] > 0, (deep, outcomes)
    assert outcomes["decoded"] > N_INPUTS // 50, outcomes

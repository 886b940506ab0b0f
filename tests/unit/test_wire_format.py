"""The wire format: golden bytes per codec (surface freeze) and every malformed-input rejection."""

from __future__ import annotations

import math
import resource
import struct

import pytest
import torch
import xxhash
import zstandard

from swarmtrain.compress import CodecError, DecodeLimits, get_codec, quant
from swarmtrain.compress import codecs as codecs_module

pytestmark = pytest.mark.unit

X = torch.tensor([[0.5, -1.25, 3.0], [0.0, 2.0, -0.75], [1e-3, -7.0, 0.1]])

# Header (32 B) | shape (3 x u64) | payload. Pinned once from the reference path; any change to the
# format or the quantization contract must bump wire.VERSION and these bytes together.
GOLDEN = {
    ("fp32", ()): ("535754430101000100000000020000002400000000000000909dd42a7b0c897c"  # header
        "03000000000000000300000000000000"  # shape
        "0000003f0000a0bf000040400000000000000040000040bf6f12833a0000e0c0cdcccc3d"),  # payload
    ("fp16", ()): ("5357544301020001000000000200000012000000000000000ed2ad8b0c8f60b9"  # header
        "03000000000000000300000000000000"  # shape
        "003800bd00420000004000ba191400c7662e"),  # payload
    ("bf16", ()): ("5357544301030001000000000200000012000000000000005f3e2d908712abc9"  # header
        "03000000000000000300000000000000"  # shape
        "003fa0bf40400000004040bf833ae0c0cd3d"),  # payload
    ("int8", ("fp32",)): ("535754430104000104000000020000001500000000000000c9f2a57a1e48be0a"  # header
        "03000000000000000300000000000000"  # shape
        "15cb7f0024f200817f0683c13c87c3613da0694e3a"),  # payload
    ("int8", ("fp16",)): ("535754430104020104000000020000000f00000000000000bc4c14245f2c5537"  # header
        "03000000000000000300000000000000"  # shape
        "15cb7f0024f200817f0d260f2b7412"),  # payload
    ("int4", ("fp32",)): ("53575443010500010400000002000000110000000000000080659bd07b3dc897"  # header
        "03000000000000000300000000000000"  # shape
        "598f7a188fb76ddb3e0000803fa10e6a3c"),  # payload
    ("int4", ("fp16",)): ("535754430105020104000000020000000b00000000000000d5e29a25cbe0c583"  # header
        "03000000000000000300000000000000"  # shape
        "598f7a188fdc36003c5123"),  # payload
}


def _codec(name: str, scale: tuple[str, ...], **extra: object) -> object:
    return get_codec(name, block_size=4, scale_dtype=scale[0], **extra) if scale else get_codec(name, **extra)


@pytest.mark.parametrize("backend", ["reference", "active"])
@pytest.mark.parametrize("key", list(GOLDEN))
def test_golden_bytes(key: tuple[str, tuple[str, ...]], backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if backend == "reference":
        monkeypatch.setattr(codecs_module, "quant_backend", lambda device: quant)
    codec = _codec(*key)
    data = codec.encode(X)  # type: ignore[attr-defined]
    assert data.hex() == GOLDEN[key]
    assert torch.equal(codec.decode(data), codec.decode(bytes.fromhex(GOLDEN[key])))  # type: ignore[attr-defined]


def test_golden_header_fields_by_hand() -> None:
    data = bytes.fromhex(GOLDEN[("int8", ("fp16",))])
    magic, ver, cid, flags, dtype, bs, ndim, plen, _ = struct.unpack_from("<4sBBBBIB3xQQ", data)
    assert (magic, ver, cid, flags, dtype, bs, ndim, plen) == (b"SWTC", 1, 4, 2, 1, 4, 2, 9 + 3 * 2)
    assert struct.unpack_from("<2Q", data, 32) == (3, 3)
    assert len(data) == 32 + 16 + plen


def resign(data: bytes | bytearray) -> bytes:
    """Recomputes the checksum so a mutation reaches the checks behind it."""
    b = bytearray(data)
    if len(b) >= 32:
        h = xxhash.xxh3_64(bytes(b[:24]))
        h.update(bytes(b[32:]))
        struct.pack_into("<Q", b, 24, h.intdigest())
    return bytes(b)


def forge(*, codec_id: int, flags: int = 0, dtype: int = 1, block_size: int = 0, shape: tuple[int, ...],
          payload: bytes, version: int = 1, magic: bytes = b"SWTC", payload_len: int | None = None) -> bytes:
    """A message built from the byte table in docs/wire-format.md, independent of wire.frame()."""
    fixed = struct.pack("<4sBBBBIB3xQQ", magic, version, codec_id, flags, dtype, block_size, len(shape),
                        len(payload) if payload_len is None else payload_len, 0)
    return resign(fixed + struct.pack(f"<{len(shape)}Q", *shape) + payload)


def _set(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    return resign(b)


VALID8 = bytes.fromhex(GOLDEN[("int8", ("fp32",))])  # payload: q[9] at 48..57, scales fp32[3] at 57..69
VALID4 = bytes.fromhex(GOLDEN[("int4", ("fp32",))])  # payload: packed[5] at 48..53, scales at 53..65
NAN32, INF16 = struct.pack("<f", float("nan")), struct.pack("<e", float("inf"))

MALFORMED = {
    "empty": (b"", "int8", "truncated"),
    "short header": (VALID8[:31], "int8", "truncated"),
    "bad magic": (_set(VALID8, 0, "<4s", b"SWTD"), "int8", "bad magic"),  # type: ignore[arg-type]
    "version": (_set(VALID8, 4, "<B", 2), "int8", "version"),
    "unknown codec": (_set(VALID8, 5, "<B", 9), "int8", "unknown codec id 9"),
    "other codec": (_set(VALID8, 5, "<B", 5), "int8", "codec mismatch"),
    "flags": (_set(VALID8, 6, "<B", 0x10), "int8", "unknown flag"),
    "dtype": (_set(VALID8, 7, "<B", 0), "int8", "dtype code"),
    "odd block size": (_set(VALID8, 8, "<I", 3), "int8", "block size"),
    "zero block size": (_set(VALID8, 8, "<I", 0), "int8", "block size"),
    "huge block size": (_set(VALID8, 8, "<I", 1 << 30), "int8", "block size"),
    "cast with block size": (_set(bytes.fromhex(GOLDEN[("fp32", ())]), 8, "<I", 4), "fp32", "block size"),
    "cast with scale flag": (_set(bytes.fromhex(GOLDEN[("fp16", ())]), 6, "<B", 2), "fp16", "scale flags"),
    "ndim": (_set(VALID8, 12, "<B", 9), "int8", "ndim"),
    "ndim past end": (_set(VALID8, 12, "<B", 8), "int8", "truncated"),
    "truncated payload": (resign(VALID8[:-1]), "int8", "truncated"),
    "trailing bytes": (resign(VALID8 + b"\0"), "int8", "trailing"),
    "payload_len lies": (_set(VALID8, 16, "<Q", 20), "int8", "trailing"),
    "payload_len huge": (_set(VALID8, 16, "<Q", 2**64 - 1), "int8", "truncated"),
    "checksum": (VALID8[:40] + bytes([VALID8[40] ^ 1]) + VALID8[41:], "int8", "checksum"),
    "payload bit flip": (VALID8[:50] + bytes([VALID8[50] ^ 0x80]) + VALID8[51:], "int8", "checksum"),
    "shape mismatch": (_set(VALID8, 32, "<Q", 4), "int8", "shape mismatch"),
    "numel overflow": (_set(_set(VALID8, 32, "<Q", 2**40), 40, "<Q", 2**40), "int8", "oversized"),
    "dim past int64": (_set(_set(VALID8, 32, "<Q", 0), 40, "<Q", 2**63), "int8", "dimension >= 2"),
    "scale overflows": (resign(VALID8[:61] + struct.pack("<f", 3e36) + VALID8[65:]), "int8", "too large"),
    "NaN scale": (resign(VALID8[:61] + NAN32 + VALID8[65:]), "int8", "non-finite"),
    "negative scale": (resign(VALID8[:61] + struct.pack("<f", -1.0) + VALID8[65:]), "int8", "negative"),
    "int8 -128": (resign(VALID8[:48] + b"\x80" + VALID8[49:]), "int8", "-128"),
    "int4 nibble 0": (resign(VALID4[:48] + b"\x80" + VALID4[49:]), "int4", "nibble 0"),
    "int4 padding": (resign(VALID4[:52] + b"\x9f" + VALID4[53:]), "int4", "padding nibble"),
    "inf fp16 scale": (forge(codec_id=4, flags=2, block_size=4, shape=(2,), payload=b"\x01\x01" + INF16),
                       "int8", "non-finite"),
    "NaN fp32 value": (forge(codec_id=1, shape=(1,), payload=NAN32), "fp32", "NaN or Inf"),
    "inf fp16 value": (forge(codec_id=2, shape=(1,), payload=INF16), "fp16", "NaN or Inf"),
    "zstd garbage": (forge(codec_id=1, flags=1, shape=(1,), payload=b"\x00" * 8), "fp32", "zstd"),
    "zstd longer than declared": (forge(codec_id=1, flags=1, shape=(1,),
                                        payload=zstandard.ZstdCompressor().compress(bytes(8))), "fp32", "larger"),
    "zstd shorter than declared": (forge(codec_id=1, flags=1, shape=(4,),
                                         payload=zstandard.ZstdCompressor().compress(bytes(8))), "fp32", "shorter"),
    "zstd two frames": (forge(codec_id=1, flags=1, shape=(1,),
                              payload=zstandard.ZstdCompressor().compress(bytes(4)) * 2), "fp32", "zstd"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_is_rejected_with_a_named_error(case: str) -> None:
    data, name, match = MALFORMED[case]
    codec = get_codec(name)
    with pytest.raises(CodecError, match=match):
        codec.decode(data)
    ndim = data[12] if len(data) >= 32 else 0
    shape = struct.unpack_from(f"<{ndim}Q", data, 32) if 0 < ndim <= 8 and len(data) >= 32 + 8 * ndim else (9,)
    numel = math.prod(shape) if math.prod(shape) < 1 << 20 else 9
    with pytest.raises(CodecError, match=match):  # an `out` that fits, so the payload check is reached
        codec.decode_accumulate(data, torch.zeros(numel))
    assert isinstance(CodecError("x"), ValueError)


def test_mutation_helpers_leave_valid_messages_valid() -> None:
    assert resign(VALID8) == VALID8
    payload = bytes.fromhex(GOLDEN[("fp32", ())])[48:]
    assert forge(codec_id=1, shape=(3, 3), payload=payload) == bytes.fromhex(GOLDEN[("fp32", ())])


def test_limits_bound_elements_and_bytes() -> None:
    data = get_codec("fp32").encode(torch.zeros(100))
    assert get_codec("fp32", limits=DecodeLimits(max_numel=100)).decode(data).numel() == 100
    with pytest.raises(CodecError, match="max_numel=99"):
        get_codec("fp32", limits=DecodeLimits(max_numel=99)).decode(data)
    with pytest.raises(CodecError, match="max_bytes"):
        get_codec("fp32", limits=DecodeLimits(max_bytes=len(data) - 1)).decode(data)


def _rle_bomb(expanded_bytes: int) -> bytes:
    """A zstd frame without a content size whose RLE blocks expand to `expanded_bytes` (32 KB per GB)."""
    block = 1 << 17
    frame = bytearray(b"\x28\xb5\x2f\xfd\x00\x38")  # magic; no content size; window 128 KB
    nblocks = expanded_bytes // block
    for i in range(nblocks):
        frame += (int(i == nblocks - 1) | (1 << 1) | (block << 3)).to_bytes(3, "little") + b"\x00"
    return bytes(frame)


def test_zstd_bomb_allocates_no_more_than_declared() -> None:
    bomb = _rle_bomb(1 << 30)
    assert len(zstandard.ZstdDecompressor().decompressobj().decompress(_rle_bomb(1 << 20))) == 1 << 20  # real
    rss_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CodecError, match="zstd"):
        get_codec("fp32").decode(forge(codec_id=1, flags=1, shape=(16,), payload=bomb))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kb < 256 * 1024


def test_zstd_frame_declaring_a_huge_content_size_is_refused_before_allocating() -> None:
    frame = b"\x28\xb5\x2f\xfd\xe0" + (1 << 40).to_bytes(8, "little") + b"\x03\x00\x00\x00"
    assert zstandard.frame_content_size(frame) == 1 << 40
    with pytest.raises(CodecError, match="larger than declared"):
        get_codec("fp32").decode(forge(codec_id=1, flags=1, shape=(16,), payload=frame))


def test_decode_accumulate_refuses_a_frame_of_another_size_before_decompressing() -> None:
    # 2^31 fp32 elements declared, a ~256 KB frame that really expands to 8 GiB, and an `out` of 16:
    # the element count is checked first, so neither the frame nor the header chooses an allocation.
    numel = 1 << 31
    bomb = _rle_bomb(numel * 4)
    assert len(bomb) < 300_000
    rss_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CodecError, match=f"out has 16 elements, data has {numel}"):
        get_codec("fp32").decode_accumulate(forge(codec_id=1, flags=1, shape=(numel,), payload=bomb), torch.zeros(16))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kb < 64 * 1024

"""The optional zstd stage after a codec (the only importer of `zstandard`), with a bounded decompress."""

from __future__ import annotations

import threading

import zstandard

from swarmtrain.compress.codec import CodecError

__all__ = ["zstd_compress", "zstd_decompress"]

_local = threading.local()  # zstd contexts are not thread-safe; one per thread and level


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def zstd_compress(data: memoryview | bytes, *, level: int) -> bytes:
    """One zstd frame that records its content size."""
    if not 1 <= level <= 22:
        raise ValueError(f"zstd level {level} is not in [1, 22]")
    return _compressor(level).compress(data)


def zstd_decompress(data: memoryview, *, size_bytes: int) -> bytes:
    """Decompresses one frame that must expand to exactly `size_bytes` (the size the header implies).

    The frame's own content-size field is checked before decompressing because python-zstandard
    allocates whatever that field says, ignoring `max_output_size`: a bomb must not choose the
    allocation. Frames without a content size get a buffer of `size_bytes` and fail if it overflows.
    """
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd: bad frame header ({e})") from None
    if declared != zstandard.CONTENTSIZE_UNKNOWN and declared != size_bytes:
        raise CodecError(f"zstd output larger than declared: frame says {declared} bytes, header implies "
                         f"{size_bytes}" if declared > size_bytes else
                         f"zstd output shorter than declared: frame says {declared} bytes, header implies {size_bytes}")
    try:
        out = _decompressor().decompress(data, max_output_size=max(size_bytes, 1), allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd: corrupt or larger than the declared {size_bytes} bytes ({e})") from None
    if len(out) != size_bytes:
        raise CodecError(f"zstd output is {len(out)} bytes, header implies {size_bytes}")
    return out

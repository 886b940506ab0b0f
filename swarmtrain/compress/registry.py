"""Codec registry: `get_codec(name, **options)`, building a codec from `CompressConfig`, and `roundtrip`."""

from __future__ import annotations

from typing import Any

import torch

from swarmtrain.compress.codec import Codec, CodecOptionError
from swarmtrain.compress.codecs import BlockQuantCodec, CastCodec
from swarmtrain.compress.sparse_codec import SparseCodec
from swarmtrain.compress.wire import DecodeLimits
from swarmtrain.config import CompressConfig

__all__ = ["CODEC_NAMES", "codec_from_config", "get_codec", "roundtrip"]

CODEC_NAMES = ("fp32", "fp16", "bf16", "int8", "int4", "sparse")
_CAST_OPTIONS = {"zstd_level", "device", "limits"}
_QUANT_OPTIONS = _CAST_OPTIONS | {"block_size", "scale_dtype", "stochastic_rounding", "seed"}
_SPARSE_OPTIONS = _CAST_OPTIONS | {"density", "bits", "chunk_size"}


def get_codec(name: str, **options: Any) -> Codec:
    """A codec by name. Options: zstd_level (0 = off), device, limits (DecodeLimits) for all codecs;
    block_size, scale_dtype ('fp32'|'fp16'), stochastic_rounding, seed for int8/int4 only; density, bits,
    chunk_size for sparse only. An unknown name or an option the codec does not use is a CodecOptionError."""
    if name not in CODEC_NAMES:
        raise CodecOptionError(f"unknown codec {name!r}; one of {CODEC_NAMES}")
    allowed = _QUANT_OPTIONS if name in ("int8", "int4") else _SPARSE_OPTIONS if name == "sparse" else _CAST_OPTIONS
    unknown = set(options) - allowed
    if unknown:
        raise CodecOptionError(f"codec {name!r} takes no option(s) {sorted(unknown)}; it takes {sorted(allowed)}")
    if name in ("int8", "int4"):
        return BlockQuantCodec(name, **options)
    if name == "sparse":
        return SparseCodec(**options)
    return CastCodec(name, **options)


def codec_from_config(cfg: CompressConfig, *, seed: int | None = None, device: torch.device | str = "cpu",
                      limits: DecodeLimits | None = None) -> Codec:
    """The codec a `[compress]` config section describes (error feedback is the caller's business)."""
    options: dict[str, Any] = {"zstd_level": cfg.zstd_level, "device": device, "limits": limits}
    if cfg.codec in ("int8", "int4"):
        options.update(block_size=cfg.block_size, scale_dtype=cfg.scale_dtype,
                       stochastic_rounding=cfg.stochastic_rounding, seed=seed)
    elif cfg.codec == "sparse":
        options.update(density=cfg.density, bits=cfg.bits, chunk_size=cfg.chunk_size)
    if cfg.codec not in ("int8", "int4") and (cfg.stochastic_rounding or cfg.scale_dtype != "fp32"):
        raise CodecOptionError(f"compress.stochastic_rounding/scale_dtype apply to int8/int4, not {cfg.codec!r}")
    return get_codec(cfg.codec, **options)


def roundtrip(codec: Codec, tensor: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    """(the encoded bytes, what every receiver decodes from them: fp32, tensor's shape).

    Error feedback keeps `tensor - decoded` as the residual for the next round."""
    data = codec.encode(tensor)
    return data, codec.decode(data)

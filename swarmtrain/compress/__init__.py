"""tensors <-> bytes, no networking.

codec.py: the Codec protocol and its errors. wire.py: the versioned header, limits, checksum.
quant.py: the reference int8/int4 math (the contract for kernels/). codecs.py: the fp32/fp16/bf16
and int8/int4 codecs. zstd_stage.py: the optional zstd stage. registry.py: get_codec and friends.
kernels/: fused CPU and CUDA kernels.
sparse.py: the reference chunked top-k sparsification (the contract of its kernels). sparse_codec.py: the
sparse codec built on it. staging.py: device tensors to host bytes through pinned, reused buffers.
"""

from swarmtrain.compress.codec import Codec, CodecError, CodecOptionError
from swarmtrain.compress.registry import CODEC_NAMES, codec_from_config, get_codec, roundtrip
from swarmtrain.compress.wire import DecodeLimits

__all__ = [
    "CODEC_NAMES",
    "Codec",
    "CodecError",
    "CodecOptionError",
    "DecodeLimits",
    "codec_from_config",
    "get_codec",
    "roundtrip",
]

"""The sparse codec: per chunk, the top-k values by magnitude at 2, 4 or 8 bits (see sparse.py for the math).

Payload: a prefix (u8 bits, u8 0, u16 0, u32 k) then the body `sparse.sparse_layout` describes; the header's
block size is the chunk. Meant for pseudo-gradients with error feedback: what a round does not send stays
in the sender's residual. There is no zstd stage: zstd level 3 took 0–2% off a body of N(0, 1) values at
1–3% density (bit-packed offsets and codes are close to random bytes).
"""

from __future__ import annotations

import struct

import torch

from swarmtrain.compress import sparse
from swarmtrain.compress.codec import CodecError, CodecOptionError
from swarmtrain.compress.codecs import _Buffer, _Codec, _view, quant_backend
from swarmtrain.compress.staging import host_bytes
from swarmtrain.compress.wire import CodecId, DecodeLimits, Flags, Header, parse

__all__ = ["SparseCodec", "sparse_k"]

_PREFIX = struct.Struct("<BBHI")


def sparse_k(density: float, chunk: int) -> int:
    """Values kept per full chunk for a density: round(density × chunk), at least 1."""
    return max(1, min(chunk, round(density * chunk)))


def _backend(device: torch.device) -> sparse.SparseBackend:
    """The fused kernels when they build for `device`, else the torch reference."""
    backend = quant_backend(device)
    return backend if hasattr(backend, "sparse_encode") else sparse  # type: ignore[return-value]


class SparseCodec(_Codec):
    """Chunked top-k with `bits`-bit values; `density` of each chunk's values is sent."""

    name = "sparse"
    codec_id = CodecId.SPARSE

    def __init__(self, *, density: float = 0.01, bits: int = 2, chunk_size: int = 4096, zstd_level: int = 0,
                 device: torch.device | str = "cpu", limits: DecodeLimits | None = None) -> None:
        if not 0.0 < density <= 1.0:
            raise CodecOptionError(f"sparse: density {density} is not in (0, 1]")
        if bits not in sparse.SPARSE_BITS:
            raise CodecOptionError(f"sparse: bits {bits} is not one of {sparse.SPARSE_BITS}")
        if not 2 <= chunk_size <= sparse.MAX_CHUNK:
            raise CodecOptionError(f"sparse: chunk_size {chunk_size} is not in [2, {sparse.MAX_CHUNK}]")
        if zstd_level:
            raise CodecOptionError("sparse: zstd_level must be 0 (its payload does not compress)")
        super().__init__(zstd_level=0, device=device, limits=limits or DecodeLimits())
        self.density = density
        self.bits = bits
        self.chunk = chunk_size
        self.k = sparse_k(density, chunk_size)
        self.alignment = chunk_size
        self._kernels = _backend(self.device)

    def __repr__(self) -> str:
        return f"SparseCodec(k={self.k}/{self.chunk}, bits={self.bits}, device={self.device})"

    def _encode_payload(self, x: torch.Tensor) -> tuple[list[memoryview], Flags, int]:
        body = self._kernels.sparse_encode(x, chunk=self.chunk, k=self.k, bits=self.bits)
        prefix = memoryview(_PREFIX.pack(self.bits, 0, 0, self.k))
        return [prefix, host_bytes(body)], Flags(0), self.chunk  # from a GPU, through the page-locked arena

    # -- decode ------------------------------------------------------------------------------
    def _open(self, data: _Buffer, *, numel: int | None = None, verify: bool = True) -> tuple[Header, _Buffer]:
        header, payload = parse(data, limits=self.limits, verify_checksum=verify)
        if header.codec_id != self.codec_id:
            raise CodecError(f"codec mismatch: data was encoded by {header.codec_id.name.lower()}, "
                             f"this codec is {self.name}")
        if numel is not None and header.numel != numel:
            raise CodecError(f"decode_accumulate: out has {numel} elements, data has {header.numel} "
                             f"(shape {header.shape})")
        self._check_header(header)
        if payload.nbytes < _PREFIX.size:
            raise CodecError(f"sparse: truncated: {payload.nbytes} payload bytes cannot hold its prefix")
        bits, zero_a, zero_b, k = _PREFIX.unpack_from(payload)
        if zero_a or zero_b:
            raise CodecError("sparse: reserved prefix bytes are not zero")
        try:
            layout = sparse.sparse_layout(header.numel, chunk=header.block_size, k=k, bits=bits)
        except ValueError as e:
            raise CodecError(f"sparse: bad prefix: {e}") from None
        if payload.nbytes != _PREFIX.size + layout.body_bytes:
            raise CodecError(f"shape mismatch: payload has {payload.nbytes} bytes, shape {header.shape} with "
                             f"k={k}, bits={bits} needs {_PREFIX.size + layout.body_bytes}")
        return header, payload

    def _check_header(self, header: Header) -> None:
        if header.flags:
            raise CodecError(f"sparse: unknown flag bits {int(header.flags):#x} (this codec defines none)")
        if not 2 <= header.block_size <= sparse.MAX_CHUNK:
            raise CodecError(f"sparse: block size (chunk) {header.block_size} is not in [2, {sparse.MAX_CHUNK}]")

    def _raw_size(self, header: Header) -> int:  # _open checks the size itself (it depends on the prefix)
        raise AssertionError("unused")

    def _body(self, raw: _Buffer) -> tuple[torch.Tensor, int, int]:
        bits, _, _, k = _PREFIX.unpack_from(raw)
        n = memoryview(raw).nbytes - _PREFIX.size
        body = _view(raw, torch.uint8, count=n, offset=_PREFIX.size) if n else torch.empty(0, dtype=torch.uint8)
        return body.to(self.device), k, bits

    def _decode_flat(self, header: Header, raw: _Buffer) -> torch.Tensor:
        out = torch.zeros(header.numel, dtype=torch.float32, device=self.device)
        self._accumulate(header, raw, out)
        return out

    def _accumulate(self, header: Header, raw: _Buffer, out: torch.Tensor) -> None:
        body, k, bits = self._body(raw)
        self._kernels.sparse_decode_accumulate(body, numel=header.numel, chunk=header.block_size, k=k, bits=bits,
                                               out=out.view(-1))

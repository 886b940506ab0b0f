"""The concrete codecs: fp32/fp16/bf16 casts and blockwise int8/int4, each with an optional zstd stage."""

from __future__ import annotations

import abc
import contextlib
import math
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import ClassVar, overload

import torch

from swarmtrain.compress import quant
from swarmtrain.compress.codec import Allocator, CodecError, CodecOptionError
from swarmtrain.compress.staging import arena, host_bytes
from swarmtrain.compress.wire import (
    DTYPE_CODES,
    MAX_BLOCK_SIZE,
    CodecId,
    DecodeLimits,
    Flags,
    Header,
    frame,
    parse,
)
from swarmtrain.compress.zstd_stage import zstd_compress, zstd_decompress

__all__ = ["ENCODE_PIECE", "BlockQuantCodec", "CastCodec", "quant_backend"]

_Buffer = bytes | bytearray | memoryview
_CAST_CHUNK_ELEMENTS = 1 << 18
ENCODE_PIECE = 1 << 22  # values read and quantized at a time by encode_from (16 MB of fp32)
DECODE_PIECE = 1 << 22  # values decoded at a time by decode_pieces
_FP32_MAX = torch.finfo(torch.float32).max


def quant_backend(device: torch.device) -> quant.QuantBackend:
    """The one place codecs get their quantization functions from: fused kernels when they build."""
    from swarmtrain.compress.kernels import get_backend  # deferred: kernels imports quant

    return get_backend(device)


_silenced = threading.Event()
_silence_lock = threading.Lock()


def _view(buf: _Buffer, dtype: torch.dtype, *, count: int, offset: int = 0) -> torch.Tensor:
    """A read-only CPU tensor over received bytes, copied only when the data is misaligned for dtype."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    if not _silenced.is_set():
        # torch warns once per process that the buffer is read-only; we never write to it
        with _silence_lock, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)
            _silenced.set()
    else:
        t = torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    return t.clone() if t.data_ptr() % t.element_size() else t


_scratches = threading.local()  # per thread: idle decode scratch vectors by device


@contextlib.contextmanager
def _scratch(numel: int, device: torch.device) -> Iterator[torch.Tensor]:
    """An fp32 vector of at least `numel` values, reused by this thread's next decode: a fresh one costs a
    zeroing page fault per 4 KiB (as much again as the decode), and the outer step decodes each mean two or
    three times. Nested decodes in one thread each get their own."""
    idle: dict[torch.device, torch.Tensor] = _scratches.__dict__.setdefault("idle", {})
    held = idle.pop(device, None)
    if held is None or held.numel() < numel:
        held = torch.empty(numel, dtype=torch.float32, device=device)
    try:
        yield held
    finally:
        idle[device] = held


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in t. min/max propagate NaN, and one fused pass is ~50x faster than isfinite().all()."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _bytes_of(t: torch.Tensor) -> memoryview:
    """Flat byte view of a tensor's memory on the host: in place on the CPU; from a GPU, one copy into this
    thread's page-locked staging arena, valid until the encode's `staging.arena()` block ends."""
    return host_bytes(t)


class _Codec(abc.ABC):
    """Framing, validation and the zstd stage shared by every codec; subclasses own the payload."""

    name: str
    codec_id: CodecId
    alignment: int = 1

    def __init__(self, *, zstd_level: int, device: torch.device | str, limits: DecodeLimits) -> None:
        if not 0 <= zstd_level <= 22:
            raise CodecOptionError(f"zstd_level {zstd_level} is not in [0, 22] (0 = off)")
        self.zstd_level = zstd_level
        self.device = torch.device(device)
        self.limits = limits

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, zstd_level={self.zstd_level}, device={self.device})"

    # -- encode ------------------------------------------------------------------------------
    @overload
    def encode(self, tensor: torch.Tensor) -> bytes: ...

    @overload
    def encode(self, tensor: torch.Tensor, *, into: Allocator) -> memoryview: ...

    def encode(self, tensor: torch.Tensor, *, into: Allocator | None = None) -> bytes | memoryview:
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in DTYPE_CODES:
            what = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise CodecError(f"{self.name}: cannot encode {what}; expected a float32/16, bfloat16 or float64 tensor")
        x = tensor.detach().to(self.device, torch.float32).reshape(-1)
        with arena():  # a GPU's parts are staged in page-locked memory until they are framed
            parts, flags, block_size = self._encode_payload(x)
            if self.zstd_level:
                parts = [memoryview(zstd_compress(b"".join(parts), level=self.zstd_level))]
                flags |= Flags.ZSTD
            header = Header(self.codec_id, flags, tensor.dtype, block_size, tuple(tensor.shape),
                            sum(p.nbytes for p in parts))
            return frame(header, parts, into=into)

    @abc.abstractmethod
    def _encode_payload(self, x: torch.Tensor) -> tuple[list[memoryview], Flags, int]: ...

    @overload
    def encode_from(self, read: Callable[[int, int], torch.Tensor], numel: int, *,
                    piece: int = ENCODE_PIECE) -> bytes: ...

    @overload
    def encode_from(self, read: Callable[[int, int], torch.Tensor], numel: int, *, piece: int = ENCODE_PIECE,
                    into: Allocator) -> memoryview: ...

    def encode_from(self, read: Callable[[int, int], torch.Tensor], numel: int, *, piece: int = ENCODE_PIECE,
                    into: Allocator | None = None) -> bytes | memoryview:
        """`encode(read(0, numel))` to the bit for a flat fp32 source read `piece` values at a time, so
        that encoding a shard never holds it whole in fp32. Codecs whose payload is not the pieces'
        payloads laid end to end (zstd, stochastic rounding, sparse) read the source once, whole."""
        step = self._piece(piece)
        if step <= 0 or numel <= step:
            return self.encode(read(0, numel)) if into is None else self.encode(read(0, numel), into=into)
        pieces: list[list[memoryview]] = []
        flags, block_size = Flags(0), 0
        with arena():
            for lo in range(0, numel, step):
                x = read(lo, min(numel, lo + step))
                if x.dtype != torch.float32 or x.dim() != 1 or x.numel() != min(numel, lo + step) - lo:
                    raise CodecError(f"{self.name}: encode_from read {x.dtype} {tuple(x.shape)} for values "
                                     f"[{lo}, {min(numel, lo + step)}); expected that many flat float32 values")
                parts, flags, block_size = self._encode_payload(x.detach().to(self.device))
                pieces.append(parts)
            parts = [part for kind in zip(*pieces, strict=True) for part in kind]  # each kind of part, in order
            header = Header(self.codec_id, flags, torch.float32, block_size, (numel,), sum(p.nbytes for p in parts))
            return frame(header, parts, into=into)

    def _piece(self, piece: int) -> int:
        """Values per piece for encode_from (a multiple of the codec's alignment), 0 = read it whole."""
        return 0

    # -- decode ------------------------------------------------------------------------------
    def _open(self, data: _Buffer, *, numel: int | None = None, verify: bool = True) -> tuple[Header, _Buffer]:
        """Parses and checks the header for this codec (and its element count against `numel`, when given,
        before anything is decompressed or allocated); returns it with the raw (decompressed) payload."""
        header, payload = parse(data, limits=self.limits, verify_checksum=verify)
        if header.codec_id != self.codec_id:
            raise CodecError(f"codec mismatch: data was encoded by {header.codec_id.name.lower()}, "
                             f"this codec is {self.name}")
        self._check_header(header)
        if numel is not None and header.numel != numel:
            raise CodecError(f"decode_accumulate: out has {numel} elements, data has {header.numel} "
                             f"(shape {header.shape})")
        size = self._raw_size(header)
        if Flags.ZSTD in header.flags:
            return header, zstd_decompress(payload, size_bytes=size)
        if payload.nbytes != size:
            raise CodecError(f"shape mismatch: payload has {payload.nbytes} bytes, shape {header.shape} "
                             f"needs {size}")
        return header, payload

    @abc.abstractmethod
    def _check_header(self, header: Header) -> None: ...

    @abc.abstractmethod
    def _raw_size(self, header: Header) -> int: ...

    def _check_out(self, out: torch.Tensor) -> None:
        if not isinstance(out, torch.Tensor):
            raise CodecError(f"decode_accumulate: out must be a tensor, got {type(out).__name__}")
        if out.dtype != torch.float32:
            raise CodecError(f"decode_accumulate: out must be float32, got {out.dtype}")
        if out.device != self.device:
            raise CodecError(f"decode_accumulate: out is on {out.device}, this codec decodes on {self.device}")
        if not out.is_contiguous():
            raise CodecError("decode_accumulate: out must be contiguous")

    def decode(self, data: _Buffer) -> torch.Tensor:
        header, raw = self._open(data)
        return self._decode_flat(header, raw).view(header.shape)

    def decode_accumulate(self, data: _Buffer, out: torch.Tensor, *, checked: bool = False) -> None:
        self._check_out(out)
        header, raw = self._open(data, numel=out.numel(), verify=not checked)
        values = self._fp32_values(header, raw, check=False) if checked else None
        if values is not None:
            out.view(-1).add_(values)
            return
        self._accumulate(header, raw, out)

    def validate(self, data: _Buffer, *, numel: int) -> None:
        header, raw = self._open(data, numel=numel)
        self._validate(header, raw)

    def decode_pieces(self, data: _Buffer, *, numel: int, piece: int = DECODE_PIECE,
                      checked: bool = False) -> Iterator[tuple[int, torch.Tensor]]:
        """The decoded flat tensor as (offset, values) pieces that cover it once, in order, `piece` values
        at most each (a multiple of `alignment`), the same bits as `decode`. Each piece's values live in
        one scratch vector that the next piece overwrites: a caller uses each before asking for the next.
        The payload is parsed and checked once, up front. Codecs that cannot decode a range (zstd, sparse)
        give one piece, the whole tensor. `checked`: `data` passed `validate` before and is unchanged since
        (a round's material, named by its digest): its checksum and wire values are not checked again."""
        header, raw = self._open(data, numel=numel, verify=not checked)
        step = piece // self.alignment * self.alignment
        values = self._fp32_values(header, raw, check=not checked)
        if values is not None:  # the wire holds the fp32 values themselves: read-only views, nothing decoded
            if not 0 < step < numel:
                yield 0, values
                return
            for lo in range(0, numel, step):
                yield lo, values[lo:lo + step]
            return
        decode = self._range_decoder(header, raw) if 0 < step < numel else None
        if decode is None:
            whole = torch.zeros(numel, dtype=torch.float32, device=self.device)
            self._accumulate(header, raw, whole)
            yield 0, whole
            return
        with _scratch(step, self.device) as scratch:
            for lo in range(0, numel, step):
                out = scratch[:min(step, numel - lo)].zero_()
                decode(lo, out)
                yield lo, out

    def _fp32_values(self, header: Header, raw: _Buffer, *, check: bool = True) -> torch.Tensor | None:
        """The payload as the flat fp32 values it decodes to (checked finite unless not `check`), where the
        wire holds exactly those (uncompressed fp32); None for every other encoding."""
        return None

    def _range_decoder(self, header: Header, raw: _Buffer) -> Callable[[int, torch.Tensor], None] | None:
        """`decode(lo, out)`: add values [lo, lo + out.numel()) into `out` (lo on `alignment`), after
        checking the whole payload now; None where the codec decodes the whole only."""
        return None

    def _validate(self, header: Header, raw: _Buffer) -> None:
        """Decode and look (codecs whose payload alone tells whether it decodes finite do less)."""
        if not _all_finite(self._decode_flat(header, raw)):
            raise CodecError(f"{self.name}: payload decodes to NaN or Inf")

    @abc.abstractmethod
    def _decode_flat(self, header: Header, raw: _Buffer) -> torch.Tensor: ...

    @abc.abstractmethod
    def _accumulate(self, header: Header, raw: _Buffer, out: torch.Tensor) -> None: ...


class CastCodec(_Codec):
    """fp32 (bit exact), fp16 or bf16 (one rounding cast); non-finite values are rejected both ways."""

    _WIRE: ClassVar[dict[str, tuple[CodecId, torch.dtype]]] = {
        "fp32": (CodecId.FP32, torch.float32), "fp16": (CodecId.FP16, torch.float16),
        "bf16": (CodecId.BF16, torch.bfloat16)}

    def __init__(self, name: str, *, zstd_level: int = 0, device: torch.device | str = "cpu",
                 limits: DecodeLimits | None = None) -> None:
        if name not in self._WIRE:
            raise CodecOptionError(f"CastCodec: unknown name {name!r}; one of {sorted(self._WIRE)}")
        super().__init__(zstd_level=zstd_level, device=device, limits=limits or DecodeLimits())
        self.name = name
        self.codec_id, self.wire_dtype = self._WIRE[name]

    def _piece(self, piece: int) -> int:
        return 0 if self.zstd_level else piece

    def _encode_payload(self, x: torch.Tensor) -> tuple[list[memoryview], Flags, int]:
        if not _all_finite(x):
            raise CodecError(f"{self.name}: non-finite input: the tensor holds NaN or Inf")
        y = x.to(self.wire_dtype)
        if self.wire_dtype != torch.float32 and not _all_finite(y):
            raise CodecError(f"{self.name}: a value overflows {self.name} (|x| > {torch.finfo(self.wire_dtype).max:g})")
        return [_bytes_of(y)], Flags(0), 0

    def _check_header(self, header: Header) -> None:
        if header.block_size != 0:
            raise CodecError(f"{self.name}: block size must be 0, header says {header.block_size}")
        if header.flags & (Flags.SCALE_FP16 | Flags.STOCHASTIC):
            raise CodecError(f"{self.name}: scale flags set on a codec without scales ({header.flags!r})")

    def _raw_size(self, header: Header) -> int:
        return header.numel * self.wire_dtype.itemsize

    def _values(self, header: Header, raw: _Buffer, *, check: bool = True) -> torch.Tensor:
        vals = _view(raw, self.wire_dtype, count=header.numel)
        if check and not _all_finite(vals):
            raise CodecError(f"{self.name}: payload holds NaN or Inf")
        return vals.to(self.device)

    def _validate(self, header: Header, raw: _Buffer) -> None:
        self._values(header, raw)  # every wire value finite: fp16/bf16 -> fp32 widens exactly

    def _decode_flat(self, header: Header, raw: _Buffer) -> torch.Tensor:
        return self._values(header, raw).to(torch.float32, copy=True)

    def _fp32_values(self, header: Header, raw: _Buffer, *, check: bool = True) -> torch.Tensor | None:
        if self.wire_dtype != torch.float32 or Flags.ZSTD in header.flags:
            return None
        return self._values(header, raw, check=check)

    def _range_decoder(self, header: Header, raw: _Buffer) -> Callable[[int, torch.Tensor], None] | None:
        if Flags.ZSTD in header.flags:
            return None
        vals = self._values(header, raw)
        return lambda lo, out: self._add(vals[lo:lo + out.numel()], out.view(-1))

    def _accumulate(self, header: Header, raw: _Buffer, out: torch.Tensor) -> None:
        self._add(self._values(header, raw), out.view(-1))

    @staticmethod
    def _add(vals: torch.Tensor, flat: torch.Tensor) -> None:
        if vals.dtype == torch.float32:
            flat.add_(vals)
            return
        for start in range(0, vals.numel(), _CAST_CHUNK_ELEMENTS):  # mixed-dtype add_ is slow; widen by chunk
            stop = start + _CAST_CHUNK_ELEMENTS
            flat[start:stop].add_(vals[start:stop].float())


class BlockQuantCodec(_Codec):
    """Blockwise absmax int8 or int4 (see quant.py for the exact math the kernels must match)."""

    _IDS: ClassVar[dict[str, CodecId]] = {"int8": CodecId.INT8, "int4": CodecId.INT4}

    def __init__(self, name: str, *, block_size: int = 64, scale_dtype: str = "fp32",
                 stochastic_rounding: bool = False, seed: int | None = None, zstd_level: int = 0,
                 device: torch.device | str = "cpu", limits: DecodeLimits | None = None) -> None:
        if name not in self._IDS:
            raise CodecOptionError(f"BlockQuantCodec: unknown name {name!r}; one of {sorted(self._IDS)}")
        if not (2 <= block_size <= MAX_BLOCK_SIZE and block_size % 2 == 0):
            raise CodecOptionError(f"block_size {block_size} must be even and in [2, {MAX_BLOCK_SIZE}]")
        if scale_dtype not in ("fp32", "fp16"):
            raise CodecOptionError(f"scale_dtype {scale_dtype!r} is not 'fp32' or 'fp16'")
        super().__init__(zstd_level=zstd_level, device=device, limits=limits or DecodeLimits())
        self.name = name
        self.codec_id = self._IDS[name]
        self.block_size = block_size
        self.alignment = block_size
        self.scale_fp16 = scale_dtype == "fp16"
        self.stochastic = stochastic_rounding
        self._generator: torch.Generator | None = None
        if stochastic_rounding:
            # no seed = fresh entropy: peers sharing one seed would round with correlated noise
            self._generator = torch.Generator(device=self.device)
            if seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(seed)
        self._backend = quant_backend(self.device)

    def _piece(self, piece: int) -> int:
        return 0 if self.zstd_level or self.stochastic else piece // self.block_size * self.block_size

    def _encode_payload(self, x: torch.Tensor) -> tuple[list[memoryview], Flags, int]:
        fn = self._backend.int8_quantize if self.codec_id == CodecId.INT8 else self._backend.int4_quantize
        q, scales = fn(x, block_size=self.block_size, scale_fp16=self.scale_fp16, stochastic=self.stochastic,
                       generator=self._generator)
        flags = (Flags.SCALE_FP16 if self.scale_fp16 else Flags(0)) | (
            Flags.STOCHASTIC if self.stochastic else Flags(0))
        return [_bytes_of(q), _bytes_of(scales)], flags, self.block_size

    def _check_header(self, header: Header) -> None:
        bs = header.block_size
        if not (2 <= bs <= MAX_BLOCK_SIZE and bs % 2 == 0):
            raise CodecError(f"{self.name}: block size {bs} is not even in [2, {MAX_BLOCK_SIZE}]")

    @staticmethod
    def _q_bytes(header: Header) -> int:
        return header.numel if header.codec_id == CodecId.INT8 else -(-header.numel // 2)

    def _raw_size(self, header: Header) -> int:
        scale_bytes = 2 if Flags.SCALE_FP16 in header.flags else 4
        return self._q_bytes(header) + quant.num_blocks(header.numel, block_size=header.block_size) * scale_bytes

    def _parts(self, header: Header, raw: _Buffer) -> tuple[torch.Tensor, torch.Tensor]:
        """(q or packed nibbles, fp32 scales) on the codec's device, after checking both are well formed."""
        nq = self._q_bytes(header)
        nb = quant.num_blocks(header.numel, block_size=header.block_size)
        q = _view(raw, torch.int8 if header.codec_id == CodecId.INT8 else torch.uint8, count=nq)
        sdtype = torch.float16 if Flags.SCALE_FP16 in header.flags else torch.float32
        scales = _view(raw, sdtype, count=nb, offset=nq).float()
        qmax = quant.INT8_QMAX if header.codec_id == CodecId.INT8 else quant.INT4_QMAX
        _check_scales(scales, name=self.name, qmax=qmax)
        if header.codec_id == CodecId.INT8:
            if nq and int(torch.aminmax(q)[0]) < -quant.INT8_QMAX:  # aminmax: the fastest int8 reduction here
                raise CodecError(f"int8: value -128 is outside [-{quant.INT8_QMAX}, {quant.INT8_QMAX}]")
        else:
            _check_nibbles(q, numel=header.numel)
        return q.to(self.device), scales.to(self.device)

    def _validate(self, header: Header, raw: _Buffer) -> None:
        # Well-formed q and scales finite, >= 0 and at most FP32_MAX / qmax: every q * scale is finite
        # (|q| <= qmax, and rounding the exact product cannot pass FP32_MAX, which is representable).
        self._parts(header, raw)

    def _decode_flat(self, header: Header, raw: _Buffer) -> torch.Tensor:
        q, scales = self._parts(header, raw)
        if header.codec_id == CodecId.INT8:
            return self._backend.int8_dequantize(q, scales, block_size=header.block_size)
        return self._backend.int4_dequantize(q, scales, numel=header.numel, block_size=header.block_size)

    def _accumulate(self, header: Header, raw: _Buffer, out: torch.Tensor) -> None:
        q, scales = self._parts(header, raw)
        fn = (self._backend.int8_dequantize_accumulate if header.codec_id == CodecId.INT8
              else self._backend.int4_dequantize_accumulate)
        fn(q, scales, block_size=header.block_size, out=out)

    def _range_decoder(self, header: Header, raw: _Buffer) -> Callable[[int, torch.Tensor], None] | None:
        if Flags.ZSTD in header.flags:
            return None
        q, scales = self._parts(header, raw)
        bs, int8 = header.block_size, header.codec_id == CodecId.INT8
        fn = self._backend.int8_dequantize_accumulate if int8 else self._backend.int4_dequantize_accumulate

        def decode(lo: int, out: torch.Tensor) -> None:
            n = out.numel()
            if lo % bs or (n % bs and lo + n != header.numel):
                raise CodecError(f"{self.name}: values [{lo}, {lo + n}) are not whole blocks of {bs}")
            qs = q[lo:lo + n] if int8 else q[lo // 2:lo // 2 + -(-n // 2)]
            fn(qs, scales[lo // bs:lo // bs + quant.num_blocks(n, block_size=bs)], block_size=bs, out=out)
        return decode


def _check_scales(scales: torch.Tensor, *, name: str, qmax: int) -> None:
    """Finite, >= 0, and small enough that qmax * scale stays finite (an encoder never sends more)."""
    if scales.numel() == 0:
        return
    lo, hi = (float(v) for v in torch.aminmax(scales))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise CodecError(f"{name}: non-finite (NaN/Inf) block scale")
    if lo < 0:
        raise CodecError(f"{name}: negative block scale {lo}")
    if hi > _FP32_MAX / qmax:
        raise CodecError(f"{name}: block scale {hi:g} is too large: {qmax} * scale overflows float32")


def _check_nibbles(packed: torch.Tensor, *, numel: int) -> None:
    """Nibble 0 would be q = -8 (outside [-7, 7]); the unused high nibble of an odd tail must be 8."""
    if packed.numel() == 0:
        return
    # reductions, not .any() over a bool temporary: that is ~50x slower on CPU
    if int(packed.amin()) < 0x10 or int((packed & 0x0F).amin()) == 0:
        raise CodecError("int4: nibble 0 (q = -8) is outside [-7, 7]")
    if numel % 2 and int(packed[-1]) >> 4 != 8:
        raise CodecError("int4: the padding nibble after an odd element count must be 8")

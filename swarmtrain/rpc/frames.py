"""Zero-copy protobuf framing of the bulk chunk messages (PushChunk, FetchChunk, StateChunk).

The chunks are ordinary messages of proto/swarmtrain/wire/*.proto, but encoding them through the
protobuf runtime copies every payload byte twice per side (slice -> message -> serialized string).
These helpers write `tag | varint length | payload` with one join and read payloads as memoryviews,
so a chunk costs one copy per side. Only length-delimited and varint fields are understood; anything
else is a FrameError. A unit test pins byte equality with the protobuf runtime.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["FrameError", "encode_bytes_field", "encode_varint_field", "fields", "frame"]

_VARINT, _LEN = 0, 2


class FrameError(ValueError):
    """A chunk is not a well-formed message of the expected shape."""


def _varint(value: int) -> bytes:
    if value < 0:
        raise FrameError(f"negative varint {value}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_varint_field(number: int, value: int) -> bytes:
    return _varint(number << 3 | _VARINT) + _varint(value)


def encode_bytes_field(number: int, length: int) -> bytes:
    """The tag and length prefix of a length-delimited field; the caller appends `length` bytes."""
    return _varint(number << 3 | _LEN) + _varint(length)


def frame(prefix: bytes, data_field: int, data: memoryview | bytes) -> bytes:
    """`prefix` (other fields, already encoded) followed by `data` as field `data_field`: one copy."""
    return b"".join((prefix, encode_bytes_field(data_field, len(data)), data))


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise FrameError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def fields(message: bytes | memoryview) -> Iterator[tuple[int, int | memoryview]]:
    """(field number, int or memoryview) for each varint / length-delimited field, in wire order."""
    buf = memoryview(message)
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos)
            yield number, value
        elif wire_type == _LEN:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise FrameError(f"field {number} claims {length} bytes, {len(buf) - pos} remain")
            yield number, buf[pos:pos + length]
            pos += length
        else:
            raise FrameError(f"field {number} has unsupported wire type {wire_type}")

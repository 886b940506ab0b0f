"""The JSON codec of a record's fields, declared once on each field: `x: int = wire(read_count, default=0)`.

A field's metadata holds how it is read from a record's JSON object (a `Reader`: validates and names the
field in its error) and, where it differs from the value itself, how it is written. `fields_to_json` and
`fields_from_json` walk a dataclass's fields, so a new field is one line, not four places to keep in step.
Readers of fields that newer peers added (`read_optional_*`) take an absent key as the field's zero.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

__all__ = [
    "HEX_RE", "Reader", "RecordError", "field_error", "fields_from_json", "fields_to_json", "read_bool",
    "read_count", "read_hex", "read_index", "read_number", "read_optional_count", "read_optional_number",
    "read_peer_id", "read_signed_number", "read_str", "wire",
]

PEER_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
HEX_RE = re.compile(r"^[0-9a-f]{0,128}$")

Reader = Callable[[str, Mapping[str, Any], str], Any]  # (record kind, its JSON object, field name) -> value


class RecordError(ValueError):
    """A control-plane record failed validation; the message names the field and the record kind."""


def field_error(kind: str, name: str, msg: str) -> RecordError:
    return RecordError(f"{kind}.{name}: {msg}")


@dataclass(frozen=True)
class _Wire:
    read: Reader
    write: Callable[[Any], Any] | None  # None: the value as it is
    omit: Callable[[Any], bool] | None  # a value written as no key at all (so older peers' records read alike)


_KEY = "swarmtrain.wire"


def wire(read: Reader, *, default: Any = MISSING, default_factory: Any = MISSING,
         write: Callable[[Any], Any] | None = None, omit: Callable[[Any], bool] | None = None,
         hash: bool | None = None) -> Any:
    """A dataclass field with its JSON codec in its metadata (the arguments of `dataclasses.field` kept)."""
    meta = {_KEY: _Wire(read, write, omit)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta, hash=hash)
    return field(default=default, metadata=meta, hash=hash)


def fields_to_json(record: Any) -> dict[str, Any]:
    out = {}
    for f in fields(record):
        codec: _Wire | None = f.metadata.get(_KEY)
        if codec is None:
            continue
        value = getattr(record, f.name)
        if codec.omit is not None and codec.omit(value):
            continue
        out[f.name] = value if codec.write is None else codec.write(value)
    return out


def fields_from_json(cls: type, kind: str, d: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `cls` read from `d`, each field by its reader (a RecordError names the first
    field that does not read)."""
    return {f.name: f.metadata[_KEY].read(kind, d, f.name) for f in fields(cls) if _KEY in f.metadata}


def read_str(kind: str, d: Mapping[str, Any], name: str) -> str:
    v = d.get(name)
    if not isinstance(v, str):
        raise field_error(kind, name, f"expected a string, got {type(v).__name__}")
    return v


def read_count(kind: str, d: Mapping[str, Any], name: str) -> int:
    v = d.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise field_error(kind, name, f"expected an int >= 0, got {v!r}")
    return v


def read_number(kind: str, d: Mapping[str, Any], name: str) -> float:
    v = d.get(name)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        raise field_error(kind, name, f"expected a finite number >= 0, got {v!r}")
    return float(v)


def read_index(kind: str, d: Mapping[str, Any], name: str) -> int:
    """An index where -1 is none; absent in records of peers from before the field (-1)."""
    v = d.get(name, -1)
    if not isinstance(v, int) or isinstance(v, bool) or v < -1:
        raise field_error(kind, name, f"expected an int >= -1, got {v!r}")
    return v


def read_optional_count(kind: str, d: Mapping[str, Any], name: str) -> int:
    """A count newer peers add: absent in older peers' records, where it reads as 0."""
    return read_count(kind, d, name) if name in d else 0


def read_optional_number(kind: str, d: Mapping[str, Any], name: str) -> float:
    """A number newer peers add: absent in older peers' records, where it reads as 0 (unknown)."""
    return read_number(kind, d, name) if name in d else 0.0


def read_signed_number(kind: str, d: Mapping[str, Any], name: str) -> float:
    """Any number (a signed estimate); absent in older records, where it reads as 0."""
    v = d.get(name, 0.0)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise field_error(kind, name, f"expected a number, got {v!r}")
    return float(v)


def read_bool(kind: str, d: Mapping[str, Any], name: str) -> bool:
    v = d.get(name)
    if not isinstance(v, bool):
        raise field_error(kind, name, f"expected a bool, got {v!r}")
    return v


def read_peer_id(kind: str, d: Mapping[str, Any], name: str) -> str:
    v = read_str(kind, d, name)
    if not PEER_ID_RE.match(v):
        raise field_error(kind, name, f"{v[:40]!r} is not a peer id ([A-Za-z0-9._-], 1-128 chars)")
    return v


def read_hex(kind: str, d: Mapping[str, Any], name: str) -> str:
    """A lowercase hex digest (or empty); absent in entries of peers from before the field."""
    v = d.get(name, "")
    if not isinstance(v, str) or not HEX_RE.match(v):
        raise field_error(kind, name, f"{str(v)[:40]!r} is not lowercase hex")
    return v

"""Documents of the inputs `swarmtrain data prepare` and `tokenizer train` read, streamed in bounded pieces.

* a text file (any other name): one document, cut into pieces of about `piece_bytes` at line ends;
* `.jsonl`: one document a line, its `field` (a string);
* `.parquet`: one document a row, its column `field` (pyarrow, the `hf` extra);
* a directory saved by `datasets` (`save_to_disk`): one document a row of `split`, its column `field`.

Each error names the file (and the line or row) and what is wrong with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from swarmtrain.extras import require

__all__ = ["InputError", "Piece", "iter_pieces", "iter_texts"]

_BATCH_ROWS = 1024
_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


class InputError(ValueError):
    """An input file is missing, malformed, or lacks the field; names the file, the line or row, and what."""


@dataclass(frozen=True)
class Piece:
    """Some text of one document; `ends_document` when the document's end-of-text follows it."""

    text: str
    ends_document: bool


def iter_pieces(paths: Sequence[str], *, field: str = "text", split: str = "train",
                piece_bytes: int = 1 << 16) -> Iterator[Piece]:
    """Every input's documents, in order, as pieces of at most about `piece_bytes` (text files) or one
    document each (rows)."""
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            yield from _dataset_dir(path, field=field, split=split)
        elif not path.is_file():
            raise InputError(f"{path}: no such file or directory")
        elif path.suffix == ".jsonl":
            yield from _jsonl(path, field=field)
        elif path.suffix == ".parquet":
            yield from _parquet(path, field=field)
        else:
            yield from _text(path, piece_bytes=piece_bytes)


def iter_texts(paths: Sequence[str], *, field: str = "text", split: str = "train") -> Iterator[str]:
    """The inputs' text, piece by piece (what a tokenizer trains on)."""
    for piece in iter_pieces(paths, field=field, split=split):
        yield piece.text


def _utf8_cut(data: bytes) -> int:
    """Where to cut `data` so no UTF-8 character is split: after its last newline, else before a lead byte."""
    newline = data.rfind(b"\n")
    if newline >= 0:
        return newline + 1
    cut = len(data)
    while cut > 0 and (data[cut - 1] & 0xC0) == 0x80:  # continuation bytes
        cut -= 1
    if cut > 0 and data[cut - 1] >= 0xC0:  # a lead byte whose continuation is not all here
        cut -= 1
    return cut or len(data)


def _text(path: Path, *, piece_bytes: int) -> Iterator[Piece]:
    offset = 0
    carry = b""
    with path.open("rb") as f:
        while True:
            chunk = f.read(piece_bytes)
            data = carry + chunk
            if not data:  # the file ended at a piece's end: an empty piece carries the document's end
                if offset:
                    yield Piece("", ends_document=True)
                return
            cut = len(data) if not chunk else _utf8_cut(data)
            body, carry = data[:cut], data[cut:]
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{path}: not UTF-8 text at byte {offset + e.start}") from e
            offset += len(body)
            last = not chunk and not carry
            if text or last:
                yield Piece(text, ends_document=last)
            if last:
                return


def _jsonl(path: Path, *, field: str) -> Iterator[Piece]:
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise InputError(f"{path}:{number}: not a JSON line ({e})") from e
            if not isinstance(record, dict) or field not in record:
                raise InputError(f"{path}:{number}: no field {field!r} (--field names the text field)")
            text = record[field]
            if not isinstance(text, str):
                raise InputError(f"{path}:{number}: field {field!r} is a {type(text).__name__}, not a string")
            yield Piece(text, ends_document=True)


def _rows(path: Path, column: list[object], *, field: str, first_row: int) -> Iterator[Piece]:
    for i, text in enumerate(column):
        if not isinstance(text, str):
            raise InputError(f"{path}: row {first_row + i}: column {field!r} is "
                             f"{'null' if text is None else type(text).__name__}, not a string")
        yield Piece(text, ends_document=True)


def _parquet(path: Path, *, field: str) -> Iterator[Piece]:
    pq = require("pyarrow.parquet", purpose=f"reading {path}")
    try:
        parquet = pq.ParquetFile(str(path))
    except Exception as e:  # pyarrow raises ArrowInvalid and OSError subclasses for a bad file
        raise InputError(f"{path}: not a readable parquet file ({e})") from e
    names = parquet.schema_arrow.names
    if field not in names:
        raise InputError(f"{path}: no column {field!r} (columns: {', '.join(names)}; --field names the text column)")
    row = 0
    for batch in parquet.iter_batches(batch_size=_BATCH_ROWS, columns=[field]):
        column = batch.column(0).to_pylist()
        yield from _rows(path, column, field=field, first_row=row)
        row += len(column)


def _dataset_dir(path: Path, *, field: str, split: str) -> Iterator[Piece]:
    if not any((path / m).is_file() for m in _DATASET_MARKERS):
        raise InputError(f"{path}: a directory, but not one saved by datasets' save_to_disk (no "
                         f"{' / '.join(_DATASET_MARKERS)})")
    datasets = require("datasets", purpose=f"reading {path}")
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise InputError(f"{path}: no split {split!r} (splits: {', '.join(loaded)}; --split names one)")
        loaded = loaded[split]
    if field not in loaded.column_names:
        raise InputError(f"{path}: no column {field!r} (columns: {', '.join(loaded.column_names)}; --field names "
                         "the text column)")
    row = 0
    for batch in loaded.select_columns([field]).iter(batch_size=_BATCH_ROWS):
        column = batch[field]
        yield from _rows(path, column, field=field, first_row=row)
        row += len(column)

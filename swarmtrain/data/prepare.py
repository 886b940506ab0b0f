"""`swarmtrain data prepare`: inputs -> tokenized in parallel, streaming -> token shards with a manifest.

The main process reads documents in pieces (readers.py), groups them into batches of about
`batch_bytes` of text, and hands them to `workers` tokenizer processes; at most two batches a worker are
in flight, and results are written in input order as they come back, so memory is bounded by the
batches in flight whatever the input's size. Every `round(1 / val_fraction)`-th piece goes to the
validation split. Tokens are little-endian uint16 (a vocabulary of at most 65536) or uint32, in files of at
most `shard_tokens` tokens, each end of a document followed by the tokenizer's end-of-text token.

Everything is written into a hidden directory beside `out`, renamed to `out` only once the manifest is
in it: an interrupted or failed run never leaves a directory that looks complete (a failed one removes
its partial directory; a killed one leaves `.NAME.partial-PID`, which a later run ignores).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import xxhash

from swarmtrain.data.readers import InputError, Piece, iter_pieces
from swarmtrain.data.tokenizer import Tokenizer, TokenizerInfo, encode_arrays, load_tokenizer

__all__ = ["MANIFEST", "PrepareOptions", "PrepareResult", "prepare"]

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "swarmtrain-token-shards"
VERSION = 1

Batch = list[tuple[str, bool, bool]]  # (text, ends_document, validation)


@dataclass(frozen=True)
class PrepareOptions:
    inputs: tuple[str, ...]
    out: str
    tokenizer: str = "bytes"
    field: str = "text"
    split: str = "train"
    val_fraction: float = 0.01
    workers: int = 0  # 0 = one per CPU
    shard_tokens: int = 1 << 28
    piece_bytes: int = 1 << 16
    batch_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("data prepare: no inputs given")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"--val-fraction {self.val_fraction} is not in (0, 1)")
        if self.workers < 0 or self.shard_tokens < 1 or self.piece_bytes < 1 or self.batch_bytes < 1:
            raise ValueError("data prepare: --workers must be >= 0, sizes >= 1")


@dataclass(frozen=True)
class PrepareResult:
    manifest: dict[str, Any]
    seconds: float

    @property
    def tokens(self) -> int:
        return int(self.manifest["splits"]["train"]["tokens"] + self.manifest["splits"]["val"]["tokens"])


class _ShardWriter:
    """One split's shard files: appends token arrays, rolls over at `shard_tokens`, hashes as it writes."""

    def __init__(self, directory: Path, split: str, *, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.tokens = 0
        self._file: BinaryIO | None = None
        self._hash = xxhash.xxh3_64()
        self._in_file = 0

    def _open(self) -> BinaryIO:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file = (self.directory / name).open("wb")
        self.shards.append({"file": name, "tokens": 0, "xxh3_64": ""})
        self._hash, self._in_file = xxhash.xxh3_64(), 0
        return self._file

    def add(self, tokens: np.ndarray) -> None:
        data = tokens.astype(self.dtype.newbyteorder("<"), copy=False)
        while data.size:
            f = self._file or self._open()
            room = self.shard_tokens - self._in_file
            part, data = data[:room], data[room:]
            raw = part.tobytes()
            f.write(raw)
            self._hash.update(raw)
            self._in_file += part.size
            self.tokens += part.size
            if self._in_file == self.shard_tokens:
                self._close()

    def _close(self) -> None:
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        self.shards[-1].update(tokens=self._in_file, xxh3_64=self._hash.hexdigest())

    def finish(self) -> dict[str, Any]:
        self._close()
        return {"tokens": self.tokens, "shards": self.shards}


# ---------------------------------------------------------------- the tokenizer processes

_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(spec: str) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread a process: the processes are the parallelism
    _WORKER_TOKENIZER = load_tokenizer(spec)


def _encode(tokenizer: Tokenizer, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """(train tokens, validation tokens) of a batch of pieces, each document's end followed by EOS."""
    eos = np.array([tokenizer.info.eos_id], dtype=np.int64)
    ids = encode_arrays(tokenizer, [text for text, _, _ in batch])
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for arr, (_, ends, val) in zip(ids, batch, strict=True):
        parts[val].append(arr)
        if ends:
            parts[val].append(eos)
    empty = np.empty(0, dtype=np.int64)
    return (np.concatenate(parts[False]) if parts[False] else empty,
            np.concatenate(parts[True]) if parts[True] else empty)


def _encode_in_worker(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_TOKENIZER is not None
    return _encode(_WORKER_TOKENIZER, batch)


# ---------------------------------------------------------------- the main process


def _batches(pieces: Iterator[Piece], *, stride: int, batch_bytes: int, counts: dict[str, int]) -> Iterator[Batch]:
    batch: Batch = []
    size = 0
    for piece in pieces:
        counts["pieces"] += 1
        counts["documents"] += piece.ends_document
        batch.append((piece.text, piece.ends_document, counts["pieces"] % stride == 0))
        size += len(piece.text)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _dtype_for(info: TokenizerInfo) -> np.dtype:
    return np.dtype(np.uint16) if info.vocab_size <= 1 << 16 else np.dtype(np.uint32)


def prepare(opts: PrepareOptions) -> PrepareResult:
    """Tokenize `opts.inputs` into shards under `opts.out` (which must not exist yet)."""
    start = time.perf_counter()
    out = Path(opts.out)
    if out.exists():
        raise InputError(f"{out}: already exists (remove it, or prepare into another --out)")
    tokenizer = load_tokenizer(opts.tokenizer)
    info = tokenizer.info
    dtype = _dtype_for(info)
    stride = max(1, round(1 / opts.val_fraction))
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    partial.mkdir()
    try:
        writers = {split: _ShardWriter(partial, split, dtype=dtype, shard_tokens=opts.shard_tokens)
                   for split in ("train", "val")}
        counts = {"pieces": 0, "documents": 0}
        batches = _batches(iter_pieces(opts.inputs, field=opts.field, split=opts.split, piece_bytes=opts.piece_bytes),
                           stride=stride, batch_bytes=opts.batch_bytes, counts=counts)
        for train, val in _tokenized(batches, tokenizer=tokenizer, spec=opts.tokenizer, workers=opts.workers):
            writers["train"].add(train)
            writers["val"].add(val)
        splits = {name: w.finish() for name, w in writers.items()}
        if splits["val"]["tokens"] == 0 or splits["train"]["tokens"] == 0:
            raise InputError(f"{', '.join(opts.inputs)}: {counts['pieces']} pieces give no "
                             f"{'validation' if splits['train']['tokens'] else 'training'} tokens (every {stride}-th "
                             "piece is held out: raise --val-fraction, or add data)")
        manifest = {"format": FORMAT, "version": VERSION, "tokenizer": {**info.to_json(), "path": Path(info.path).name},
                    "dtype": dtype.name, "splits": splits, "documents": counts["documents"], "pieces": counts["pieces"],
                    "val_fraction": opts.val_fraction, "inputs": [str(Path(p)) for p in opts.inputs],
                    "field": opts.field}
        _write_manifest(partial / MANIFEST, manifest)
        os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    seconds = time.perf_counter() - start
    log.info("prepared %d tokens into %s in %.1fs", splits["train"]["tokens"] + splits["val"]["tokens"], out, seconds)
    return PrepareResult(manifest=manifest, seconds=seconds)


def _tokenized(batches: Iterator[Batch], *, tokenizer: Tokenizer, spec: str,
               workers: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each batch's (train, val) tokens, in order; `workers` > 1 tokenizes in that many processes."""
    n = workers or os.cpu_count() or 1
    if n == 1:
        for batch in batches:
            yield _encode(tokenizer, batch)
        return
    # fork: a spawned child would re-run the caller's main module; the tokenizer libraries reset their
    # thread pools in a forked child, and each worker loads its own tokenizer
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=n, mp_context=context, initializer=_init_worker, initargs=(spec,)) as pool:
        inflight: deque[Future[tuple[np.ndarray, np.ndarray]]] = deque()
        try:
            for batch in batches:
                inflight.append(pool.submit(_encode_in_worker, batch))
                if len(inflight) >= 2 * n:
                    yield inflight.popleft().result()
            while inflight:
                yield inflight.popleft().result()
        finally:
            for f in inflight:
                f.cancel()


def _write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())

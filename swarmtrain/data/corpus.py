"""Corpora as token streams: the embedded Python-stdlib corpus or the user's files, tokenized whole at start
(byte tokens by default), or prepared shards read from disk (shards.py)."""

from __future__ import annotations

import functools
import hashlib
import logging
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from swarmtrain.config import DataConfig
from swarmtrain.config_model import BYTES_TOKENIZER
from swarmtrain.data.shards import ShardError, ShardStream, TokenShards
from swarmtrain.data.tokenizer import encode_arrays, load_tokenizer

__all__ = ["Corpus", "CorpusError", "load_corpus", "stdlib_files"]

log = logging.getLogger(__name__)
VOCAB_SIZE = 256  # byte-level tokens


class CorpusError(ValueError):
    """A data file is missing or unreadable, or the corpus is too small to train on."""


@dataclass(frozen=True)
class Corpus:
    """Train and validation token streams: tensors (uint8 bytes, or int32 ids of a tokenizer), split by file,
    or a shard directory's streams."""

    train: torch.Tensor | ShardStream  # (N_train,)
    val: torch.Tensor | ShardStream  # (N_val,)
    num_files: int
    source: str


def stdlib_files() -> list[Path]:
    """The standard library's `.py` files, site-packages excluded, in a deterministic order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise CorpusError(f"{root}: the Python standard library directory was not found")
    excluded = {"site-packages", "dist-packages", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not excluded.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _is_val(name: str, val_fraction: float) -> bool:
    # Hash of the relative name, not position, so adding a file never moves others between splits.
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
    return (h % 10_000) < val_fraction * 10_000


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError as e:
        raise CorpusError(f"{path}: data file not found") from e
    except (IsADirectoryError, PermissionError, OSError) as e:
        raise CorpusError(f"{path}: cannot read data file ({e.strerror or e})") from e


def load_corpus(cfg: DataConfig) -> Corpus:
    """Load `cfg.shards`, or `cfg.paths` (or the stdlib corpus) split into train/validation by file.

    A single user file is split by position instead (its last `val_fraction` of bytes). With a tokenizer
    file, each file's tokens are followed by the end-of-text token; byte tokens are the files' bytes as
    they are.
    """
    if cfg.shards:
        return _open_shards(cfg.shards, cfg.tokenizer)
    if cfg.tokenizer != BYTES_TOKENIZER:
        return _load_tokenized(cfg.paths, cfg.val_fraction, cfg.max_corpus_bytes, cfg.tokenizer)
    return _load_cached(cfg.paths, cfg.val_fraction, cfg.max_corpus_bytes)


def _open_shards(directory: str, tokenizer: str) -> Corpus:
    shards = TokenShards.open(directory)
    own = load_tokenizer(tokenizer).info
    theirs = shards.manifest["tokenizer"]
    if theirs["hash"] != own.hash:
        shards.close()
        raise ShardError(f"{shards.directory / 'manifest.json'}: the shards were tokenized with another tokenizer "
                         f"({theirs.get('kind')} {theirs.get('path') or ''} sha256 {str(theirs['hash'])[:12]}) than "
                         f"data.tokenizer = {tokenizer!r} ({own.kind}, {own.hash[:12]})")
    for split, stream in (("train", shards.train), ("val", shards.val)):
        if stream.numel() < 2:
            raise CorpusError(f"{shards.directory}: the {split} split has {stream.numel()} tokens")
    log.info("shards %s: %d train / %d val tokens", directory, shards.train.numel(), shards.val.numel())
    return Corpus(train=shards.train, val=shards.val, num_files=len(shards.manifest["inputs"]),
                  source=f"shards {directory}")


@functools.lru_cache(maxsize=2)
def _load_tokenized(paths: tuple[str, ...], val_fraction: float, max_bytes: int, tokenizer: str) -> Corpus:
    tok = load_tokenizer(tokenizer)
    files, names, source = _inputs(paths)
    eos = np.array([tok.info.eos_id], dtype=np.int64)
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for name, data in _capped(files, names, max_bytes):
        (ids,) = encode_arrays(tok, [data.decode("utf-8", errors="replace")])
        parts[_is_val(name, val_fraction)] += [ids, eos]
    if len(files) == 1 or not parts[True] or not parts[False]:
        stream = np.concatenate(parts[False] + parts[True])
        cut = int(len(stream) * (1 - val_fraction))
        train, val = stream[:cut], stream[cut:]
    else:
        train, val = np.concatenate(parts[False]), np.concatenate(parts[True])
    if len(train) < 256 or len(val) < 64:
        raise CorpusError(f"{source}: corpus too small ({len(train)} train / {len(val)} validation tokens; "
                          "need >= 256 / 64)")
    log.info("corpus %s: %d files, %d train / %d val tokens (%s)", source, len(files), len(train), len(val), tokenizer)
    return Corpus(train=torch.from_numpy(train.astype(np.int32)), val=torch.from_numpy(val.astype(np.int32)),
                  num_files=len(files), source=source)


def _capped(files: list[Path], names: list[str], max_bytes: int) -> Iterator[tuple[str, bytes]]:
    """Each file's (split name, bytes), in order, until `max_bytes` in all (0: no cap; the last one cut)."""
    total = 0
    for path, name in zip(files, names, strict=True):
        data = _read(path)
        if max_bytes and total + len(data) > max_bytes:
            data = data[: max_bytes - total]
        total += len(data)
        yield name, data
        if max_bytes and total >= max_bytes:
            return


def _inputs(paths: tuple[str, ...]) -> tuple[list[Path], list[str], str]:
    """The files to read, the names their split is drawn by, and how to name the corpus."""
    if paths:
        files = [Path(p) for p in paths]
        return files, [str(p) for p in files], ", ".join(str(p) for p in files)
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    return files, [p.relative_to(root).as_posix() for p in files], f"python-stdlib ({root})"


@functools.lru_cache(maxsize=4)
def _load_cached(paths: tuple[str, ...], val_fraction: float, max_bytes: int) -> Corpus:
    files, names, source = _inputs(paths)
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    for name, data in _capped(files, names, max_bytes):
        (val_parts if _is_val(name, val_fraction) else train_parts).append(data)
    if len(files) == 1 or not val_parts or not train_parts:
        blob = b"".join(train_parts + val_parts)
        cut = int(len(blob) * (1 - val_fraction))
        train, val = blob[:cut], blob[cut:]
    else:
        train, val = b"".join(train_parts), b"".join(val_parts)
    if len(train) < 1024 or len(val) < 256:
        raise CorpusError(f"{source}: corpus too small ({len(train)} train / {len(val)} validation bytes; "
                          "need >= 1024 / 256)")
    log.info("corpus %s: %d files, %d train / %d val bytes", source, len(files), len(train), len(val))
    return Corpus(
        train=torch.frombuffer(bytearray(train), dtype=torch.uint8),
        val=torch.frombuffer(bytearray(val), dtype=torch.uint8),
        num_files=len(files),
        source=source,
    )

"""Corpora as byte-level token tensors: the embedded Python-stdlib corpus or the user's files."""

from __future__ import annotations

import functools
import hashlib
import logging
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from swarmtrain.config import DataConfig

__all__ = ["Corpus", "CorpusError", "load_corpus", "stdlib_files"]

log = logging.getLogger(__name__)
VOCAB_SIZE = 256  # byte-level tokens


class CorpusError(ValueError):
    """A data file is missing or unreadable, or the corpus is too small to train on."""


@dataclass(frozen=True)
class Corpus:
    """Train and validation token streams (uint8 bytes), split by file."""

    train: torch.Tensor  # (N_train,) uint8
    val: torch.Tensor  # (N_val,) uint8
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
    """Load `cfg.paths` (or the stdlib corpus) and split it into train/validation by file.

    A single user file is split by position instead (its last `val_fraction` of bytes).
    """
    return _load_cached(cfg.paths, cfg.val_fraction, cfg.max_corpus_bytes)


@functools.lru_cache(maxsize=4)
def _load_cached(paths: tuple[str, ...], val_fraction: float, max_bytes: int) -> Corpus:
    if paths:
        files = [Path(p) for p in paths]
        names = [str(p) for p in files]
        source = ", ".join(names)
    else:
        files = stdlib_files()
        root = Path(sysconfig.get_paths()["stdlib"])
        names = [p.relative_to(root).as_posix() for p in files]
        source = f"python-stdlib ({root})"
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    total = 0
    for path, name in zip(files, names, strict=True):
        data = _read(path)
        if max_bytes and total + len(data) > max_bytes:
            data = data[: max_bytes - total]
        total += len(data)
        (val_parts if _is_val(name, val_fraction) else train_parts).append(data)
        if max_bytes and total >= max_bytes:
            break
    if len(files) == 1 or not val_parts or not train_parts:
        blob = b"".join(train_parts + val_parts)
        cut = int(len(blob) * (1 - val_fraction))
        train, val = blob[:cut], blob[cut:]
    else:
        train, val = b"".join(train_parts), b"".join(val_parts)
    if len(train) < 1024 or len(val) < 256:
        raise CorpusError(f"{source}: corpus too small ({len(train)} train / {len(val)} validation bytes; need >= 1024 / 256)")
    log.info("corpus %s: %d files, %d train / %d val bytes", source, len(files), len(train), len(val))
    return Corpus(
        train=torch.frombuffer(bytearray(train), dtype=torch.uint8),
        val=torch.frombuffer(bytearray(val), dtype=torch.uint8),
        num_files=len(files),
        source=source,
    )

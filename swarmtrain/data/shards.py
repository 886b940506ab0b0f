"""Token shards on disk (`swarmtrain data prepare`'s output) read a window at a time.

Windows are read with positioned reads (`os.pread`) from the shard files, which stay open: the operating
system's page cache, not the process, holds what was read, so a peer's RSS does not grow with the
dataset or with how much of it it has read (a memory map would count every page it touched in the
RSS). Opening checks the manifest and every file's size; `verify()` also checks their hashes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from swarmtrain.data.prepare import FORMAT, MANIFEST, VERSION

__all__ = ["ShardError", "ShardStream", "TokenShards"]

_HASH_CHUNK = 8 << 20


class ShardError(ValueError):
    """A shard directory or manifest is missing, malformed or does not match its files; names the file."""


class ShardStream:
    """One split's shards as one stream of tokens: `numel()` and `windows(starts, length)`."""

    def __init__(self, paths: Sequence[Path], counts: Sequence[int], *, dtype: np.dtype) -> None:
        self.paths = list(paths)
        self.dtype = dtype
        self._counts = np.asarray(counts, dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(self._counts)]).astype(np.int64)
        self._fds = [os.open(p, os.O_RDONLY) for p in self.paths]

    def numel(self) -> int:
        return int(self._offsets[-1])

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def _read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream, across shard ends."""
        out = np.empty(length, dtype=self.dtype)
        at, item = 0, self.dtype.itemsize
        while at < length:
            pos = start + at
            shard = int(np.searchsorted(self._offsets, pos, side="right")) - 1
            take = min(length - at, int(self._offsets[shard + 1]) - pos)
            raw = os.pread(self._fds[shard], take * item, (pos - int(self._offsets[shard])) * item)
            if len(raw) != take * item:
                raise ShardError(f"{self.paths[shard]}: shorter than its manifest says (read {len(raw)} of "
                                 f"{take * item} bytes at token {pos - int(self._offsets[shard])})")
            out[at:at + take] = np.frombuffer(raw, dtype=self.dtype)
            at += take
        return out

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """(len(starts), length) int64 tokens, row i from token starts[i] on."""
        if len(starts) and (int(starts.min()) < 0 or int(starts.max()) + length > self.numel()):
            raise IndexError(f"a window of {length} tokens at {int(starts.max())} is outside the stream of "
                             f"{self.numel()} tokens")
        return np.stack([self._read(int(s), length) for s in starts]).astype(np.int64) if len(starts) \
            else np.empty((0, length), dtype=np.int64)


@dataclass
class TokenShards:
    """A prepared directory: its manifest, and its train and validation streams."""

    directory: Path
    manifest: dict[str, Any]
    train: ShardStream
    val: ShardStream

    @property
    def tokenizer_hash(self) -> str:
        return str(self.manifest["tokenizer"]["hash"])

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> TokenShards:
        root = Path(directory)
        path = root / MANIFEST
        if not path.is_file():
            raise ShardError(f"{root}: no {MANIFEST} (not a directory `swarmtrain data prepare` finished)")
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ShardError(f"{path}: not a readable manifest ({e})") from e
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise ShardError(f"{path}: not a swarmtrain shard manifest (format {FORMAT!r})")
        if manifest.get("version") != VERSION:
            raise ShardError(f"{path}: manifest version {manifest.get('version')!r}, this swarmtrain reads {VERSION}")
        try:
            dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
            streams = {split: cls._stream(root, manifest["splits"][split], dtype=dtype) for split in ("train", "val")}
            str(manifest["tokenizer"]["hash"])  # present, or the KeyError below names it
        except (KeyError, TypeError) as e:
            raise ShardError(f"{path}: malformed manifest (missing or wrong {e})") from e
        return cls(directory=root, manifest=manifest, train=streams["train"], val=streams["val"])

    @staticmethod
    def _stream(root: Path, split: dict[str, Any], *, dtype: np.dtype) -> ShardStream:
        paths, counts = [], []
        for shard in split["shards"]:
            p = root / shard["file"]
            n = int(shard["tokens"])
            if not p.is_file():
                raise ShardError(f"{p}: shard file missing (named by {root / MANIFEST})")
            if p.stat().st_size != n * dtype.itemsize:
                raise ShardError(f"{p}: {p.stat().st_size} bytes, the manifest says {n} tokens of {dtype.itemsize} "
                                 "bytes (a torn or replaced file)")
            paths.append(p)
            counts.append(n)
        return ShardStream(paths, counts, dtype=dtype)

    def verify(self) -> None:
        """Check every shard file's hash against the manifest (reads the whole dataset)."""
        for split in ("train", "val"):
            for shard in self.manifest["splits"][split]["shards"]:
                p = self.directory / shard["file"]
                h = xxhash.xxh3_64()
                with p.open("rb") as f:
                    while chunk := f.read(_HASH_CHUNK):
                        h.update(chunk)
                if h.hexdigest() != shard["xxh3_64"]:
                    raise ShardError(f"{p}: contents do not match the manifest's hash (corrupted or replaced)")

    def close(self) -> None:
        self.train.close()
        self.val.close()

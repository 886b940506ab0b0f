"""A round's *material*: the encoded shards of its mean, as the value a round chooses names them (one digest
per shard), held by the peers that can apply it; and the store that keeps it until nobody needs it.

A value names its session's mean by the digests of its shards (round/ballots.py `MaterialLayout`). Every
member of the session that fetched all of them holds the same bytes: each shard's encoded mean over the
agreed contributors, or with a gathering codec the bundle of all their contributions (a member inserts its
own, which its bundle leaves out). A voter accepts a value only while it holds that material, and with a
checkpoint directory only once the material is on disk (`MaterialStore.make_durable`): a chosen value is
then held by a quorum of voters, and can be applied after any crash by whoever learns it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swarmtrain.averaging.aggregate import mean_of_gathered, unpack_bundle
from swarmtrain.compress import Codec, CodecError
from swarmtrain.diloco.averager import MeanShard, ShardedMean
from swarmtrain.round.ballots import MaterialLayout, ShardDigest
from swarmtrain.trust.payloads import payload_digest

__all__ = ["Material", "MaterialError", "MaterialStore", "blob_digest", "check_shard", "layout_key", "layout_of",
           "sharded_mean"]

log = logging.getLogger(__name__)

Blob = bytes | bytearray | memoryview


class MaterialError(ValueError):
    """Material does not match the digests its value names, or cannot be stored; the message says which shard."""


def blob_digest(blob: Blob) -> str:
    """BLAKE3 of a shard's bytes (hex): every member digests the whole material, once per round (about 4x the
    speed of SHA-256 on one core). The payload digest a bulk transfer's MAC covers (trust/payloads.py), so a
    fetched mean's digest is the one its transfer took."""
    return payload_digest(blob).hex()


def layout_of(blobs: Sequence[Blob], bounds: Sequence[tuple[int, int]], *, numel: int, codec: str,
              gather: bool, digests: Sequence[str] = ()) -> MaterialLayout:
    """The layout (with a digest per shard) of freshly fetched material; `digests`, where given, are the blobs'
    (`blob_digest`), taken as they arrived."""
    if not digests:
        digests = [blob_digest(b) for b in blobs]
    return MaterialLayout(numel, codec, gather, tuple(ShardDigest(lo, hi, len(b), d)
                                                      for b, d, (lo, hi) in zip(blobs, digests, bounds, strict=True)))


def layout_key(layout: MaterialLayout) -> str:
    """One key for a layout's material (the digest of its shard digests; `MaterialLayout.key`)."""
    return layout.key


def check_blob(layout: MaterialLayout, shard: int, blob: Blob) -> None:
    want = layout.shards[shard]
    if len(blob) != want.size_bytes:
        raise MaterialError(f"shard {shard}: {len(blob)} bytes, the value names {want.size_bytes}")
    if blob_digest(blob) != want.digest:
        raise MaterialError(f"shard {shard}: its bytes do not hash to the digest the value names")


@dataclass
class Material:
    """The blobs of `layout`'s shards (None where not held yet)."""

    layout: MaterialLayout
    blobs: list[Blob | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.blobs:
            self.blobs = [None] * len(self.layout.shards)

    @property
    def complete(self) -> bool:
        return all(b is not None for b in self.blobs)

    def missing(self) -> list[int]:
        return [j for j, b in enumerate(self.blobs) if b is None]

    def put(self, shard: int, blob: Blob) -> None:
        check_blob(self.layout, shard, blob)
        self.blobs[shard] = blob


def check_shard(codec: Codec, layout: MaterialLayout, shard: int, blob: Blob) -> None:
    """CodecError unless shard `shard`'s blob decodes to finite values as `layout` says (a mean the codec checks
    from its payload; a bundle whose contributions are decoded and averaged into a scratch vector)."""
    s = layout.shards[shard]
    if layout.codec != codec.name:
        raise CodecError(f"material of codec {layout.codec!r}; this peer's codec is {codec.name!r}")
    if not layout.gather:
        codec.validate(blob, numel=s.hi - s.lo)
        return
    out = torch.empty(s.hi - s.lo, dtype=torch.float32, device=codec.device)
    mean_of_gathered(codec, unpack_bundle(blob, max_parts=1 << 16), out=out)
    if out.numel() and not bool(torch.isfinite(out).all()):
        raise CodecError(f"shard {shard} of the material averages to NaN or Inf")


def sharded_mean(material: Material, codec: Codec) -> ShardedMean:
    """The mean `material` stands for, decoded shard by shard when applied (never assembled whole). Its blobs
    were checked when they came in (a fetched mean by the codec, a fetched material shard by `check_shard`, this
    peer's own mean encoded from finite sums) and every one matches its digest, so reading them checks nothing
    again: a peer reads each mean two or three times a round."""
    if not material.complete:
        raise MaterialError(f"material misses shards {material.missing()}")
    layout = material.layout
    if codec.name != layout.codec:
        raise MaterialError(f"material of codec {layout.codec!r}; this peer's codec is {codec.name!r}")
    shards: list[MeanShard] = []
    for s, blob in zip(layout.shards, material.blobs, strict=True):
        assert blob is not None
        if layout.gather:
            parts = unpack_bundle(blob, max_parts=1 << 16)
            shards.append(MeanShard(s.lo, s.hi, functools.partial(_gathered_into, codec, parts)))
        else:
            shards.append(MeanShard(s.lo, s.hi, functools.partial(_decode_into, codec, blob),
                                    pieces=functools.partial(codec.decode_pieces, blob, numel=s.hi - s.lo,
                                                             checked=True)))
    return ShardedMean(layout.numel, tuple(shards), device=torch.device(codec.device), key=layout_key(layout))


def _decode_into(codec: Codec, blob: Blob, out: object) -> None:
    codec.decode_accumulate(blob, out.zero_())  # type: ignore[attr-defined]


def _gathered_into(codec: Codec, parts: list[memoryview], out: object) -> None:
    mean_of_gathered(codec, parts, out=out)  # type: ignore[arg-type]


class MaterialStore:
    """The material this peer holds, by layout key, for the rounds it may still be asked about.

    `spill_dir` (the checkpoint directory) makes it durable: `make_durable` writes a value's blobs there
    (fsynced) before its voter accepts it, and `reload` reads them back after a restart.

    Material is kept by the latest round that named it: two rounds can choose the same bytes (a part whose Δ
    did not change, a mean of zeros), and forgetting the older round must not drop what the newer one holds."""

    def __init__(self, *, spill_dir: str | os.PathLike[str] | None = None, scope: str = "") -> None:
        self.spill_dir = None if spill_dir is None else Path(spill_dir) / f"material-{scope or 'model'}"
        self._held: dict[str, tuple[int, Material]] = {}  # key -> (round, material)
        self._durable: dict[str, int] = {}  # key -> the round its directory on disk is named for
        self._writing = threading.Lock()  # voters accept concurrently, each from a worker thread

    def put(self, round_index: int, material: Material) -> str:
        key = layout_key(material.layout)
        held = self._held.get(key)
        if held is None:
            self._held[key] = (round_index, material)
        else:
            if round_index > held[0]:
                self._held[key] = (round_index, held[1])
            for j, blob in enumerate(material.blobs):
                if blob is not None and held[1].blobs[j] is None:
                    held[1].blobs[j] = blob
        return key

    def get(self, layout: MaterialLayout) -> Material | None:
        held = self._held.get(layout_key(layout))
        if held is not None:
            return held[1]
        return self._from_disk(layout)

    def holds(self, layout: MaterialLayout) -> bool:
        m = self.get(layout)
        return m is not None and m.complete

    def blob(self, layout: MaterialLayout, shard: int) -> Blob | None:
        m = self.get(layout)
        return None if m is None or not 0 <= shard < len(m.blobs) else m.blobs[shard]

    @property
    def durable(self) -> bool:
        return self.spill_dir is not None

    def make_durable(self, round_index: int, layout: MaterialLayout) -> None:
        """Write the (complete) material of `layout` to the spill directory, fsynced; no-op without one."""
        key = layout_key(layout)
        if self.spill_dir is None or self._durable.get(key, -1) >= round_index:
            return
        with self._writing:
            on_disk = self._durable.get(key)
            if on_disk is None:
                self._write(round_index, layout, key)
            elif on_disk < round_index:  # the same bytes, chosen again: the directory takes the newer round
                self._rename(on_disk, round_index, key)

    def _path(self, round_index: int, key: str) -> Path:
        assert self.spill_dir is not None
        return self.spill_dir / f"r{round_index:010d}-{key[:32]}"

    def _rename(self, old_round: int, round_index: int, key: str) -> None:
        assert self.spill_dir is not None
        try:
            os.replace(self._path(old_round, key), self._path(round_index, key))
            _fsync_dir(self.spill_dir)
        except OSError as e:
            raise MaterialError(f"{self._path(old_round, key)}: cannot store a round's material: {e}") from None
        self._durable[key] = round_index

    def _write(self, round_index: int, layout: MaterialLayout, key: str) -> None:
        assert self.spill_dir is not None
        m = self.get(layout)
        if m is None or not m.complete:
            raise MaterialError("cannot store incomplete material")
        path = self._path(round_index, key)
        try:
            path.mkdir(parents=True, exist_ok=True)
            for j, blob in enumerate(m.blobs):
                assert blob is not None
                tmp = path / f".{j}.tmp"
                with open(tmp, "wb") as f:
                    f.write(blob)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path / f"{j}")
            _fsync_dir(path)
            _fsync_dir(self.spill_dir)
        except OSError as e:
            raise MaterialError(f"{path}: cannot store a round's material: {e}") from None
        self._durable[key] = round_index

    def _from_disk(self, layout: MaterialLayout) -> Material | None:
        if self.spill_dir is None or not self.spill_dir.is_dir():
            return None
        key = layout_key(layout)
        found = sorted((p for p in self.spill_dir.glob(f"r*-{key[:32]}") if p.is_dir()), reverse=True)
        if not found:
            return None
        m = Material(layout)
        for j in range(len(layout.shards)):
            try:
                m.put(j, (found[0] / f"{j}").read_bytes())
            except (OSError, ValueError) as e:
                log.warning("%s: stored material unreadable (%s)", found[0], e)
                return None
        round_index = int(found[0].name[1:11])
        self._held[key] = (round_index, m)
        self._durable[key] = round_index
        return m

    def forget_before(self, round_index: int) -> None:
        """Drop the material of rounds < `round_index` (memory and disk)."""
        for key in [k for k, (r, _) in self._held.items() if r < round_index]:
            del self._held[key]
        self._durable = {k: r for k, r in self._durable.items() if r >= round_index}
        if self.spill_dir is None or not self.spill_dir.is_dir():
            return
        for path in self.spill_dir.glob("r*-*"):
            with contextlib.suppress(ValueError):
                if int(path.name[1:11]) < round_index:
                    for f in path.iterdir():
                        f.unlink(missing_ok=True)
                    with contextlib.suppress(OSError):
                        path.rmdir()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

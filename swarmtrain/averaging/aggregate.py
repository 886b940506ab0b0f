"""How a reducer combines its members' contributions to one shard: the mean, or a coordinate-wise trimmed
mean that one lying member cannot move far (pure torch: no I/O).

The trimmed mean (Yin et al., "Byzantine-robust distributed learning", 2018) drops, at every coordinate,
the `trim` largest and `trim` smallest of the n contributions and averages the rest: with at most `trim`
Byzantine members, every value left lies between two honest ones, whatever they sent. With n <= 2·trim
it trims as much as n allows ((n−1)//2 each side: the median for odd n; the mean for n <= 2).

Gathering (for sparse codecs, whose mean would need as many values as all contributions together): a
reducer serves the contributions themselves, packed in a bundle, instead of re-encoding their mean, and
every member computes the mean of the decoded contributions itself, in group order (`mean_of_gathered`):
bit for bit the same on every member, and nothing is lost to a second encoding. A member's own
contribution is left out of the bundle it is sent (it holds it already), so each contribution crosses
the network (K − 1) times in all, as in a direct all-gather.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarmtrain.compress.codec import Codec, CodecError
from swarmtrain.rpc.buffers import BufferPool

__all__ = ["AGGREGATORS", "Aggregation", "aggregate_encoded", "encoded_aggregate", "mean_of", "mean_of_encoded",
           "mean_of_gathered", "pack_bundle", "unpack_bundle"]

_BUNDLE_MAGIC = b"SWTB"
_BUNDLE_HEAD = struct.Struct("<4sI")
_BUNDLE_LEN = struct.Struct("<Q")

AGGREGATORS = ("mean", "trimmed_mean")
_CHUNK = 1 << 18  # coordinates sorted at once: bounds the sort's own memory to n × this
_NETWORK_MAX = 32  # contributions up to which a sorting network beats torch.sort


@dataclass(frozen=True)
class Aggregation:
    """`rule` is one of AGGREGATORS; `trim` the contributions dropped at each end of every coordinate."""

    rule: str = "mean"
    trim: int = 1
    gather: bool = False  # reducers serve the contributions (a bundle), members average them (module docstring)

    def __post_init__(self) -> None:
        if self.rule not in AGGREGATORS:
            raise ValueError(f"aggregator {self.rule!r} is not one of {AGGREGATORS}")
        if self.trim < 1:
            raise ValueError(f"trim must be >= 1, got {self.trim}")
        if self.gather and self.rule != "mean":
            raise ValueError(f"gathered contributions are averaged by their mean, not {self.rule!r}")

    def trimmed(self, num_parts: int) -> int:
        """How many are dropped at each end of every coordinate for `num_parts` contributions."""
        return 0 if self.rule == "mean" else min(self.trim, (num_parts - 1) // 2)


def mean_of(parts: list[torch.Tensor], *, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 sum in the given order, divided by the count: the reference every member can recompute.
    `out` (fp32, the parts' shape) is overwritten with the result instead of allocating it."""
    acc = torch.zeros_like(parts[0], dtype=torch.float32) if out is None else out.zero_()
    for p in parts:
        acc.add_(p)
    return acc.div_(len(parts))


def mean_of_encoded(codec: Codec, parts: Sequence[bytes | bytearray | memoryview], *,
                    out: torch.Tensor, checked: bool = False) -> torch.Tensor:
    """`mean_of` over the decoded `parts`, bit for bit, each part decoded and added straight into `out`
    (every codec's `decode_accumulate(part, acc)` equals `acc.add_(decode(part))` to the bit, pinned by
    tests): no decoded part is ever held. `out` (fp32, the shard's size) receives the mean. `checked`: every
    part passed `Codec.validate` already (a reducer's pushes), so none is hashed or scanned again."""
    out.zero_()
    for part in parts:
        codec.decode_accumulate(part, out, checked=checked)
    return out.div_(len(parts))


def mean_of_gathered(codec: Codec, parts: Sequence[bytes | bytearray | memoryview], *,
                     out: torch.Tensor) -> torch.Tensor:
    """The mean of the decoded `parts`, added into zeros in the given order and divided by their number:
    what every member of a gathering round computes for each shard. `out` (fp32) receives it."""
    if not parts:
        raise ValueError("mean_of_gathered: no contributions")
    out.zero_()
    for part in parts:
        codec.decode_accumulate(part, out)
    return out.div_(len(parts))


def pack_bundle(parts: Sequence[bytes | bytearray | memoryview]) -> bytes:
    """Contributions as one message: magic, count, each length, then each one's bytes."""
    head = _BUNDLE_HEAD.pack(_BUNDLE_MAGIC, len(parts))
    return b"".join([head, *(_BUNDLE_LEN.pack(memoryview(p).nbytes) for p in parts), *parts])


def unpack_bundle(data: bytes | bytearray | memoryview, *, max_parts: int) -> list[memoryview]:
    """The contributions of a bundle (views into `data`); CodecError when it is malformed."""
    mv = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
    if mv.nbytes < _BUNDLE_HEAD.size:
        raise CodecError(f"bundle: {mv.nbytes} bytes cannot hold its {_BUNDLE_HEAD.size}-byte head")
    magic, count = _BUNDLE_HEAD.unpack_from(mv)
    if magic != _BUNDLE_MAGIC:
        raise CodecError(f"bundle: bad magic {bytes(magic)!r} (expected {_BUNDLE_MAGIC!r})")
    if count > max_parts:
        raise CodecError(f"bundle: {count} contributions, at most {max_parts} expected")
    at = _BUNDLE_HEAD.size + count * _BUNDLE_LEN.size
    if mv.nbytes < at:
        raise CodecError(f"bundle: truncated: {mv.nbytes} bytes cannot hold {count} lengths")
    lengths = [_BUNDLE_LEN.unpack_from(mv, _BUNDLE_HEAD.size + i * _BUNDLE_LEN.size)[0] for i in range(count)]
    if at + sum(lengths) != mv.nbytes:
        raise CodecError(f"bundle: lengths add up to {at + sum(lengths)} bytes, the bundle has {mv.nbytes}")
    parts = []
    for n in lengths:
        parts.append(mv[at:at + n])
        at += n
    return parts


def aggregate_encoded(codec: Codec, parts: Sequence[bytes | bytearray | memoryview], rule: Aggregation, *,
                      out: torch.Tensor, checked: bool = False) -> torch.Tensor:
    """`rule` over the decoded `parts` into `out` (fp32, the shard's size). The mean streams into `out`;
    the trimmed mean holds every decoded part (n × the shard in fp32) and sorts it in chunks."""
    if not parts:
        raise ValueError("aggregate_encoded: no contributions")
    k = rule.trimmed(len(parts))
    if k == 0:
        return mean_of_encoded(codec, parts, out=out, checked=checked)
    decoded = torch.empty(len(parts), out.numel(), dtype=torch.float32, device=out.device)
    for row, part in zip(decoded, parts, strict=True):
        codec.decode_accumulate(part, row.zero_(), checked=checked)
    return trimmed_mean(decoded, k, out=out)


def trimmed_mean(stacked: torch.Tensor, k: int, *, out: torch.Tensor) -> torch.Tensor:
    """Per column of `stacked` (n, numel): the mean of the values left after dropping the k largest and
    k smallest, added in ascending order. The kept values are summed as they are (never as total −
    dropped, which an outlier of 1e30 would wipe out)."""
    n, numel = stacked.shape
    if not 0 <= 2 * k < n:
        raise ValueError(f"trimmed_mean: cannot drop {k} at each end of {n} values")
    flat = out.view(-1)
    for start in range(0, numel, _CHUNK):
        block, dest = stacked[:, start:start + _CHUNK], flat[start:start + _CHUNK]
        rows = _sorted_rows(block)
        dest.copy_(rows[k])
        for row in rows[k + 1:n - k]:
            dest.add_(row)
    return out.div_(n - 2 * k)


def _sorted_rows(block: torch.Tensor) -> list[torch.Tensor]:
    """The rows of `block` (n, m) sorted per column. Up to _NETWORK_MAX rows: an odd-even transposition
    network of elementwise min/max (n rounds of n/2 compare-exchanges, vectorized over the columns), about
    10× faster than torch.sort along dim 0 for a handful of rows; above it, torch.sort."""
    n = block.shape[0]
    if n > _NETWORK_MAX:
        return list(block.sort(dim=0).values)
    rows = [row.clone() for row in block]
    for round_index in range(n):
        for i in range(round_index % 2, n - 1, 2):
            rows[i], rows[i + 1] = torch.minimum(rows[i], rows[i + 1]), torch.maximum(rows[i], rows[i + 1])
    return rows


async def encoded_aggregate(codec: Codec, parts: Sequence[bytes | bytearray | memoryview], aggregation: Aggregation,
                            *, numel: int, buffers: BufferPool) -> memoryview:
    """`aggregate_encoded` into a pooled fp32 accumulator, in a thread, encoded once (a reducer's mean, framed
    into lent pooled memory), of `parts` that each passed `Codec.validate` (pushes, as a reducer takes them). A
    cancelled wait keeps the accumulator from the pool: its thread may still write into it. A codec on a GPU (a
    GPU-resident round) sums into a vector there instead, and only the encoded mean comes back to the host."""
    if codec.device.type != "cpu":
        return await asyncio.to_thread(lambda: codec.encode(aggregate_encoded(
            codec, parts, aggregation, out=torch.empty(numel, dtype=torch.float32, device=codec.device),
            checked=True), into=buffers.lent))
    view = buffers.take(4 * numel)
    acc = [torch.frombuffer(view, dtype=torch.float32) if numel else torch.empty(0)]  # cleared before the give
    finished = False
    try:
        data = await asyncio.to_thread(lambda: codec.encode(aggregate_encoded(codec, parts, aggregation, out=acc[0],
                                                                                     checked=True), into=buffers.lent))
        finished = True
    finally:
        acc.clear()
        if finished:
            buffers.give(view)
    return data

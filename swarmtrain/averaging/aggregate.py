"""How a reducer combines its members' contributions to one shard: the mean, or a coordinate-wise trimmed
mean that one lying member cannot move far (pure torch: no I/O).

The trimmed mean (Yin et al., "Byzantine-robust distributed learning", 2018) drops, at every coordinate,
the `trim` largest and `trim` smallest of the n contributions and averages the rest: with at most `trim`
Byzantine members, every value left lies between two honest ones, whatever they sent. With n <= 2·trim
it trims as much as n allows ((n−1)//2 each side: the median for odd n; the mean for n <= 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarmtrain.compress.codec import Codec

__all__ = ["AGGREGATORS", "Aggregation", "aggregate_encoded", "mean_of", "mean_of_encoded"]

AGGREGATORS = ("mean", "trimmed_mean")
_CHUNK = 1 << 18  # coordinates sorted at once: bounds the sort's own memory to n × this
_NETWORK_MAX = 32  # contributions up to which a sorting network beats torch.sort


@dataclass(frozen=True)
class Aggregation:
    """`rule` is one of AGGREGATORS; `trim` the contributions dropped at each end of every coordinate."""

    rule: str = "mean"
    trim: int = 1

    def __post_init__(self) -> None:
        if self.rule not in AGGREGATORS:
            raise ValueError(f"aggregator {self.rule!r} is not one of {AGGREGATORS}")
        if self.trim < 1:
            raise ValueError(f"trim must be >= 1, got {self.trim}")

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


def mean_of_encoded(codec: Codec, parts: Sequence[bytes | bytearray | memoryview], *, out: torch.Tensor,
                    scratch: torch.Tensor) -> torch.Tensor:
    """`mean_of` over the decoded `parts`, bit for bit, decoding one at a time into `scratch` (fp32,
    the shard's size) instead of holding every decoded part; `out` receives the mean."""
    out.zero_()
    for part in parts:
        codec.decode_accumulate(part, scratch.zero_())  # == decode(part): see reducer._own_checked
        out.add_(scratch)
    return out.div_(len(parts))


def aggregate_encoded(codec: Codec, parts: Sequence[bytes | bytearray | memoryview], rule: Aggregation, *,
                      out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """`rule` over the decoded `parts` into `out` (fp32, the shard's size). The mean streams through
    `scratch`; the trimmed mean holds every decoded part (n × the shard in fp32) and sorts it in chunks."""
    if not parts:
        raise ValueError("aggregate_encoded: no contributions")
    k = rule.trimmed(len(parts))
    if k == 0:
        return mean_of_encoded(codec, parts, out=out, scratch=scratch)
    decoded = torch.empty(len(parts), out.numel(), dtype=torch.float32, device=out.device)
    for row, part in zip(decoded, parts, strict=True):
        codec.decode_accumulate(part, row.zero_())
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

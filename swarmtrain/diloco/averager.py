"""The Averager protocol: how the DiLoCo loop asks the swarm for the mean pseudo-gradient."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, overload

import torch

from swarmtrain.round.certificate import Certificate

_CPU = torch.device("cpu")

__all__ = ["AverageResult", "Averager", "Delta", "DeltaSource", "MeanShard", "Previews", "ShardedMean", "mean_tensor",
           "reader"]


@dataclass(frozen=True)
class MeanShard:
    """Values [lo, hi) of a round's mean, kept as the reducer sent them; `decode(out)` writes them into
    `out` (hi − lo fp32 values, any prior contents) and is deterministic: every call writes the same bits.
    `pieces()`, where given, yields the same values as (offset in the shard, values) pieces of a few MB
    (`Codec.decode_pieces`), so that applying the shard never holds it whole in fp32."""

    lo: int
    hi: int
    decode: Callable[[torch.Tensor], None]
    pieces: Callable[[], Iterator[tuple[int, torch.Tensor]]] | None = None


@dataclass(frozen=True)
class ShardedMean:
    """A committed round's mean held shard by shard in its encoded form, decoded when it is applied.

    The network all-reduce returns this instead of an assembled fp32 vector: with int8 the shards
    take a quarter of the model's fp32 size, and `pieces()` decodes a few MB at a time (a shard at a
    time into one scratch vector of the largest shard, where a shard cannot be decoded in pieces), so
    applying the mean never needs a model-sized vector. The all-reduce checked before its vote that
    every shard decodes to finite values.
    """

    numel: int
    shards: tuple[MeanShard, ...]
    device: torch.device = _CPU  # where its shards decode (the codec's device)
    # Names the values: equal keys, equal means (the material's layout key, a digest of its shards' digests);
    # "" = unnamed. A worker previews a named mean once per state (a voter is asked about one value many times).
    key: str = ""

    def __post_init__(self) -> None:
        at = 0
        for s in self.shards:
            if s.lo != at or s.hi < s.lo:
                raise ValueError(f"ShardedMean: shard [{s.lo}, {s.hi}) does not follow value {at}")
            at = s.hi
        if at != self.numel:
            raise ValueError(f"ShardedMean: the shards cover {at} values, not {self.numel}")

    def pieces(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(offset, values) pieces covering the mean in order; the values live in a scratch vector that
        the next piece overwrites, so a caller uses each before asking for the next."""
        whole = [s.hi - s.lo for s in self.shards if s.pieces is None]
        scratch = torch.empty(max(whole, default=0), dtype=torch.float32, device=self.device)
        for s in self.shards:
            if s.pieces is not None:
                for at, values in s.pieces():
                    yield s.lo + at, values
                continue
            out = scratch[:s.hi - s.lo]
            s.decode(out)
            yield s.lo, out

    def tensor(self) -> torch.Tensor:
        """The whole mean as a new flat fp32 vector on its device (a model-sized allocation)."""
        out = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        for s in self.shards:
            s.decode(out[s.lo:s.hi])
        return out


class Previews:
    """The digests of θ_global and the momentum after the outer step with a named mean (`ShardedMean.key`),
    remembered for one state: a voter asked about one value many times (by each proposer, at each attempt)
    pays for one outer step. `state` names the state the step starts from (e.g. its version and round); a new
    state forgets the old one's previews. An unnamed mean is previewed every time."""

    def __init__(self, *, keep: int = 8) -> None:
        self.keep = keep
        self._state: object = None
        self._known: dict[str, tuple[bytes, bytes | None]] = {}

    def __len__(self) -> int:
        return len(self._known)

    def get(self, state: object, mean: torch.Tensor | ShardedMean,
            compute: Callable[[], tuple[bytes, bytes | None]]) -> tuple[bytes, bytes | None]:
        key = mean.key if isinstance(mean, ShardedMean) else ""
        if not key:
            return compute()
        if state != self._state or (len(self._known) >= self.keep and key not in self._known):
            self._state, self._known = state, {}
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = compute()
        return known


@overload
def mean_tensor(mean: torch.Tensor | ShardedMean) -> torch.Tensor: ...
@overload
def mean_tensor(mean: torch.Tensor | ShardedMean | None) -> torch.Tensor | None: ...
def mean_tensor(mean: torch.Tensor | ShardedMean | None) -> torch.Tensor | None:
    """`mean` as a flat fp32 tensor (decoding a ShardedMean whole), None stays None."""
    return mean.tensor() if isinstance(mean, ShardedMean) else mean


@dataclass(frozen=True)
class AverageResult:
    """The outcome of one round's averaging, identical on every member of the round's group.

    `mean` is the fp32 mean of the members' pseudo-gradients (flat, like the input) when the
    round committed, else None: a caller never applies an outer step on an aborted round. The
    network all-reduce gives it as a ShardedMean (decoded shard by shard when applied); `mean_tensor()`
    gives it whole.
    """

    round: int
    committed: bool
    mean: torch.Tensor | ShardedMean | None
    members: tuple[str, ...] = ()
    bytes_sent: int = 0
    bytes_received: int = 0
    reason: str = ""  # why the round aborted, or who failed and was worked around
    failed: tuple[str, ...] = field(default=())
    retry_at: float = 0.0  # swarm clock: do not average this round again before then (0 = any time)
    # The inner-step rate each of `members` announced for the Δ it sent (same order; 0 = unknown):
    # with `diloco.pace` "time" every member sizes its next round from these (see diloco/pace.py).
    steps_per_s: tuple[float, ...] = ()
    # How long each of `members`' last committed round's mean took after its Δ (same order; 0 = unknown):
    # with `diloco.pace_align` a member lines its next span up with the group's median (diloco/pace.py).
    lags_s: tuple[float, ...] = ()
    # Set when this peer was left out because the round's group averages from another θ_global: the
    # hash that group announced, which this peer must heal to (its own θ_global went astray).
    heal_to_hash: str = ""
    # A commit's proof (round/certificate.py): its value names the next round's voters.
    certificate: Certificate | None = None
    # Not committed here, but the round is decided (this certificate); its material was not to be had.
    known: Certificate | None = None

    def mean_tensor(self) -> torch.Tensor | None:
        """The mean as one flat fp32 tensor (None when the round did not commit)."""
        return mean_tensor(self.mean)


class DeltaSource(Protocol):
    """A flat fp32 Δ read a slice at a time (diloco.flat.PseudoGradient) instead of held whole."""

    def numel(self) -> int: ...

    def read(self, lo: int, hi: int) -> torch.Tensor:
        """Values [lo, hi) as a flat fp32 tensor (on the round's device)."""
        ...


Delta = torch.Tensor | DeltaSource


def reader(delta: Delta) -> Callable[[int, int], torch.Tensor]:
    """`read(lo, hi)` of a Δ given as a flat fp32 tensor or a DeltaSource."""
    if isinstance(delta, torch.Tensor):
        if delta.dim() != 1 or delta.dtype != torch.float32:
            raise ValueError(f"delta must be a flat float32 tensor, got {delta.dtype} {tuple(delta.shape)}")
        flat = delta.detach().contiguous()  # where it is: the codec moves each piece to its own device
        return lambda lo, hi: flat[lo:hi]
    return delta.read


class Averager(Protocol):
    """Averages one flat fp32 pseudo-gradient per peer per round (blocking, with deadlines)."""

    def average(self, round_index: int, delta: torch.Tensor) -> AverageResult: ...

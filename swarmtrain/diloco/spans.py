"""What one round syncs of θ: all of it (classic DiLoCo) or one fragment (streaming DiLoCo, diloco.fragments > 1).

A `Span` does the round's arithmetic on its part of θ, so that the worker runs one path for both: Δ of the span,
the part of the error-feedback residual that goes with it, the eager estimate of an overlapped round, the outer
step on the averaged Δ, θ_local's values once the round is over, and the digest a commit would leave. `Whole`
works on θ in place and in slices (no model-sized copy beyond Δ itself; a sharded mean is decoded piece by
piece); `Fragment` gathers its ranges into vectors of the fragment's size and scatters them back. Either
keeps every value's arithmetic the same single fp32 operation, so a fragment's round and the whole's agree bit
for bit on the values they share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import blake3
import torch

from swarmtrain.compress.staging import hash_into
from swarmtrain.diloco.averager import ShardedMean, mean_tensor
from swarmtrain.diloco.flat import PseudoGradient, flatten, pseudo_gradient
from swarmtrain.diloco.fragments import Ranges, gather, scatter_
from swarmtrain.diloco.outer import OuterOptimizer

__all__ = ["Fragment", "Span", "Whole"]

Mean = torch.Tensor | ShardedMean


class Span(Protocol):
    """One round's part of θ (see the module docstring). `params` are θ_local's parameters that hold it."""

    size: int
    params: Sequence[torch.Tensor]

    def delta(self, theta: torch.Tensor) -> torch.Tensor:
        """Δ = θ_global − θ_local over the span, a new vector of `size` values on θ_global's device."""
        ...

    def local(self, device: torch.device) -> torch.Tensor:
        """θ_local's values over the span, a new vector on `device`."""
        ...

    def part(self, flat: torch.Tensor) -> torch.Tensor:
        """A model-sized vector's values over the span (θ_global's, the residual's): itself, or a gathered copy."""
        ...

    def adopt(self, flat: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """A model-sized vector that is `flat` with the span's values replaced by `values` (as `part` gives them):
        `values` itself for the whole of θ, else `flat` written in place."""
        ...

    def estimate(self, outer: OuterOptimizer, theta: torch.Tensor, guess: torch.Tensor) -> torch.Tensor:
        """θ_global over the span after the outer step on `guess`, as a new vector; nothing changes."""
        ...

    def step(self, outer: OuterOptimizer, theta: torch.Tensor, mean: Mean) -> None:
        """The outer step on the span of θ_global and of the momentum, with the averaged Δ `mean`."""
        ...

    def preview(self, outer: OuterOptimizer, theta: torch.Tensor, mean: Mean) -> tuple[bytes, bytes | None]:
        """The BLAKE3 digests of the whole θ_global and momentum as `step` would leave them; nothing changes."""
        ...


class Whole:
    """All of θ, in place: Δ read in slices, a sharded mean decoded piece by piece, nothing model-sized copied."""

    def __init__(self, params: Sequence[torch.Tensor], numel: int) -> None:
        self.params: Sequence[torch.Tensor] = list(params)
        self.size = numel

    def delta(self, theta: torch.Tensor) -> torch.Tensor:
        return pseudo_gradient(theta, self.params)

    def source(self, theta: torch.Tensor, version: Callable[[], object]) -> PseudoGradient:
        """Δ read a slice at a time while `version()` stays what it is now."""
        return PseudoGradient(theta, self.params, version=version)

    def local(self, device: torch.device) -> torch.Tensor:
        return flatten(self.params, device=device)

    def part(self, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def adopt(self, flat: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return values

    def estimate(self, outer: OuterOptimizer, theta: torch.Tensor, guess: torch.Tensor) -> torch.Tensor:
        return outer.preview(theta, guess)

    def step(self, outer: OuterOptimizer, theta: torch.Tensor, mean: Mean) -> None:
        if isinstance(mean, ShardedMean):  # decoded shard by shard, never whole
            outer.step_pieces(theta, mean.pieces)
        else:
            outer.step(theta, mean.reshape(-1))

    def preview(self, outer: OuterOptimizer, theta: torch.Tensor, mean: Mean) -> tuple[bytes, bytes | None]:
        pieces = mean.pieces if isinstance(mean, ShardedMean) else (lambda: iter([(0, mean.reshape(-1))]))
        return outer.preview_pieces(theta, pieces)


class Fragment:
    """One fragment's ranges of θ, gathered into vectors of the fragment's size (its parameters alone are read)."""

    def __init__(self, ranges: Ranges, params: Sequence[torch.Tensor]) -> None:
        self.ranges = ranges
        self.params: Sequence[torch.Tensor] = list(params)
        self.size = sum(hi - lo for lo, hi in ranges)

    def delta(self, theta: torch.Tensor) -> torch.Tensor:
        return gather(theta, self.ranges).sub_(flatten(self.params, device=theta.device))

    def local(self, device: torch.device) -> torch.Tensor:
        return flatten(self.params, device=device)

    def part(self, flat: torch.Tensor) -> torch.Tensor:
        return gather(flat, self.ranges)

    def adopt(self, flat: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        scatter_(flat, self.ranges, values)
        return flat

    def _outer(self, outer: OuterOptimizer) -> OuterOptimizer:
        """An outer optimizer over the fragment whose momentum buffer is a gathered copy of the fragment's."""
        mine = OuterOptimizer(outer.cfg, numel=self.size, device=outer.device)
        if outer.momentum_buffer is not None:
            mine.momentum_buffer = gather(outer.momentum_buffer, self.ranges)
        return mine

    def estimate(self, outer: OuterOptimizer, theta: torch.Tensor, guess: torch.Tensor) -> torch.Tensor:
        return self._outer(outer).preview(gather(theta, self.ranges), guess)

    def step(self, outer: OuterOptimizer, theta: torch.Tensor, mean: Mean) -> None:
        mine = self._outer(outer)
        values = gather(theta, self.ranges)
        mine.step(values, mean_tensor(mean).reshape(-1))
        scatter_(theta, self.ranges, values)
        if mine.momentum_buffer is not None:
            assert outer.momentum_buffer is not None
            scatter_(outer.momentum_buffer, self.ranges, mine.momentum_buffer)

    def preview(self, outer: OuterOptimizer, theta: torch.Tensor, mean: Mean) -> tuple[bytes, bytes | None]:
        mine = self._outer(outer)
        values = gather(theta, self.ranges)
        mine.step(values, mean_tensor(mean).reshape(-1))
        buf = outer.momentum_buffer
        momentum = None if buf is None or mine.momentum_buffer is None else \
            _digest_replaced(buf, self.ranges, mine.momentum_buffer)
        return _digest_replaced(theta, self.ranges, values), momentum


def _digest_replaced(flat: torch.Tensor, ranges: Ranges, values: torch.Tensor) -> bytes:
    """`tensor_digest` of `flat` with its `ranges` replaced by `values` (their concatenation), streamed: what a
    fragment's outer step leaves, without a model-sized copy."""
    h = blake3.blake3()
    at = taken = 0
    parts: list[torch.Tensor] = []
    for lo, hi in sorted(ranges):
        if lo > at:
            parts.append(flat[at:lo])
        parts.append(values[taken:taken + hi - lo])
        taken, at = taken + hi - lo, hi
    if at < flat.numel():
        parts.append(flat[at:])
    for part in parts:
        hash_into(h, part)
    return h.digest()


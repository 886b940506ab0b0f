"""The Averager protocol: how the DiLoCo loop asks the swarm for the mean pseudo-gradient."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = ["AverageResult", "Averager"]


@dataclass(frozen=True)
class AverageResult:
    """The outcome of one round's averaging, identical on every member of the round's group.

    `mean` is the fp32 mean of the members' pseudo-gradients (flat, like the input) when the
    round committed, else None: a caller never applies an outer step on an aborted round.
    """

    round: int
    committed: bool
    mean: torch.Tensor | None
    members: tuple[str, ...] = ()
    bytes_sent: int = 0
    bytes_received: int = 0
    reason: str = ""  # why the round aborted, or who failed and was worked around
    failed: tuple[str, ...] = field(default=())
    retry_at: float = 0.0  # swarm clock: do not average this round again before then (0 = any time)
    # The inner-step rate each of `members` announced for the Δ it sent (same order; 0 = unknown):
    # with `diloco.pace` "time" every member sizes its next round from these (see diloco/pace.py).
    steps_per_s: tuple[float, ...] = ()
    # Set when this peer was left out because the round's group averages from another θ_global: the
    # hash that group announced, which this peer must heal to (its own θ_global went astray).
    heal_to_hash: str = ""


class Averager(Protocol):
    """Averages one flat fp32 pseudo-gradient per peer per round (blocking, with deadlines)."""

    def average(self, round_index: int, delta: torch.Tensor) -> AverageResult: ...

"""The eager estimate's scale: how much of a peer's own contribution to expect in the swarm's mean.

An overlapped peer (`diloco.overlap`) starts its next inner steps from the outer step applied to a
guess of the round's mean, before the mean lands. The guess is λ × the peer's own contribution c (Δ
as the wire carried it). `EagerScale` fits λ by least squares from the rounds this peer already saw
commit: λ = Σ ρᵃ ⟨c, m⟩ / Σ ρᵃ ⟨c, c⟩ over past rounds (m the committed mean, a the round's age),
the scalar that brought c closest to m lately. Dense Δs of peers that trained from the same θ agree
only in part (for K peers whose Δs have cosine similarity s, the expected λ is s + (1 − s) / K),
and a gathered sparse mean holds the other members' values at positions this peer did not pick: in
both cases λ = 1 overshoots and 1 / K undershoots.

λ only moves θ_local during the lag: θ_global and the commit rule never see it, and a wrong λ costs
no more than the steps taken before the mean lands. It is clamped to [0, 1].
"""

from __future__ import annotations

import math
from typing import Any

import torch

from swarmtrain.diloco.averager import ShardedMean

__all__ = ["DECAY", "EagerScale", "dot", "dot_with_mean"]

DECAY = 0.8  # ρ: a round's weight in the fit falls to a tenth after about ten rounds
_SLICE = 1 << 16  # values per fp32 product; the slices' products add up in float64


class EagerScale:
    """λ for `DilocoWorker.eager_scale`, fitted from this peer's committed overlapped rounds."""

    def __init__(self) -> None:
        self.cm = 0.0  # Σ ρᵃ ⟨c, m⟩
        self.cc = 0.0  # Σ ρᵃ ⟨c, c⟩

    def value(self, default: float) -> float:
        """The fitted λ, clamped to [0, 1]; `default` until a round with c ≠ 0 has been observed."""
        if self.cc <= 0.0:
            return default
        return min(1.0, max(0.0, self.cm / self.cc))

    def observe(self, sent: torch.Tensor, cm: float) -> None:
        """Add a committed round: `sent` is c (this peer's contribution), `cm` = ⟨c, m⟩ with the mean.

        A round whose products are not finite is skipped, so one bad round cannot end the fit.
        """
        cc = dot(sent, sent)
        if not (math.isfinite(cc) and math.isfinite(cm)):
            return
        self.cm = DECAY * self.cm + cm
        self.cc = DECAY * self.cc + cc

    def state(self) -> dict[str, float]:
        """The fit, JSON-able (a checkpoint's metadata)."""
        return {"cm": self.cm, "cc": self.cc}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore `state()`; raises ValueError naming a missing, non-numeric or non-finite field."""
        values = {}
        for key in ("cm", "cc"):
            value = state.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"eager scale state: {key!r} is {value!r}, need a finite number")
            values[key] = float(value)
        if values["cc"] < 0:
            raise ValueError(f"eager scale state: 'cc' is {values['cc']}, a sum of squares cannot be negative")
        self.cm, self.cc = values["cm"], values["cc"]


def dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """⟨a, b⟩ of two flat fp32 vectors: fp32 products of slices, added up in float64.

    It runs between two inner steps, so it must be cheap: converting to float64 first made it 15×
    slower, and λ needs nowhere near float64's precision.
    """
    total = 0.0
    for lo in range(0, a.numel(), _SLICE):
        total += float(torch.dot(a[lo:lo + _SLICE], b[lo:lo + _SLICE]))
    return total


def dot_with_mean(sent: torch.Tensor, mean: torch.Tensor | ShardedMean) -> float:
    """⟨c, m⟩ as `dot` gives it, `mean` a flat tensor or a `ShardedMean` (decoded piece by piece)."""
    if isinstance(mean, torch.Tensor):
        return dot(sent, mean.reshape(-1))
    total = 0.0
    for at, values in mean.pieces():
        total += dot(sent[at:at + values.numel()], values)
    return total

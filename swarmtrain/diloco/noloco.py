"""NoLoCo's outer step (Kolehmainen et al., 2025): a peer's slow weights φ move by its group's mean Δ and
towards its group's mean φ, with momentum; no shared θ_global, no collective.

With this project's sign of the pseudo-gradient (Δ = φ − θ_local, as DiLoCo's), for peer i of group G:

    u = mean_G(Δ) + (φ_i − mean_G(φ))        b ← β·b + u        φ_i ← φ_i − α·b        θ_local ← φ_i

which is the paper's m ← β·m + α·mean_G(θ_local − φ) + α·(mean_G(φ) − φ_i), φ_i ← φ_i + m with m = −α·b.
(u is φ_i − mean_G(θ_local): the group's mean fast weights pull the slow ones.) The buffer b is a flat fp32
tensor kept as DiLoCo's outer momentum is (checkpoints and state transfer carry it as "momentum").

`group_mean` forms the two means from what partners sent, dropping a partner whose values are not finite
or do not fit, and bounding each partner's part (`clip`) by the norm of the peer's own Δ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from swarmtrain.diloco.outer import STEP_SLICE, count_non_finite

__all__ = ["GroupMean", "NolocoOuter", "group_mean"]


class NolocoOuter:
    """The NoLoCo step on one flat fp32 φ with the momentum buffer `buffer` (changed in place)."""

    def __init__(self, *, lr: float, momentum: float, buffer: torch.Tensor) -> None:
        if buffer.dim() != 1 or buffer.dtype != torch.float32:
            raise ValueError(f"NoLoCo momentum must be a flat fp32 tensor, got {buffer.dtype} {tuple(buffer.shape)}")
        self.lr, self.momentum, self.buffer = lr, momentum, buffer

    def step(self, phi: torch.Tensor, mean_delta: torch.Tensor, mean_phi: torch.Tensor) -> None:
        """φ and the buffer after one outer step; neither changes if a mean holds NaN or Inf."""
        n = self.buffer.numel()
        for name, t in (("φ", phi), ("the mean Δ", mean_delta), ("the mean φ", mean_phi)):
            if t.shape != (n,):
                raise ValueError(f"NoLoCo step: {name} has shape {tuple(t.shape)}, not ({n},)")
        if count_non_finite(mean_delta) or count_non_finite(mean_phi):
            raise ValueError("NoLoCo step: the group's mean Δ or φ contains NaN/Inf")
        for lo in range(0, n, STEP_SLICE):  # slices: temporaries of one slice, not of the model's size
            hi = min(n, lo + STEP_SLICE)
            p, b = phi[lo:hi], self.buffer[lo:hi]
            # the pull first: φ_i − mean(φ) is a small difference, exact when the group agrees
            u = (p - mean_phi[lo:hi].to(torch.float32)).add_(mean_delta[lo:hi].to(torch.float32))
            b.mul_(self.momentum).add_(u)
            p.sub_(b.mul(self.lr))  # separately rounded, as the DiLoCo outer step (diloco/outer.py)


@dataclass
class GroupMean:
    """The group's means as one peer forms them, and what it did with each partner's part."""

    delta: torch.Tensor
    phi: torch.Tensor
    used: list[str] = field(default_factory=list)  # partners whose parts are in the means
    dropped: dict[str, str] = field(default_factory=dict)  # partner -> why its part was left out
    clipped: list[str] = field(default_factory=list)  # partners whose Δ or pull was scaled down
    spread: float | None = None  # mean over used partners of ‖φ_partner − φ_own‖ / ‖φ_own‖


def group_mean(own_delta: torch.Tensor, own_phi: torch.Tensor, parts: Sequence[tuple[str, torch.Tensor, torch.Tensor]],
               *, clip: float) -> GroupMean:
    """mean_G(Δ) and mean_G(φ) over this peer (exact values) and its partners' (name, Δ, φ) as received.

    A partner's part is left out when either tensor has the wrong size or holds NaN/Inf. With `clip` > 0,
    its Δ and its pull φ_partner − φ_own are each scaled to a norm of at most clip·‖Δ_own‖, so that no
    partner moves this peer's φ by more than α·clip·‖Δ_own‖/|G| in one round, whatever it sends."""
    n = own_phi.numel()
    own_delta, own_phi = own_delta.reshape(-1).to(torch.float32), own_phi.reshape(-1).to(torch.float32)
    bound = clip * float(own_delta.norm()) if clip > 0 else 0.0
    out = GroupMean(delta=own_delta.clone(), phi=torch.zeros(n, device=own_phi.device))
    pull = out.phi  # Σ (φ_partner − φ_own), then the mean pull; φ's mean is φ_own plus it
    spreads = []
    own_norm = float(own_phi.norm())
    for name, delta, phi in parts:
        delta = delta.reshape(-1).to(device=own_phi.device, dtype=torch.float32, copy=True)
        phi = phi.reshape(-1).to(device=own_phi.device, dtype=torch.float32)
        if delta.numel() != n or phi.numel() != n:
            out.dropped[name] = f"sent {delta.numel()} and {phi.numel()} values, not {n}"
            continue
        if count_non_finite(delta) or count_non_finite(phi):
            out.dropped[name] = "sent NaN or Inf"
            continue
        diff = phi - own_phi
        spreads.append(float(diff.norm()) / max(own_norm, 1e-12))
        if bound > 0:
            scaled = False
            for t in (delta, diff):
                norm = float(t.norm())
                if norm > bound:
                    t.mul_(bound / norm)
                    scaled = True
            if scaled:
                out.clipped.append(name)
        out.delta.add_(delta)
        pull.add_(diff)
        out.used.append(name)
    size = 1 + len(out.used)
    out.delta.div_(size)
    out.phi = own_phi + pull.div_(size)
    out.spread = sum(spreads) / len(spreads) if spreads else None
    return out

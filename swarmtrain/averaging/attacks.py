"""What a Byzantine member may send instead of its pseudo-gradient, for simulations (pure torch).

Each attack maps the honest Δ (a flat fp32 tensor) to what the member contributes:
  scale     Δ × 100: a member pushing θ_global far along its own direction
  signflip  −Δ × 4: a member pulling θ_global back, harder than the others push it
  random    Gaussian noise with 10× the norm of Δ
  nan       Δ with NaN in it (a codec refuses it: the round goes on without that member)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from swarmtrain.diloco.averager import AverageResult

__all__ = ["ATTACKS", "attack", "with_byzantine"]

ATTACKS = ("scale", "signflip", "random", "nan")
AverageAll = Callable[[int, Sequence[torch.Tensor]], list[AverageResult]]


def attack(name: str, delta: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
    """The contribution a Byzantine member sends in place of `delta`."""
    if name == "scale":
        return delta * 100.0
    if name == "signflip":
        return delta * -4.0
    if name == "random":
        noise = torch.randn(delta.shape, generator=generator, dtype=torch.float32)
        return noise * (10.0 * delta.norm() / noise.norm().clamp_min(1e-30))
    if name == "nan":
        bad = delta.clone()
        bad[:: max(1, bad.numel() // 16)] = float("nan")
        return bad
    raise ValueError(f"attack {name!r} is not one of {ATTACKS}")


def with_byzantine(average_all: AverageAll, *, num_workers: int, byzantine: int, name: str,
                   seed: int = 0) -> AverageAll:
    """`average_all` where the last `byzantine` of `num_workers` members send `attack(name, Δ)`."""
    if not 0 <= byzantine < num_workers:
        raise ValueError(f"byzantine must be in [0, {num_workers}) for {num_workers} workers, got {byzantine}")
    if name not in ATTACKS:
        raise ValueError(f"attack {name!r} is not one of {ATTACKS}")
    generator = torch.Generator().manual_seed(seed)

    def attacked(round_index: int, deltas: Sequence[torch.Tensor]) -> list[AverageResult]:
        honest = num_workers - byzantine
        sent = [*deltas[:honest], *(attack(name, d, generator=generator) for d in deltas[honest:])]
        return average_all(round_index, sent)

    return attacked

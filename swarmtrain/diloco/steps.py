"""What a DilocoWorker's calls take and return: inner-step stats, a step as observers see it, an
overlapped round's carry, a round's report, and the error for an unsendable Δ."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["BatchStream", "Carry", "DeltaError", "InnerStats", "InnerStep", "RoundReport"]


class DeltaError(ValueError):
    """This worker's own Δ cannot be sent (NaN or Inf after a diverged inner step); the message says why."""


class BatchStream(Protocol):
    """An endless, resumable stream of (x, y) token batches (e.g. `swarmtrain.data.ShardedBatches`)."""

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class InnerStats:
    steps: int
    loss: float  # mean training loss over the steps
    tokens: int
    compute_s: float

    def __add__(self, other: InnerStats) -> InnerStats:
        """Both runs of steps as one (the loss is the mean over all of their steps)."""
        steps = self.steps + other.steps
        return InnerStats(steps=steps, loss=(self.loss * self.steps + other.loss * other.steps) / steps,
                          tokens=self.tokens + other.tokens, compute_s=self.compute_s + other.compute_s)


@dataclass(frozen=True)
class InnerStep:
    """One inner step as an `on_step` observer (a progress display) sees it, on the training thread."""

    round: int  # θ_global's round (with diloco.overlap, one less until the previous round's average lands)
    step: int  # inner steps of this round so far (with a budget; else of this `train_inner` call)
    max_steps: int  # the round's step limit: H, or the cap of a time-paced round
    span_s: float | None  # time-paced: the compute seconds the round trains for (None: step-paced)
    compute_s: float  # compute seconds of the round so far
    tokens: int  # tokens of this step
    step_s: float  # wall seconds of this step (on CUDA mostly queueing, unless the device was synchronized)
    loss: torch.Tensor  # 0-d, detached; float(loss) waits for the device, so read it at a bounded rate


@dataclass(frozen=True)
class Carry:
    """What `apply` needs of an overlapped round: θ_local right after Δ was sent, and right before."""

    base: torch.Tensor  # the eager estimate of θ_global(new) that the next inner steps started from
    on_abort: torch.Tensor  # θ_local when Δ was taken: where an aborted round puts the progress back
    sent: torch.Tensor | None = None  # this peer's contribution to the mean (the eager scale's fit), if known


@dataclass(frozen=True)
class RoundReport:
    """What one `run_round` did; the peer daemon prints it as its per-round JSON line."""

    round: int  # the round that was attempted
    committed: bool
    loss: float
    tokens: int
    compute_s: float
    comm_s: float
    bytes_sent: int
    bytes_received: int
    members: tuple[str, ...]
    hash: str  # of θ_global after the round
    reason: str = ""

"""A peer's rounds in flight: a trained Δ not yet committed, steps not yet sent, stoppable waits."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from swarmtrain.averaging.group import Group
from swarmtrain.averaging.protocol import AverageResult, Delta
from swarmtrain.diloco.worker import Carry, InnerStats
from swarmtrain.round import RoundMachine

__all__ = ["LocalRoundError", "PendingRound", "UnsentSteps", "group_reporter", "interruptible"]


class LocalRoundError(RuntimeError):
    """This peer cannot take part in a round for a fault of its own (a NaN Δ, a codec error): the
    round aborts here, the peer resynchronises and goes on; the message says why."""


@dataclass
class PendingRound:
    """A round trained but not committed yet: its Δ is averaged again after an aborted attempt.

    Under `diloco.overlap`, `carry` is what `apply` keeps the newer inner steps with and `task` the
    average running while the next round trains.
    """

    round: int
    delta: Delta  # a classic round's Δ is read a slice at a time from θ_global and θ_local
    loss: float
    compute_s: float
    steps: int
    carry: Carry | None = None
    task: asyncio.Task[tuple[AverageResult, float]] | None = None
    steps_per_s: float = field(init=False)  # announced with Δ on every attempt (diloco.pace)

    def __post_init__(self) -> None:
        self.steps_per_s = self.steps / self.compute_s if self.steps and self.compute_s > 0 else 0.0


@dataclass
class UnsentSteps:
    """Inner steps in θ_local that no average carries yet (`diloco.overlap`)."""

    trained: bool = False
    loss: float = math.nan  # mean training loss of those steps
    compute_s: float = 0.0
    steps: int = 0

    def add(self, stats: InnerStats) -> None:
        total = self.steps + stats.steps
        self.loss = stats.loss if not self.steps else (self.loss * self.steps + stats.loss * stats.steps) / total
        self.trained, self.steps, self.compute_s = True, total, self.compute_s + stats.compute_s


async def interruptible(aw: Any, stop: asyncio.Event) -> Any:
    """Await `aw` unless `stop` is set first (then wait for `aw` to finish and return None)."""
    task = asyncio.ensure_future(aw)
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if task in done:
        return task.result()
    with contextlib.suppress(Exception):
        await task  # a thread cannot be cancelled: let the inner steps finish before leaving
    return None


def group_reporter(machine: RoundMachine) -> Callable[[Group], None]:
    """The data plane's `on_group` callback: tells the round machine that the round's group formed."""

    def report(group: Group) -> None:
        machine.matched(group=f"attempt {group.attempt}, {len(group.members)} members, group {group.group_id[:12]}")

    return report

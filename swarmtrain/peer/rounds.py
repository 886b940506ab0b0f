"""What a DiLoCo worker's part keeps between its round's steps and its average: inner steps not yet sent
(`diloco.overlap`), and how inner steps end on a stop."""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass
from typing import Any

from swarmtrain.diloco.worker import InnerStats

__all__ = ["UnsentSteps", "interruptible"]


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

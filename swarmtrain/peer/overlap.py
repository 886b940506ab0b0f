"""`diloco.overlap`: round r's average runs while the inner steps of round r+1 do: the round driver's machine in
its overlapped mode (Launch, Settle), performed for a DiLoCo worker.

When Δ is sent, θ_local jumps to the eager estimate of the new θ_global (the outer step on this peer's guess of
the mean: `send_overlapped`); the swarm's mean is applied after the inner step during which it lands, and
shifts θ_local by the estimate's error. Between rounds θ_local = θ_global − (own progress not yet in θ_global):
a commit keeps the steps taken since Δ was sent, an abort puts Δ back so the next attempt carries it with them,
and a heal starts again from the donor's θ (or keeps the unsent steps on top of it when one round late). The
averaging itself, its decision, heals and waits are the driver's (driver/loop.py), as in the classic mode.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import threading
import time

import torch

from swarmtrain.diloco.averager import AverageResult, ShardedMean
from swarmtrain.diloco.pace import RoundBudget
from swarmtrain.diloco.worker import Carry, DeltaError
from swarmtrain.driver.loop import RoundDriver
from swarmtrain.driver.part import Trained
from swarmtrain.peer.part import WorkerPart
from swarmtrain.peer.rounds import UnsentSteps
from swarmtrain.round import Finish, Heal, Launch, Settle, Train, Wait

__all__ = ["run_overlapped"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _InFlight:
    """A round sent and averaging in the background: what `apply` keeps the newer steps with."""

    trained: Trained
    carry: Carry
    task: asyncio.Task[tuple[AverageResult, float]]


class _Overlapped:
    def __init__(self, driver: RoundDriver, part: WorkerPart, stop: asyncio.Event) -> None:
        self.driver, self.part, self.stop = driver, part, stop
        self.worker = part.worker
        # The next round's Δ and carry (or why Δ was unusable), computed by the training thread right after the
        # round's last inner step, for the `Launch` that follows; `_unsend` takes it back if none does.
        self.presend: tuple[torch.Tensor, Carry] | DeltaError | None = None

    async def run(self) -> str:
        driver, worker = self.driver, self.worker
        unsent = UnsentSteps(trained=worker.has_local_progress())  # a resumed peer sends what it had trained
        machine = driver.machine
        machine.set_unsent(unsent.trained)
        pending: _InFlight | None = None
        while True:
            if self.stop.is_set():
                machine.request_stop()  # an average in flight is concluded first
            action = machine.next()
            if self.presend is not None and not isinstance(action, Launch):
                await self._unsend()
            if isinstance(action, Finish):
                if action.reason == "done":
                    await driver.linger(self.stop)
                return action.reason
            if isinstance(action, Heal):
                if await driver.heal(action) and not worker.has_local_progress():
                    unsent = UnsentSteps()  # healed without keeping this peer's unsent steps
            elif isinstance(action, Train):
                stats = await self.part.train_steps(self.stop)
                if stats is None:
                    machine.stopped()
                    continue
                unsent.add(stats)
                machine.trained()
            elif isinstance(action, Launch):
                pending, problem = await self._launch(unsent)
                unsent = UnsentSteps()
                machine.launched(problem=problem)
            elif isinstance(action, Settle):
                assert pending is not None
                result = None
                if action.train_meanwhile:
                    result = await self._train_while_averaging(pending, unsent)
                if result is None:
                    result = await self._settle(pending)
                if not result.committed and math.isnan(unsent.loss):
                    unsent.loss = pending.trained.loss  # θ_local still holds the aborted round's progress
                if not result.committed:
                    unsent.trained = True
                pending = None
                machine.averaged(committed=result.committed, reason=result.reason, retry_at=result.retry_at,
                                 heal_to_hash=result.heal_to_hash, trained_meanwhile=unsent.trained)
                del result  # the mean's memory goes back to the pool before the next round needs it
            elif isinstance(action, Wait):
                await driver.wait(action, self.stop)
            else:
                raise AssertionError(f"the overlapped round loop cannot perform {action!r}")

    async def _launch(self, unsent: UnsentSteps) -> tuple[_InFlight | None, str]:
        """Start averaging Δ = θ_global − θ_local of the current round in the background.

        (None, why) when Δ is unusable (NaN/Inf): the round is aborted here and the peer resynchronised."""
        worker = self.worker
        presend, self.presend = self.presend, None
        try:
            if isinstance(presend, DeltaError):
                raise presend
            delta, carry = presend if presend is not None else await asyncio.to_thread(worker.send_overlapped)
        except DeltaError as e:
            await self.part.resync(str(e))
            return None, str(e)
        trained = Trained(round=worker.round, delta=delta, loss=unsent.loss, compute_s=unsent.compute_s,
                          steps=unsent.steps)
        driver, fragments = self.driver, worker.fragments is not None

        async def timed() -> tuple[AverageResult, float]:
            start = time.perf_counter()
            try:
                result = await driver.average(trained, apply=False)
            except Exception as e:  # a fault of this peer's own: abort the attempt, try again a window later
                log.exception("round %d: the all-reduce failed on this peer", trained.round)
                window_s = driver.cfg.averaging.matchmaking_timeout_s
                result = AverageResult(round=trained.round, committed=False, mean=None,
                                       retry_at=driver.discovery.now() + window_s,
                                       reason=f"local error in the all-reduce: {type(e).__name__}: {e}")
            if fragments and isinstance(result.mean, ShardedMean):
                # A fragment's outer step takes its mean whole: decoded here, beside the inner steps, not
                # on the training thread between two of them
                result = dataclasses.replace(result, mean=await asyncio.to_thread(result.mean.tensor))
            return result, time.perf_counter() - start

        return _InFlight(trained, carry, asyncio.ensure_future(timed())), ""

    async def _settle(self, pending: _InFlight) -> AverageResult:
        result, comm_s = await pending.task
        await self._conclude(pending, result, comm_s=comm_s, landed=False)
        return result

    async def _conclude(self, pending: _InFlight, result: AverageResult, *, comm_s: float, landed: bool) -> None:
        """A result applied (unless `landed` on the training thread already), then the driver's bookkeeping of a
        commit and the round line."""
        if not landed:
            await asyncio.to_thread(self._land, pending, result, comm_s)
        if result.committed:
            await self.driver.committed(result)
        await self.part.announce_now()
        await self.part.report(pending.trained, result, comm_s=comm_s, overlapped=True)

    def _land(self, pending: _InFlight, result: AverageResult, comm_s: float) -> None:
        own = pending.trained if result.committed and self.driver.peer_id in result.members else None
        self.part.land(result, own=own, comm_s=comm_s, carry=pending.carry)

    async def _train_while_averaging(self, pending: _InFlight, unsent: UnsentSteps) -> AverageResult | None:
        """The round's inner steps; `pending` is concluded between two steps as soon as it is done.

        The round usually runs in one training call: the mean is applied on the training thread between the
        two inner steps during which it landed (while the loop announces it and reports the round), a
        time-paced round starts matching the next one from there too (`RoundBudget.set_alarm`), and when the
        round's steps are done the same call computes the next Δ (`presend`). The call ends early after
        `diloco.overlap_max_steps` steps without a mean (the peer waits for it), and at a landing whose round
        brings an evaluation or a checkpoint (those read θ_local; they run on the loop). Returns `pending`'s
        result if it was concluded, None if a stop came first."""
        part, worker, task, loop = self.part, self.worker, pending.task, asyncio.get_running_loop()
        budget, lag = part.pace.budget(), part.cfg.diloco.overlap_max_steps
        landed = threading.Event()
        task.add_done_callback(lambda _: landed.set())
        on_thread = not any(part.due(pending.trained.round + 1))  # an evaluation or a checkpoint reads θ_local
        outcome: list[AverageResult] = []  # the result, once applied
        reported: list[concurrent.futures.Future[None]] = []

        def between() -> bool:  # the training thread, after an inner step: True ends the call
            if not outcome and landed.is_set():
                if not on_thread:
                    return True
                result, comm_s = task.result()
                self._land(pending, result, comm_s)
                outcome.append(result)
                if result.committed:
                    self._rearm(budget, loop=loop)
                reported.append(asyncio.run_coroutine_threadsafe(
                    self._conclude(pending, result, comm_s=comm_s, landed=True), loop))
            return not outcome and budget.steps >= lag

        def presend() -> None:  # the training thread, after the call's last step
            if (budget.steps_left() or self.stop.is_set() or not outcome or not outcome[0].committed
                    or worker.round >= part.cfg.diloco.rounds):
                return
            try:
                self.presend = worker.send_overlapped()
            except DeltaError as e:
                self.presend = e

        while not self.stop.is_set():
            if not outcome and (task.done() or budget.steps >= lag or not budget.steps_left()):
                outcome.append(await self._settle(pending))
                if outcome[0].committed:
                    self._rearm(budget)
            if not budget.steps_left():
                break
            stats = await part._train(budget, self.stop, between=between, then=presend)
            if reported:
                await asyncio.wrap_future(reported.pop())
            if stats is None:
                break
            unsent.add(stats)
        if not outcome and not self.stop.is_set():
            outcome.append(await self._settle(pending))
        return outcome[0] if outcome else None

    def _rearm(self, budget: RoundBudget, *, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """After a commit (on the loop, or on the training thread with `loop`): the next round's budget and,
        when time-paced, the alarm that starts its matchmaking (now, if its time has passed)."""
        part = self.part
        budget.resize(part.pace.budget())  # the commit may have set a new span
        match_at = budget.match_at_s()
        if match_at is None:
            return
        alarm = part.prematch_alarm(budget, round_index=self.worker.round, loop=loop)
        if budget.compute_s >= match_at:
            alarm()
        else:
            budget.set_alarm(match_at, alarm)

    async def _unsend(self) -> None:
        """A Δ computed at the end of a round's steps (`presend`) that no launch took (a stop, a heal came
        first): θ_local goes back to where it was, as after an aborted round."""
        presend, self.presend = self.presend, None
        if isinstance(presend, tuple):
            worker, carry = self.worker, presend[1]
            unsent = AverageResult(round=worker.round, committed=False, mean=None, reason="computed, not sent")
            await asyncio.to_thread(worker.apply, unsent, carry=carry)


async def run_overlapped(driver: RoundDriver, part: WorkerPart, stop: asyncio.Event) -> str:
    """`diloco.overlap`'s round loop for a worker (see the module docstring); returns why it ended."""
    clock = asyncio.ensure_future(driver.settle_clock())
    try:
        return await _Overlapped(driver, part, stop).run()
    finally:
        clock.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await clock

"""`diloco.overlap`: round r's average runs while the inner steps of round r+1 do (the Peer's rounds in that mode).

A mixin of `Peer` (swarmtrain/peer/root.py), which owns the state and the classic round loop this
mode shares its steps with (training, averaging, concluding, healing).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import threading
import time

import torch

from swarmtrain.averaging.protocol import AverageResult, ShardedMean
from swarmtrain.diloco.pace import RoundBudget
from swarmtrain.diloco.worker import Carry, DeltaError
from swarmtrain.peer.rounds import PendingRound, UnsentSteps, group_reporter
from swarmtrain.round import Finish, Heal, Launch, RoundMachine, Settle, Train, Wait

__all__ = ["OverlappedRounds"]

log = logging.getLogger(__name__)


class OverlappedRounds:
    """The overlapped round loop; mixed into `Peer`, whose attributes and steps it uses."""

    # The next round's Δ and carry (or why Δ was unusable), computed by the training thread right after the
    # round's last inner step, for the `Launch` that follows; `_unsend` takes it back if none does.
    _presend: tuple[torch.Tensor, Carry] | DeltaError | None = None

    async def _run_overlapped(self, stop: asyncio.Event) -> str:
        """`diloco.overlap`: round r's average runs while the inner steps of round r+1 do.

        When Δ is sent, θ_local jumps to the eager estimate of the new θ_global (the outer step on
        this peer's guess of the mean: `send_overlapped`); the swarm's mean is applied after the
        inner step during which it lands, and shifts θ_local by the estimate's error. Between rounds
        θ_local = θ_global − (own progress not yet in θ_global): a commit keeps the steps taken
        since Δ was sent, an abort puts Δ back so the next attempt carries it with them, and a heal
        starts again from the donor's θ (or keeps the unsent steps on top of it when one round late).
        The decisions are the RoundMachine's (swarmtrain/round/machine.py); this loop performs them.
        """
        assert self.worker is not None
        worker = self.worker
        unsent = UnsentSteps(trained=worker.has_local_progress())  # a resumed peer sends what it had trained
        machine = self._round_machine(overlap=True, unsent=unsent.trained)
        pending: PendingRound | None = None
        while True:
            if stop.is_set():
                machine.request_stop()  # an average in flight is concluded first
            action = machine.next()
            if self._presend is not None and not isinstance(action, Launch):
                await self._unsend()
            if isinstance(action, Finish):
                if action.reason == "done":
                    await self._linger_for_stragglers(stop)
                return action.reason
            if isinstance(action, Heal):
                if await self._heal(machine, action) and not worker.has_local_progress():
                    unsent = UnsentSteps()  # healed without keeping this peer's unsent steps
            elif isinstance(action, Train):
                stats = await self._train_round(stop)
                if stats is None:
                    machine.stopped()
                    continue
                unsent.add(stats)
                machine.trained()
            elif isinstance(action, Launch):
                pending, problem = await self._launch(unsent, machine)
                unsent = UnsentSteps()
                machine.launched(problem=problem)
            elif isinstance(action, Settle):
                assert pending is not None
                result = None
                if action.train_meanwhile:
                    result = await self._train_while_averaging(pending, unsent, stop)
                if result is None:
                    result = await self._settle(pending)
                if not result.committed and math.isnan(unsent.loss):
                    unsent.loss = pending.loss  # θ_local still holds the aborted round's progress
                if not result.committed:
                    unsent.trained = True
                pending = None
                machine.averaged(committed=result.committed, reason=result.reason, retry_at=result.retry_at,
                                 heal_to_hash=result.heal_to_hash, trained_meanwhile=unsent.trained)
                del result  # the mean's memory goes back to the pool before the next round needs it
            elif isinstance(action, Wait):
                await self._wait(machine, action, stop)
            else:
                raise AssertionError(f"the overlapped round loop cannot perform {action!r}")

    async def _train_while_averaging(self, pending: PendingRound, unsent: UnsentSteps,
                                     stop: asyncio.Event) -> AverageResult | None:
        """The round's inner steps; `pending` is concluded between two steps as soon as it is done.

        The round usually runs in one training call: the mean is applied on the training thread
        between the two inner steps during which it landed (`_land`, while the loop announces it:
        `_report`), a time-paced round starts matching the next one from there too
        (`RoundBudget.set_alarm`), and when the round's steps are done the same call computes the
        next Δ (`_presend`). Every hand-off between the loop and the training thread costs time in
        which the peer trains nothing. The call ends early after `diloco.overlap_max_steps` steps
        without a mean (the peer waits for it), and at a landing whose round brings an evaluation
        or a checkpoint (those read θ_local; they run on the loop as before). Returns `pending`'s
        result if it was concluded, None if a stop came first.
        """
        assert self.worker is not None and self.plane is not None and pending.task is not None
        worker, task, loop = self.worker, pending.task, asyncio.get_running_loop()
        budget, lag = self.pace.budget(), self.cfg.diloco.overlap_max_steps
        landed = threading.Event()
        task.add_done_callback(lambda _: landed.set())
        on_thread = not any(self._due(pending.round + 1))  # an evaluation or a checkpoint reads θ_local
        outcome: list[AverageResult] = []  # the result, once applied
        reported: list[concurrent.futures.Future[None]] = []

        def between() -> bool:  # the training thread, after an inner step: True ends the call
            if not outcome and landed.is_set():
                if not on_thread:
                    return True
                result, comm_s = task.result()
                digest = self._land(pending, result, comm_s=comm_s, digest=False)
                outcome.append(result)
                if result.committed:
                    self._rearm(budget, loop=loop)
                reported.append(asyncio.run_coroutine_threadsafe(
                    self._report(pending, result, comm_s=comm_s, digest=digest), loop))
            return not outcome and budget.steps >= lag

        def presend() -> None:  # the training thread, after the call's last step
            if (budget.steps_left() or stop.is_set() or not outcome or not outcome[0].committed
                    or worker.round >= self.cfg.diloco.rounds):
                return
            try:
                self._presend = worker.send_overlapped()
            except DeltaError as e:
                self._presend = e

        while not stop.is_set():
            if not outcome and (task.done() or budget.steps >= lag or not budget.steps_left()):
                outcome.append(await self._settle(pending))
                if outcome[0].committed:
                    self._rearm(budget)
            if not budget.steps_left():
                break
            stats = await self._train(budget, stop, between=between, then=presend)
            if reported:
                await asyncio.wrap_future(reported.pop())
            if stats is None:
                break
            unsent.add(stats)
        if not outcome and not stop.is_set():
            outcome.append(await self._settle(pending))
        return outcome[0] if outcome else None

    def _rearm(self, budget: RoundBudget, *, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """After a commit (on the loop, or on the training thread with `loop`): the next round's budget and,
        when time-paced, the alarm that starts its matchmaking (now, if its time has passed)."""
        assert self.worker is not None
        budget.resize(self.pace.budget())  # the commit may have set a new span
        match_at = budget.match_at_s()
        if match_at is None:
            return
        alarm = self._prematch_alarm(budget, round_index=self.worker.round, loop=loop)
        if budget.compute_s >= match_at:
            alarm()
        else:
            budget.set_alarm(match_at, alarm)

    async def _launch(self, unsent: UnsentSteps, machine: RoundMachine) -> tuple[PendingRound | None, str]:
        """Start averaging Δ = θ_global − θ_local for the current round in the background.

        (None, why) when Δ is unusable (NaN/Inf): the round is aborted here and the peer resynchronised.
        """
        assert self.worker is not None and self.plane is not None
        worker, plane = self.worker, self.plane
        presend, self._presend = self._presend, None
        try:
            if isinstance(presend, DeltaError):
                raise presend
            delta, carry = presend if presend is not None else await asyncio.to_thread(worker.send_overlapped)
        except DeltaError as e:
            self._abort_locally(PendingRound(round=worker.round, delta=torch.empty(0), loss=unsent.loss,
                                             compute_s=unsent.compute_s, steps=unsent.steps), str(e))
            return None, str(e)
        pending = PendingRound(round=worker.round, delta=delta, loss=unsent.loss, compute_s=unsent.compute_s,
                              steps=unsent.steps, carry=carry)
        window_s, fragments = self.cfg.averaging.matchmaking_timeout_s, worker.fragments is not None

        async def timed() -> tuple[AverageResult, float]:
            start = time.perf_counter()
            try:
                result = await plane.average(pending.round, pending.delta, steps_per_s=pending.steps_per_s,
                                             lag_s=self.pace.lag_s,
                                             electorate=await self._electorate(pending.round),
                                             on_group=group_reporter(machine))
            except Exception as e:  # a fault of this peer's own: abort the attempt, try again a window later
                log.exception("round %d: the all-reduce failed on this peer", pending.round)
                result = AverageResult(round=pending.round, committed=False, mean=None, retry_at=self._now() + window_s,
                                       reason=f"local error in the all-reduce: {type(e).__name__}: {e}")
            if fragments and isinstance(result.mean, ShardedMean):
                # A fragment's outer step takes its mean whole: decoded here, beside the inner steps, not
                # on the training thread between two of them
                result = dataclasses.replace(result, mean=await asyncio.to_thread(result.mean.tensor))
            return result, time.perf_counter() - start

        pending.task = asyncio.ensure_future(timed())
        return pending, ""

    async def _unsend(self) -> None:
        """A Δ computed at the end of a round's steps (`_presend`) that no launch took (a stop, a heal came
        first): θ_local goes back to where it was, as after an aborted round."""
        assert self.worker is not None
        presend, self._presend = self._presend, None
        if isinstance(presend, tuple):
            worker, carry = self.worker, presend[1]
            unsent = AverageResult(round=worker.round, committed=False, mean=None, reason="computed, not sent")
            await asyncio.to_thread(worker.apply, unsent, carry=carry)

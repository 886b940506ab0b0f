"""A DiLoCo worker as the round driver's part (driver/part.py): its inner steps (paced by `diloco.pace`, with
matchmaking started during a time-paced round's last steps), its outer step, heals into it, its round lines,
evaluations and checkpoints.

Every change of the committed state is one call off the event loop under the worker's global lock (an outer
step or a heal of a 1B-parameter model takes seconds), then announced: heartbeats announce the previous
(round, digest) until the new one is published.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from swarmtrain.config import RunConfig, public_dict
from swarmtrain.data.evaluation import bits_per_byte, perplexity
from swarmtrain.diloco import DilocoWorker
from swarmtrain.diloco.averager import AverageResult, ShardedMean
from swarmtrain.diloco.pace import Pace, RoundBudget
from swarmtrain.diloco.worker import Carry, InnerStats
from swarmtrain.discovery import DirectoryIo
from swarmtrain.driver.part import CommittedState, Trained
from swarmtrain.peer.heap import steps_heap
from swarmtrain.peer.rounds import interruptible
from swarmtrain.round.ballots import Value, Voter
from swarmtrain.round.certificate import Certificate
from swarmtrain.round.group import Member
from swarmtrain.sync.checkpoint import save_checkpoint
from swarmtrain.telemetry import EventWriter, RoundEvent

__all__ = ["WorkerPart"]

log = logging.getLogger(__name__)

KEPT_CERTIFICATES = 16


class WorkerPart:
    """A DilocoWorker driven by the round driver (see the module docstring).

    `prematch(round, member)` starts a round's matchmaking in the background (the plane's); `announce()`
    publishes the committed (round, digest) and beats at once; `alone_s()` says how long no other peer was
    seen (round lines); `peer_id()` the peer's id."""

    def __init__(self, cfg: RunConfig, *, worker: DilocoWorker, writer: EventWriter, pace: Pace,
                 val_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], peer_id: Callable[[], str],
                 member: Callable[[int, float], Member], prematch: Callable[[int, Member], Any],
                 announce: Callable[[], None], now: Callable[[], float], alone_s: Callable[[], float],
                 certificates: Sequence[Certificate] = (), resumed_at: int | None = None,
                 val_bytes_per_token: float = 1.0, io: Callable[[], DirectoryIo] | None = None) -> None:
        """`resumed_at`: the round of the checkpoint the worker was resumed from, if any; `val_bytes_per_token`:
        of the validation text (val_loss in bits per byte); `io()`: the directory's control-plane counters (each
        round line carries what they grew by since the line before)."""
        self.cfg = cfg
        self.worker = worker
        self.writer = writer
        self.pace = pace
        self.val_batches = val_batches
        self.val_bytes_per_token = val_bytes_per_token
        self.peer_id = peer_id
        self.member = member
        self.prematch = prematch
        self.announce = announce
        self.now = now
        self.alone_s = alone_s
        self.certificates: list[Certificate] = list(certificates)[-KEPT_CERTIFICATES:]
        # The rounds of the checkpoints kept on disk, oldest first (a resumed worker's round is the first).
        self._saved: collections.deque[int] = collections.deque(maxlen=cfg.checkpoint.keep)
        if resumed_at is not None:
            self._saved.append(resumed_at)
        self.round_ends_at = 0.0  # swarm clock: when this round's inner steps should end (peer record)
        self.join_by: tuple[int, float] | None = None  # (round healed into, monotonic time its steps end)
        self.phase = "training"
        self.last_loss: float | None = None
        self.last_val_loss: float | None = None
        self.rounds_committed = 0
        self.rounds_aborted = 0
        self.announced: tuple[int, str] = (worker.round, worker.digest())
        self._prematching: asyncio.Future[Any] | None = None  # the latest prematch a round's alarm started
        self.io = io
        self._io_at = io().copy() if io is not None else None  # the counters at the previous round line

    # ------------------------------------------------------------------ the committed state

    @property
    def round(self) -> int:
        return self.worker.round

    @property
    def digest(self) -> str:
        return self.worker.digest()

    @property
    def voters(self) -> tuple[Voter, ...]:
        return self.worker.voters

    def _state(self, *, copy: bool) -> CommittedState:
        w = self.worker
        momentum = w.outer.state_tensors().get("momentum")
        theta = w.theta_global.detach().cpu()

        def own(t: torch.Tensor) -> torch.Tensor:
            return t.clone() if copy else t

        return CommittedState(round=w.round, theta_global=own(theta),
                              outer_momentum=None if momentum is None else own(momentum.detach().cpu()),
                              voters=w.voters, digest=w.digest(), certificates=tuple(self.certificates),
                              version=w.theta_version)

    @contextlib.contextmanager
    def committed(self) -> Iterator[CommittedState]:
        """The committed state with the worker's own tensors: outer steps and heals wait until the block is
        left (the worker's global lock; called off the event loop)."""
        with self.worker.global_lock:
            yield self._state(copy=False)

    async def _publish(self) -> None:
        """After the committed state changed: its digest (computed off the loop, cached) announced."""
        digest = await asyncio.to_thread(self.worker.digest)
        self.announced = (self.worker.round, digest)
        self.announce()

    async def announce_now(self) -> None:
        """The committed state may have changed outside `apply` and `adopt` (an overlapped landing)."""
        if self.announced != (self.worker.round, self.worker.digest()):
            await self._publish()

    # ------------------------------------------------------------------ training

    async def train(self, stop: asyncio.Event) -> Trained | None:
        """One round's inner steps and its Δ (None: `stop` came first)."""
        stats = await self.train_steps(stop)
        if stats is None:
            return None
        delta = await asyncio.to_thread(self.worker.delta_source)
        return Trained(round=self.worker.round, delta=delta, loss=stats.loss, compute_s=stats.compute_s,
                       steps=stats.steps)

    async def train_steps(self, stop: asyncio.Event) -> InnerStats | None:
        """One round's inner steps, as `diloco.pace` budgets them (None: `stop` came first).

        A timed round enters matchmaking shortly before its span ends (`RoundBudget.match_at_s`)."""
        worker = self.worker
        await asyncio.to_thread(steps_heap)  # what the last round freed goes back before the inner steps allocate
        budget = self.pace.budget()
        join, self.join_by = self.join_by, None
        if join is not None and join[0] == worker.round:  # healed into a round under way: end with the swarm
            budget.cut_to(max(0.0, join[1] - time.monotonic()))
        if self.round_ends_at <= self.now():  # no end announced for these steps (the first round of this process,
            budget.first_step = self._announce_end  # or one trained again): announced once a step was timed
        match_at = budget.match_at_s()
        if match_at is not None:
            budget.set_alarm(match_at, self.prematch_alarm(budget))
        self.phase = "training"
        stats = await self._train(budget, stop)
        if stats is not None and budget.alarm is not None:  # the steps ran out before the alarm
            budget.alarm = None
            await self.prematch(worker.round, self.member(worker.round, self.pace.prematch_rate(budget)))
        return stats

    def _announce_end(self, budget: RoundBudget) -> None:
        """The record's end of this round's steps, from the first step's time (on the training thread): a peer
        restarted from its checkpoint tells the others' matchmaking that it cannot post before their window closes,
        instead of holding the window to its end."""
        self.round_ends_at = self.now() + budget.left_s()

    def prematch_alarm(self, budget: RoundBudget, *, round_index: int | None = None,
                       loop: asyncio.AbstractEventLoop | None = None) -> Callable[[], None]:
        """What a time-paced round's budget calls on the training thread at `match_at_s`: start matchmaking for
        `round_index` (default: the worker's) on the loop. The training call runs on; ending it there to
        prematch cost a hand-off between threads and back every round, time in which nothing trained."""
        loop = loop or asyncio.get_running_loop()
        round_index = self.worker.round if round_index is None else round_index

        def start(rate: float) -> None:
            self._prematching = asyncio.ensure_future(self.prematch(round_index, self.member(round_index, rate)))

        def alarm() -> None:  # the rate as measured now, on the training thread
            loop.call_soon_threadsafe(start, self.pace.prematch_rate(budget))

        return alarm

    async def _train(self, budget: RoundBudget, stop: asyncio.Event, *, max_steps: int = 0,
                     interrupt: threading.Event | None = None, between: Callable[[], bool] | None = None,
                     then: Callable[[], None] | None = None) -> InnerStats | None:
        """At least one inner step, off the loop, until `budget` is spent, `max_steps` ran, (when given)
        `interrupt` is set or `between` ends it; then `then`, on the same thread. None if `stop` came first."""
        worker, steps = self.worker, min(max(1, budget.steps_left()), max_steps or budget.max_steps)

        def run() -> InnerStats:
            stats = worker.train_inner(steps, budget=budget, interrupt=interrupt, between=between)
            if then is not None:
                then()
            return stats

        return await interruptible(asyncio.to_thread(run), stop)

    async def delta_problem(self, trained: Trained) -> str:
        return await asyncio.to_thread(self.worker.delta_problem, trained.delta)

    # ------------------------------------------------------------------ the outer step

    async def preview(self, mean: ShardedMean, next_voters: tuple[Voter, ...]) -> str:
        return await asyncio.to_thread(self._preview_locked, mean, next_voters)

    def _preview_locked(self, mean: ShardedMean, next_voters: tuple[Voter, ...]) -> str:
        with self.worker.global_lock:  # an outer step or heal in progress must not be read half-way
            return self.worker.preview(mean, next_voters)

    async def outcome_of(self, value: Value, mean: ShardedMean) -> str | None:
        """The state this worker's outer step with `mean` would commit for `value`, None when it does not hold
        the value's base state (another round, another θ): what its voter checks a value's result against."""
        def locked() -> str | None:
            with self.worker.global_lock:
                if self.worker.digest() != value.base:
                    return None
                return self.worker.preview(mean, value.next_voters)
        return await asyncio.to_thread(locked)

    async def apply(self, result: AverageResult, *, own: Trained | None, comm_s: float = 0.0) -> None:
        """A commit's outer step (off the loop), the pace it sets, its certificate kept, announced."""
        await asyncio.to_thread(functools.partial(self.land, result, own=own, comm_s=comm_s))
        await self._publish()

    def land(self, result: AverageResult, *, own: Trained | None, comm_s: float = 0.0,
             carry: Carry | None = None) -> None:
        """`result` applied to the worker in one call (a thread off the loop, or the training thread between
        two inner steps under `diloco.overlap`, with the round's `carry`); an abort too, under overlap (its Δ
        goes back into θ_local)."""
        worker = self.worker
        value = result.certificate.value if result.certificate is not None else None
        if value is not None and value.base != worker.digest():
            raise ValueError(f"round {result.round}'s value was averaged from state {value.base[:12]}, this peer "
                             f"holds {worker.digest()[:12]}")
        if result.committed and own is None:
            worker.discard_pending_residual()  # the mean holds none of this peer's Δ: its codec loss is no residual
        worker.apply(result, carry=carry)
        if not result.committed:
            return
        if value is not None and worker.digest() != value.result:
            log.error("round %d: the outer step gave state %s, the round's value names %s (a nondeterministic "
                      "step?): this peer heals", result.round, worker.digest()[:12], value.result[:12])
        if result.certificate is not None:
            self.certificates = [*self.certificates[-(KEPT_CERTIFICATES - 1):], result.certificate]
        self.pace.observe(result, peer_id=self.peer_id(), comm_s=comm_s)
        if own is not None:
            self.pace.last_rate = own.steps_per_s or self.pace.last_rate
        expected_s = self.pace.expected_round_s()
        self.round_ends_at = self.now() + expected_s if expected_s > 0 else 0.0

    async def adopt(self, state: CommittedState, *, keep_progress: bool = False) -> None:
        """A heal: θ_global, the momentum, the round and its voters from a verified download; θ_local restarts
        from it (or with `keep_progress`, overlapped and one round late, keeps its unsent steps on top) and the
        error-feedback residual is dropped (it was measured against another θ_global)."""
        self.phase = "healing"
        await asyncio.to_thread(functools.partial(
            self.worker.adopt_global, round_index=state.round, theta_global=state.theta_global,
            outer_momentum=state.outer_momentum, voters=state.voters, keep_progress=keep_progress))
        if not keep_progress:
            self.worker.forget_residual()
        self.certificates = list(state.certificates)[-KEPT_CERTIFICATES:]
        if self.worker.digest() != state.digest:
            raise ValueError(f"the adopted state hashes to {self.worker.digest()[:12]}, not {state.digest[:12]}")
        self.phase = "training"
        await self._publish()

    def joined(self, round_index: int, round_ends_at: float | None) -> None:
        """Healed into `round_index`: its inner steps end with the swarm's (`train_steps` cuts its budget), and
        the record announces that end."""
        self.round_ends_at = round_ends_at or 0.0
        self.join_by = None if round_ends_at is None else (round_index,
                                                           time.monotonic() + round_ends_at - self.now())

    async def resync(self, reason: str) -> None:
        """End this peer's attempt at a round for a fault of its own: report it, resync from θ_global."""
        log.warning("round %d aborted on this peer: %s; resynchronising from θ_global", self.worker.round, reason)
        await asyncio.to_thread(self.worker.resync)
        self.phase = "training"
        self._after_round(False, math.nan, None)
        self.writer.emit(RoundEvent(
            round=self.worker.round, committed=False, members=(), loss=math.nan, val_loss=None,
            hash=self.worker.digest(), bytes_sent=0, bytes_received=0, compute_s=0.0, comm_s=0.0, peer=self.peer_id(),
            reason=reason, steps=0, alone_s=self.alone_s()))

    # ------------------------------------------------------------------ reporting

    async def report(self, trained: Trained | None, result: AverageResult, *, comm_s: float,
                     overlapped: bool = False, spread: float | None = None, wait_s: float | None = None) -> None:
        """One round line after an attempt; after a commit an evaluation and a checkpoint on schedule.
        `overlapped`: θ_local holds newer steps than θ_global (the evaluation scores θ_global: two copies);
        `spread`: a gossip round's distance of φ to the partners' (diloco/noloco.py); `wait_s`: of `comm_s`, the
        seconds a gossip round waited for its partners' parts."""
        worker = self.worker
        self.phase = "training"
        loss = trained.loss if trained is not None else math.nan
        val_loss = None
        if result.committed and self.due(worker.round)[0]:
            evaluate = worker.evaluate_global if overlapped else worker.evaluate
            val_loss = await asyncio.to_thread(evaluate, self.val_batches)
        self._after_round(result.committed, loss, val_loss)
        self.writer.emit(RoundEvent(
            round=result.round, committed=result.committed, members=result.members, loss=loss, val_loss=val_loss,
            hash=worker.digest(), bytes_sent=result.bytes_sent, bytes_received=result.bytes_received,
            compute_s=round(trained.compute_s if trained is not None else 0.0, 4), comm_s=round(comm_s, 4),
            peer=self.peer_id(), reason=result.reason, steps=trained.steps if trained is not None else 0,
            alone_s=0.0 if len(result.members) > 1 else self.alone_s(),
            val_ppl=None if val_loss is None else perplexity(val_loss),
            val_bpb=None if val_loss is None else bits_per_byte(val_loss, bytes_per_token=self.val_bytes_per_token),
            spread=None if spread is None else round(spread, 6), wait_s=None if wait_s is None else round(wait_s, 4),
            **self._io_since_last_line()))
        if trained is not None:
            trained.compute_s, trained.steps = 0.0, 0  # a retry of the round reports only its own communication
        if result.committed and self.due(worker.round)[1]:
            await self.checkpoint()

    def _io_since_last_line(self) -> dict[str, int]:
        """The round line's dht_* fields: the directory's counters since the previous line ({} without them)."""
        if self.io is None or self._io_at is None:
            return {}
        now = self.io().copy()
        grew, self._io_at = now.minus(self._io_at), now
        return {"dht_reads": grew.reads, "dht_writes": grew.writes, "dht_slots": grew.slots,
                "dht_decoded": grew.decoded}

    def due(self, round_index: int) -> tuple[bool, bool]:
        """(evaluation, checkpoint): what reaching `round_index` by a commit brings, on schedule."""
        every = self.cfg.diloco.eval_every_rounds
        return bool(every and round_index % every == 0), round_index % self.cfg.checkpoint.every_rounds == 0

    def _after_round(self, committed: bool, loss: float, val_loss: float | None) -> None:
        self.last_loss = loss if math.isfinite(loss) else self.last_loss
        if committed:
            self.rounds_committed += 1
            self.last_val_loss = val_loss
        else:
            self.rounds_aborted += 1

    async def checkpoint(self) -> Path | None:
        """The worker's whole state in `checkpoint.dir` (no copies: nothing steps it until the save returns);
        the saved checkpoint's manifest, None without a directory."""
        if not self.cfg.checkpoint.dir:
            return None
        tensors, meta = self.worker.state_dict(copy=False)
        full_meta = {"run_id": self.cfg.train.run_id, "run_nonce": self.cfg.train.run_nonce, "peer_id": self.peer_id(),
                     "worker": meta, "hash": self.worker.digest(), "saved_unix_s": time.time(),
                     "certificates": [c.to_json() for c in self.certificates[-4:]],
                     "run_config": public_dict(self.cfg)}  # what `swarmtrain export` rebuilds the model from
        path = await asyncio.to_thread(save_checkpoint, self.cfg.checkpoint.dir, tensors=tensors, meta=full_meta,
                                       keep=self.cfg.checkpoint.keep)
        self._saved.append(self.worker.round)
        return path

    def replay_from(self) -> int:
        """The round of the oldest checkpoint kept (a restart may fall back to it), else the worker's."""
        return self._saved[0] if self._saved else self.worker.round

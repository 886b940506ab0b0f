"""The outer rounds of one part of a pipelined model: DiLoCo among the peers that hold that part, run by the
round driver (driver/loop.py) as any DiLoCo worker's are: the same round machine, matchmaking, all-reduce,
decision among the part's voters, certificates and heals.

A stage's servers average their stage's blocks with the other servers of that stage only, and the trainers
the embeddings and head with the other trainers (a ScopedDiscovery per part and a scope of its own for the
decision: groups and voters never mix parts). Each holder keeps the part's θ_global and outer momentum; its
pseudo-gradient is Δ = θ_global − θ_local, and a committed round applies the outer optimizer to θ_global.

When. A holder's round is *trained* once it took `diloco.inner_steps` inner steps of its own since its last Δ,
or as soon as another holder announced (its record's `round_ends_at`) that its steps of the round have ended:
holders of a stage serve different shares of the trainers' micro-batches, so they step at different rates,
and waiting for each to reach H steps would spread their entries past the matchmaking window. The later ones
send a Δ of fewer steps instead. A holder alone in its part does not try. Δ is taken between two inner steps
(on the stepping thread, the weights still); a holder given `still` (a server the trainers route nothing to:
stopped, or avoided for a while) takes it itself, under `still`, once another holder's steps of the round are
over, so that it neither blocks the others nor goes stale.

Overlap. Inner steps go on while the round averages; the commit moves θ_local by what θ_global moved,
keeping the steps taken meanwhile: θ_local ← θ_local + (θ_global_new − θ_global_old + Δ). An aborted round's
Δ is averaged again (never retaken); its steps stay in θ_local.

Catching up is the driver's heal: a holder behind its part's holders learns their rounds from certificates,
or takes the state the certificate chain (or a strict majority of the holders ahead) vouches for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractContextManager

import torch

from swarmtrain.config import RunConfig
from swarmtrain.diloco.averager import AverageResult, ShardedMean
from swarmtrain.diloco.flat import assign_flat, combine_digest, flatten, pseudo_gradient, state_digest
from swarmtrain.diloco.outer import OuterOptimizer, count_non_finite
from swarmtrain.discovery import Discovery, PeerRecord
from swarmtrain.driver.loop import Behind, RoundDriver
from swarmtrain.driver.part import CommittedState, RoundPlane, Trained
from swarmtrain.driver.presence import Presence
from swarmtrain.round import Heal
from swarmtrain.round.ballots import Genesis, Value, Voter
from swarmtrain.round.certificate import Certificate, Retirement, Verify
from swarmtrain.round.group import Member
from swarmtrain.telemetry import HealEvent, StageRoundEvent

__all__ = ["PartRounds"]

log = logging.getLogger(__name__)

_RATE_EWMA = 0.2
_POLL_S = 0.05  # how often finish() looks whether the round in flight is done
KEPT_CERTIFICATES = 16


class _Part:
    """A pipeline part as the round driver's part (driver/part.py); see the module docstring."""

    def __init__(self, params: Sequence[torch.Tensor], *, discovery: Discovery, cfg: RunConfig, stage: int,
                 moving: Callable[[], AbstractContextManager[object]],
                 emit: Callable[[StageRoundEvent | HealEvent], None], apply_now: bool,
                 on_heal: Callable[[int], None] | None, still: Callable[[], AbstractContextManager[object]] | None,
                 clock: Callable[[], float]) -> None:
        self.params = list(params)
        self.discovery = discovery
        self.cfg = cfg
        self.stage = stage
        self.moving = moving
        self.emit = emit
        self.apply_now = apply_now
        self.on_heal = on_heal
        self.still = still
        self.clock = clock
        self.theta = flatten(self.params)
        self.outer = OuterOptimizer(cfg.outer, numel=self.theta.numel())
        self._round = 0
        self._voters: tuple[Voter, ...] = ()
        self.certificates: list[Certificate] = []
        self.version = 0
        self._digest = self._hash()
        self.steps = 0  # inner steps in θ_local that no Δ taken carries
        self.rate = 0.0  # inner steps a second (EWMA)
        self._last_step_at: float | None = None
        self._mu = threading.Lock()  # the step counters and the claimed Δ
        self._theta_lock = threading.Lock()  # θ_global and the momentum while they change or are served
        self._claimed: Trained | None = None  # a Δ taken between two steps, for the driver's Train
        self._want = False  # the driver waits for a Δ
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._busy = False  # a round in flight (trained, not concluded)
        self._steps_ended_at = 0.0  # swarm clock: when the steps of the round in flight ended
        self.others: tuple[PeerRecord, ...] = ()
        self._ready: tuple[Callable[[], None], asyncio.Future[None]] | None = None  # a result for settle()

    def _hash(self) -> str:
        return state_digest(self._round, self.theta, self.outer.momentum_buffer, self._voters)

    # -- the committed state ----------------------------------------------------------------------
    @property
    def round(self) -> int:
        return self._round

    @property
    def digest(self) -> str:
        return self._digest

    @property
    def voters(self) -> tuple[Voter, ...]:
        return self._voters

    def _state(self) -> CommittedState:
        return CommittedState(self._round, self.theta, self.outer.momentum_buffer, self._voters, self._digest,
                              tuple(self.certificates), self.version)

    @contextlib.contextmanager
    def committed(self) -> Iterator[CommittedState]:
        with self._theta_lock:
            yield self._state()

    # -- steps ------------------------------------------------------------------------------------
    def round_ends_at(self) -> float:
        """Swarm clock: when this holder expects its inner steps of this round to end (0 = unknown)."""
        with self._mu:
            if self._busy:
                return self._steps_ended_at
            left = max(0, self.cfg.diloco.inner_steps - self.steps)
            return self.discovery.now() + left / self.rate if self.rate > 0 else 0.0

    def stepped(self) -> None:
        """One inner step was taken (on the stepping thread, the weights still): maybe take the round's Δ now."""
        now = self.clock()
        with self._mu:
            if self._last_step_at is not None and now > self._last_step_at:
                rate = 1.0 / (now - self._last_step_at)
                self.rate = rate if not self.rate else (1 - _RATE_EWMA) * self.rate + _RATE_EWMA * rate
            self._last_step_at = now
            self.steps += 1
            if self._want and self._claimed is None and self._due():
                self._claim()

    def _due(self) -> bool:
        if len(self.others) + 1 < self.cfg.averaging.min_peers:
            return False
        if self.steps >= self.cfg.diloco.inner_steps:
            return True
        ends = [p.round_ends_at for p in self.others if p.round == self._round and p.round_ends_at > 0]
        return bool(ends) and min(ends) <= self.discovery.now()

    def _claim(self) -> None:
        """Under `_mu`, the weights still: take Δ and hand it to the driver's Train."""
        delta = pseudo_gradient(self.theta, self.params)
        steps, self.steps = self.steps, 0
        self._steps_ended_at = self.discovery.now()
        self._busy, self._want = True, False
        compute_s = steps / self.rate if self.rate > 0 else 0.0
        self._claimed = Trained(round=self._round, delta=delta, loss=float("nan"), compute_s=compute_s, steps=steps)
        self._loop.call_soon_threadsafe(self._wake.set)

    async def train(self, stop: asyncio.Event) -> Trained | None:
        """Until the round's Δ is taken (see the module docstring); Behind when the part's holders are past it."""
        with self._mu:
            self._claimed, self._want = None, True
        try:
            while True:
                await self._look()
                if any(p.round > self._round for p in self.others):
                    raise Behind(f"the part's holders are past round {self._round}")
                if self._claimed is None and self.still is not None:
                    await asyncio.to_thread(self._held_claim)
                if self._claimed is not None:
                    return self._claimed
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(_first(self._wake.wait(), stop.wait()),
                                           timeout=self.cfg.discovery.heartbeat_s)
                if stop.is_set():
                    return None
        finally:
            with self._mu:
                self._want = False

    def _held_claim(self) -> None:
        """An idle holder's own claim, under `still` (its weights held still without an inner step)."""
        assert self.still is not None
        with self._mu:
            if self._claimed is not None or not self._due():
                return
        with self.still(), self._mu:
            if self._claimed is None and self._due():  # again: a step may have taken it meanwhile
                self._claim()

    async def _look(self) -> None:
        try:
            peers = await self.discovery.live_peers(timeout_s=self.cfg.rpc.call_timeout_s)
        except Exception as e:  # a slow control plane: keep the last list
            log.info("part %s: could not list its holders (%s); keeping the last list", self.name, e)
            return
        self.others = tuple(p for p in peers if p.peer_id != self.discovery.peer_id)

    async def delta_problem(self, trained: Trained) -> str:
        bad = count_non_finite(trained.delta) if isinstance(trained.delta, torch.Tensor) else 0
        if bad:
            with self._mu:
                self._busy = False
            return f"non-finite pseudo-gradient: {bad} values are NaN or Inf"
        return ""

    # -- the outer step ---------------------------------------------------------------------------
    async def preview(self, mean: ShardedMean, next_voters: tuple[Voter, ...]) -> str:
        def locked() -> str:
            with self._theta_lock:
                ht, hm = self.outer.preview_pieces(self.theta, mean.pieces)
                return combine_digest(self._round + 1, self.theta.numel(), ht, hm, next_voters)
        return await asyncio.to_thread(locked)

    async def outcome_of(self, value: Value, mean: ShardedMean) -> str | None:
        def locked() -> str | None:
            with self._theta_lock:
                if self._digest != value.base:
                    return None
                ht, hm = self.outer.preview_pieces(self.theta, mean.pieces)
                return combine_digest(self._round + 1, self.theta.numel(), ht, hm, value.next_voters)
        return await asyncio.to_thread(locked)

    async def apply(self, result: AverageResult, *, own: Trained | None, comm_s: float = 0.0) -> None:
        assert result.committed and result.certificate is not None
        await self._run(functools_partial(self._apply_commit, result, own))

    def _apply_commit(self, result: AverageResult, own: Trained | None) -> None:
        assert result.certificate is not None
        value = result.certificate.value
        mean = result.mean
        with self.moving():
            with self._theta_lock:
                if value.base != self._digest:
                    raise ValueError(f"part {self.name}: round {value.round}'s value was averaged from state "
                                     f"{value.base[:12]}, this holder holds {self._digest[:12]}")
                before = self.theta.clone()
                if isinstance(mean, ShardedMean):
                    self.outer.step_pieces(self.theta, mean.pieces)
                else:
                    assert mean is not None
                    self.outer.step(self.theta, mean.reshape(-1))
                self._round, self._voters = value.round + 1, value.next_voters
                self.certificates = [*self.certificates[-(KEPT_CERTIFICATES - 1):], result.certificate]
                self._digest = self._hash()
                self.version += 1
                moved = self.theta - before  # what θ_global moved
            # θ_local keeps every step not in θ_global: with its Δ in the mean, the steps since Δ was taken
            # (θ_new + steps = θ_local + moved + Δ); without, all of them (θ_local + moved).
            shift = moved if own is None else moved + own.delta  # type: ignore[operator]
            with torch.no_grad():
                offset = 0
                for p in self.params:
                    n = p.numel()
                    p.add_(shift[offset:offset + n].view_as(p).to(p.dtype))
                    offset += n
        with self._mu:
            self._busy = False

    async def adopt(self, state: CommittedState, *, keep_progress: bool = False) -> None:
        await self._run(functools_partial(self._adopt, state))

    def _adopt(self, state: CommittedState) -> None:
        before = self._round
        with self.moving():
            with self._theta_lock:
                self.theta.copy_(state.theta_global)
                self.outer.load_state_tensors({} if state.outer_momentum is None
                                              else {"momentum": state.outer_momentum})
                self._round, self._voters = state.round, state.voters
                self.certificates = list(state.certificates)[-KEPT_CERTIFICATES:]
                self._digest = self._hash()
                self.version += 1
            assign_flat(self.theta, self.params)
            if self.on_heal is not None:
                self.on_heal(state.round)
        with self._mu:
            self.steps, self._busy = 0, False
        if self._digest != state.digest:
            raise ValueError(f"part {self.name}: the adopted state hashes to {self._digest[:12]}, not "
                             f"{state.digest[:12]}")
        log.debug("part %s: adopted round %d (was %d)", self.name, state.round, before)

    def replay_from(self) -> int:
        """A part keeps no checkpoint: a restarted holder heals from its part's holders."""
        return self._round

    def joined(self, round_index: int, round_ends_at: float | None) -> None:
        """A pipeline part's Δ is due when any holder's steps of the round are over (`_due`): nothing to do."""

    async def resync(self, reason: str) -> None:
        def resync() -> None:
            with self.moving():
                assign_flat(self.theta, self.params)
            with self._mu:
                self.steps, self._busy = 0, False
        await asyncio.to_thread(resync)
        log.warning("part %s: round %d aborted here (%s); θ_local restarts from θ_global", self.name, self._round,
                    reason)

    async def _run(self, work: Callable[[], None]) -> None:
        """`work` now, off the loop (a server: `apply_now`), or by the owner's next `settle()` (a trainer)."""
        if self.apply_now:
            await asyncio.to_thread(work)
            return
        done: asyncio.Future[None] = self._loop.create_future()
        self._ready = (work, done)
        await done

    async def settle(self) -> None:
        """Apply a decided round or heal now (an owner without `apply_now`, at a moment its weights are still)."""
        ready, self._ready = self._ready, None
        if ready is None:
            return
        work, done = ready
        try:
            await asyncio.to_thread(work)
        except Exception as e:
            done.set_exception(e)
            return
        done.set_result(None)

    async def report(self, trained: Trained | None, result: AverageResult, *, comm_s: float) -> None:
        if not result.committed:
            with self._mu:
                self._busy = False  # its Δ waits for the next attempt; the record says its steps went on
        self.emit(StageRoundEvent(stage=self.stage, round=result.round, committed=result.committed,
                                  members=result.members, hash=self._digest if result.committed else "",
                                  steps=trained.steps if trained is not None else 0, bytes_sent=result.bytes_sent,
                                  bytes_received=result.bytes_received, comm_s=round(comm_s, 4),
                                  peer=self.discovery.peer_id, reason=result.reason, at=time.time()))

    @property
    def name(self) -> str:
        return "ends" if self.stage < 0 else f"stage {self.stage}"


def functools_partial(fn: Callable[..., None], *args: object) -> Callable[[], None]:
    return lambda: fn(*args)


async def _first(*aws: Awaitable[object]) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


class PartRounds:
    """Outer rounds of the part whose parameters are `params`, through `plane` (its matchmaking on `discovery`,
    the part's scoped view), driven by a RoundDriver.

    `stepped()` after every inner step, on the thread that steps. `moving()` holds the calls off while a
    result moves the part's weights (a stage server: its compute lock, counted as a step). `still()`, where
    given, holds them still to take a Δ without a step (an idle holder; a trainer, which drives its own steps,
    gives none). With `apply_now`, results are applied as soon as they are in (on a worker thread, inside
    `moving()`); without, only when the owner calls `settle()` (a trainer, between its steps). `join()` before
    the first step (a heal check), `start()` to run the rounds, `aclose()` on leave. `on_heal(round)` runs
    inside `moving()` after a heal put θ_local at θ_global of `round`."""

    def __init__(self, params: Sequence[torch.Tensor], *, plane: RoundPlane, discovery: Discovery, cfg: RunConfig,
                 stage: int, moving: Callable[[], AbstractContextManager[object]],
                 emit: Callable[[StageRoundEvent | HealEvent], None], apply_now: bool, role: str, run: str,
                 verify: Verify, genesis: Callable[[], Awaitable[Genesis | None]], incarnation: Callable[[], int],
                 on_heal: Callable[[int], None] | None = None,
                 still: Callable[[], AbstractContextManager[object]] | None = None,
                 changed: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic) -> None:
        self.part = _Part(params, discovery=discovery, cfg=cfg, stage=stage, moving=moving, emit=emit,
                          apply_now=apply_now, on_heal=on_heal, still=still, clock=clock)
        self.plane = plane
        self.discovery = discovery
        self.cfg = cfg
        self.stage = stage
        self.presence = Presence(cfg.discovery, run_id=cfg.train.run_id, clock=asyncio.get_running_loop().time)
        part = self.part

        def member(trained: Trained) -> Member:
            return Member(peer_id=discovery.peer_id, endpoint=plane.endpoint, client_mode=cfg.discovery.client_mode,
                          steps_per_s=part.rate, state_hash=part.digest, incarnation=incarnation())

        self.driver = RoundDriver(part=part, plane=plane, discovery=discovery, cfg=cfg, role=role, member=member,
                                  run=run, verify=verify, presence=self.presence, genesis=genesis, emit=emit,
                                  changed=changed)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[str] | None = None
        plane.serve_state(part.committed)

    # -- what the record announces ----------------------------------------------------------------
    @property
    def round(self) -> int:
        return self.part.round

    @property
    def hash(self) -> str:
        return self.part.digest

    @property
    def version(self) -> int:
        return self.part.version

    @property
    def theta(self) -> torch.Tensor:
        return self.part.theta

    def round_ends_at(self) -> float:
        return self.part.round_ends_at()

    @property
    def idle(self) -> bool:
        """No round in flight: θ_global changes only when the part steps again (or a holder moves on)."""
        return not self.part._busy

    # -- the owner's calls ------------------------------------------------------------------------
    def stepped(self) -> None:
        self.part.stepped()

    async def settle(self) -> None:
        await self.part.settle()

    async def join(self) -> None:
        """Before the first step: the first heal check (the part's state from its holders, if they are ahead)."""
        action = self.driver.machine.next()
        assert isinstance(action, Heal), action
        await self.driver.heal(action)

    def start(self) -> None:
        """Run the part's rounds in the background until `aclose`."""
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> str:
        try:
            return await self.driver.run(self._stop)
        except Exception:
            log.exception("part %s: its rounds stopped on an error", self.part.name)
            raise

    def stop_following(self) -> None:
        """Start nothing more: no heal, no wait, no Δ averaged that is not yet; a round in flight goes on until it
        is decided (a server leaving its stage drains it meanwhile)."""
        self._stop.set()

    async def finish(self, *, timeout_s: float) -> None:
        """Wait (up to `timeout_s`) for the round in flight (a Δ taken) to be decided, applying it, then stop
        following: the last round before leaving. A round still undecided then is cancelled by `aclose`."""
        task = self._task
        deadline = time.monotonic() + timeout_s
        while task is not None and not task.done() and self.part._busy and time.monotonic() < deadline:
            await self.settle()
            await asyncio.wait({task}, timeout=_POLL_S)
        self._stop.set()
        await self.settle()

    async def aclose(self, *, retire: bool = False) -> list[Retirement]:
        """Stop the rounds (a round in flight is cancelled); with `retire`, this peer's voter of the part
        retires for good; every retirement it stored (for the departure record)."""
        self._stop.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if retire:
            with contextlib.suppress(Exception):
                return await self.driver.retire()  # naming the live holders at its round as successors
        return []

    def snapshot(self, *, momentum: bool = False) -> CommittedState:
        """A copy of this holder's θ_global, with its round, digest and voters (and with `momentum` the outer
        momentum)."""
        p = self.part
        with p._theta_lock:
            buf = p.outer.momentum_buffer
            return CommittedState(p.round, p.theta.clone(), buf.clone() if momentum and buf is not None else None,
                                  p.voters, p.digest, tuple(p.certificates), p.version)

    def adopt(self, theta: torch.Tensor, *, round: int, outer_momentum: torch.Tensor | None = None,
              voters: Sequence[Voter] = ()) -> None:
        """Before the first step of a server that took this stage (moved to it, rebuilt it): θ_global and θ_local
        become `theta`, at `round`, decided by `voters` (a move: the stage's; a rebuild: this server alone)."""
        p = self.part
        with p._theta_lock:
            p.theta.copy_(theta)
            p.outer.load_state_tensors({} if outer_momentum is None else {"momentum": outer_momentum})
            p._round, p._voters = round, tuple(voters)
            p._digest = p._hash()
            p.version += 1
        assign_flat(p.theta, p.params)
        with p._mu:
            p.steps = 0
        self.driver.restart_machine()  # its rounds go on from the adopted one

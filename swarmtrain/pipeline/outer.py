"""The outer rounds of one part of a pipelined model: DiLoCo among the peers that hold that part.

A stage's servers average their stage's blocks with the other servers of that stage only, and the
trainers the embeddings and head with the other trainers (a ScopedDiscovery per part: groups never
mix parts). Each holder keeps the part's θ_global and outer momentum; its pseudo-gradient is
Δ = θ_global − θ_local, and a committed round applies the outer optimizer to θ_global, as a DiLoCo
worker does (one hash per round and part: the holders of a part share θ_global).

When. A holder starts round r after `diloco.inner_steps` inner steps of its own since its last Δ, or
as soon as another holder of the part announced (its record's `round_ends_at`) that its steps of r
have ended: holders of a stage serve different shares of the trainers' micro-batches, so they step
at different rates, and waiting for each to reach H steps would spread their entries past the
matchmaking window. The later ones send a Δ of fewer steps instead. A holder alone in its part
(fewer live holders than `averaging.min_peers`) does not try. While its round is in flight a holder
announces the moment its steps ended, so the others still join that round's window.

Idle holders. A server the trainers route nothing to (it was stopped, or is avoided for a while) takes
no steps, and `stepped()` is never called; the holders waiting for it would fail their rounds for good
("too few peers") while its copy of the part goes stale. A holder given `hold` (its weights held
still without counting as an inner step) also starts from its follower loop, at the next heartbeat after
another holder announced its steps of the round over: it sends the Δ of the steps it has, none if it
served nothing (its weights as they are, which is what SWARM's plain averaging of a stage's copies
takes), and leaves the round at θ_global like the others.

Overlap. Inner steps go on while the round averages; the commit moves θ_local by what θ_global
moved, keeping the steps taken meanwhile: θ_local ← θ_local + (θ_global_new − θ_global_old + Δ).

Catching up. A holder that finds other holders past its round (it was stopped, partitioned, or its
group aborted while theirs committed), or whose round's group averaged from another θ_global, takes
θ_global and the outer momentum from them (the state transfer a DiLoCo worker heals with) and
resets θ_local to it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from swarmtrain.averaging.protocol import AverageResult, ShardedMean
from swarmtrain.config import RunConfig
from swarmtrain.diloco.flat import assign_flat, flat_hash, flatten, pseudo_gradient
from swarmtrain.diloco.outer import OuterOptimizer
from swarmtrain.discovery import Discovery, PeerRecord
from swarmtrain.peer.services import DataPlane, PeerState
from swarmtrain.telemetry import HealEvent, StageRoundEvent

__all__ = ["PartRounds"]

log = logging.getLogger(__name__)

_RATE_EWMA = 0.2
_POLL_S = 0.05  # how often finish() looks whether the round in flight is done


@dataclass
class _Commit:
    round: int
    result: AverageResult
    delta: torch.Tensor
    steps: int
    comm_s: float


@dataclass
class _Heal:
    state: PeerState
    donors: tuple[str, ...]
    transfer_s: float


class PartRounds:
    """Outer rounds of the part whose parameters are `params`, through `plane` (its matchmaking on `discovery`,
    the part's scoped view).

    `stepped()` after every inner step, on the thread that steps. `still()` holds the part's weights
    still while a round's result is applied (a stage server: its compute lock). `hold()`, where given,
    holds them still to take a Δ from the follower loop (an idle holder joining a round; a trainer, which
    drives its own steps, gives none). With `apply_now`, results
    are applied as soon as they are in (on a worker thread, inside `still()`); without, only when the
    owner calls `settle()` (a trainer, between its steps). Call `join()` before the first step and
    `start()` to follow the other holders; `aclose()` on leave. `on_heal(round)` runs inside `still()` after
    a heal put θ_local at θ_global of `round`.
    """

    def __init__(self, params: Sequence[torch.Tensor], *, plane: DataPlane, discovery: Discovery, cfg: RunConfig,
                 stage: int, still: Callable[[], AbstractContextManager[object]],
                 emit: Callable[[StageRoundEvent | HealEvent], None], apply_now: bool,
                 on_heal: Callable[[int], None] | None = None,
                 hold: Callable[[], AbstractContextManager[object]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.params = list(params)
        self.plane = plane
        self.discovery = discovery
        self.cfg = cfg
        self.stage = stage
        self.still = still
        self.emit = emit
        self.apply_now = apply_now
        self.on_heal = on_heal
        self.hold = hold
        self.clock = clock
        self.theta = flatten(self.params)
        # Made at the first commit or heal: its momentum buffer is the part's size again, all zeros until
        # then (a zero buffer and none step alike), and a server alone in its stage never needs it.
        self._outer: OuterOptimizer | None = None
        self.round = 0
        self.hash = flat_hash(self.theta)
        self.version = 0
        self.steps = 0  # inner steps in θ_local that no Δ sent carries
        self.rate = 0.0  # inner steps a second (EWMA)
        self._last_step_at: float | None = None
        self._mu = threading.Lock()  # `_busy` and the step counters
        self._theta_lock = threading.Lock()  # θ_global and the momentum while they change or are served
        self._busy = False  # a round or a heal in flight, or its result waiting for settle()
        self._steps_ended_at = 0.0  # swarm clock: when the steps of the round in flight ended (0: a heal)
        self._ready: _Commit | _Heal | None = None
        self._retry_at = 0.0  # swarm clock
        self._heal_to_hash = ""
        self._others: tuple[PeerRecord, ...] = ()  # the part's other live holders, as last read
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._follower: asyncio.Task[None] | None = None
        plane.serve_state(self._live)
        plane.publish_state(self._state())

    @property
    def outer(self) -> OuterOptimizer:
        """The part's outer optimizer (its momentum buffer is the outer state a heal carries)."""
        if self._outer is None:
            self._outer = OuterOptimizer(self.cfg.outer, numel=self.theta.numel())
        return self._outer

    # -- what the record announces ----------------------------------------------------------------
    def round_ends_at(self) -> float:
        """Swarm clock: when this holder expects its inner steps of this round to end (0 = unknown)."""
        with self._mu:
            if self._busy:
                return self._steps_ended_at
            left = max(0, self.cfg.diloco.inner_steps - self.steps)
            return self.discovery.now() + left / self.rate if self.rate > 0 else 0.0

    # -- the owner's calls ------------------------------------------------------------------------
    def stepped(self) -> None:
        """One inner step was taken (on the stepping thread, the part's weights still): maybe start a round."""
        now = self.clock()
        with self._mu:
            if self._last_step_at is not None and now > self._last_step_at:
                rate = 1.0 / (now - self._last_step_at)
                self.rate = rate if not self.rate else (1 - _RATE_EWMA) * self.rate + _RATE_EWMA * rate
            self._last_step_at = now
            self.steps += 1
            claim = self._claim()
        if claim is not None:
            self._launch(*claim)  # the weights are still: the caller steps them

    def _claim(self) -> tuple[int, int] | None:
        """Under `_mu`: if a round should start now, mark it in flight and take (round, steps) for its Δ."""
        if not self._should_start():
            return None
        self._busy = True
        self._steps_ended_at = self.discovery.now()
        steps, self.steps = self.steps, 0
        return self.round, steps

    def _launch(self, r: int, steps: int) -> None:
        """Take Δ (the weights held still by the caller) and average it on the event loop."""
        delta = pseudo_gradient(self.theta, self.params)
        self._loop.call_soon_threadsafe(self._spawn, self._average(r, delta, steps))

    def _should_start(self) -> bool:
        if self._busy or self.discovery.now() < self._retry_at:
            return False
        if len(self._others) + 1 < self.cfg.averaging.min_peers:
            return False
        if self.steps >= self.cfg.diloco.inner_steps:
            return True
        ends = [p.round_ends_at for p in self._others if p.round == self.round and p.round_ends_at > 0]
        return bool(ends) and min(ends) <= self.discovery.now()

    async def _maybe_join(self) -> None:
        """From the follower loop: start the round the part's other holders wait in, though this holder
        took no step since it last looked (it serves nothing now)."""
        hold = self.hold
        if hold is None:
            return
        with self._mu:
            if not self._should_start():
                return

        def held() -> None:
            with hold():
                with self._mu:
                    claim = self._claim()  # again: a step may have started the round meanwhile
                if claim is not None:
                    self._launch(*claim)

        await asyncio.to_thread(held)

    async def settle(self) -> None:
        """Apply a finished round or heal now (an owner without `apply_now`, at a moment its weights are still)."""
        ready, self._ready = self._ready, None
        if ready is not None:
            await asyncio.to_thread(self._apply_locked, ready)

    async def finish(self, *, timeout_s: float) -> None:
        """Wait (up to `timeout_s`) for the round in flight, then apply it: the last round before leaving."""
        deadline = self.clock() + timeout_s
        # busy: a round (or heal) in flight, including one `stepped()` has only scheduled so far
        while self._busy and self._ready is None and self.clock() < deadline:
            await asyncio.sleep(_POLL_S)
        await self.settle()

    async def join(self) -> None:
        """Before the first step: take θ_global from the part's holders if they are past round 0."""
        await self._read_others()
        if await self._maybe_heal():
            await self.finish(timeout_s=4 * self.cfg.rpc.call_timeout_s + 10.0)

    def snapshot(self, *, momentum: bool = False) -> PeerState:
        """A copy of this holder's θ_global, with its round and hash (and with `momentum` its outer momentum)."""
        with self._theta_lock:
            outer = self._outer.momentum_buffer if momentum and self._outer is not None else None
            return PeerState(round=self.round, theta_global=self.theta.clone(),
                             outer_momentum=None if outer is None else outer.clone(), state_hash=self.hash,
                             version=self.version)

    def adopt(self, theta: torch.Tensor, *, round: int, outer_momentum: torch.Tensor | None = None) -> None:
        """Before the first step of a server that took this stage (moved to it, rebuilt it): θ_global and
        θ_local become `theta`, at `round`, with `outer_momentum` (None: none, as for a lost stage's)."""
        with self._mu:
            assert not self._busy, "adopt() on a part with a round or heal in flight"
        with self._theta_lock:
            self.theta.copy_(theta)
            if outer_momentum is None:
                self._outer = None
            else:
                self.outer.load_state_tensors({"momentum": outer_momentum})
            self.round, self.hash = round, flat_hash(self.theta)
            self.version += 1
        assign_flat(self.theta, self.params)
        with self._mu:
            self.steps = 0
        self._retry_at, self._heal_to_hash = 0.0, ""
        self.plane.publish_state(self._state())

    def start(self) -> None:
        """Follow the part's other holders (their rounds and round ends) every `discovery.heartbeat_s`."""
        self._follower = asyncio.create_task(self._follow())

    async def aclose(self) -> None:
        """Stop following the part (no heal, no round started from the follower loop); again: nothing."""
        follower, self._follower = self._follower, None
        if follower is not None:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower

    # -- rounds and heals -------------------------------------------------------------------------
    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _average(self, r: int, delta: torch.Tensor, steps: int) -> None:
        start = self.clock()
        try:
            result = await self.plane.average(r, delta, steps_per_s=self.rate)
        except Exception as e:  # a local fault (a codec error, a closed node): this round aborts here
            log.exception("part %s: round %d failed here", self._part, r)
            result = AverageResult(round=r, committed=False, mean=None, reason=f"{type(e).__name__}: {e}")
        await self._finish(_Commit(r, result, delta, steps, self.clock() - start))

    async def _finish(self, outcome: _Commit | _Heal) -> None:
        if self.apply_now:
            await asyncio.to_thread(self._apply_locked, outcome)
        else:
            self._ready = outcome

    def _apply_locked(self, outcome: _Commit | _Heal) -> None:
        try:
            with self.still():
                if isinstance(outcome, _Commit):
                    self._apply_round(outcome)
                else:
                    self._apply_heal(outcome)
        finally:
            with self._mu:
                self._busy = False

    def _apply_round(self, c: _Commit) -> None:
        result = c.result
        if isinstance(result.mean, ShardedMean):  # a part is a fraction of the model: decode it whole
            result = dataclasses.replace(result, mean=result.mean.tensor())
        if result.committed and (result.mean is None or not bool(torch.isfinite(result.mean).all())):
            result = dataclasses.replace(result, committed=False, mean=None,
                                         reason="the group's mean is missing or holds NaN/Inf: not applied")
        if result.committed and result.mean is not None:
            with self._theta_lock:
                shift = c.delta.sub_(self.theta)  # Δ − θ_old, then + θ_new: what θ_global moved, plus Δ
                self.outer.step(self.theta, result.mean)
                shift.add_(self.theta)
                self.round, self.hash = c.round + 1, flat_hash(self.theta)
                self.version += 1
            with torch.no_grad():
                offset = 0
                for p in self.params:
                    n = p.numel()
                    p.add_(shift[offset:offset + n].view_as(p).to(p.dtype))
                    offset += n
            self.plane.publish_state(self._state())
            self._retry_at = 0.0
        else:
            with self._mu:
                self.steps += c.steps  # still in θ_local: the next Δ carries them
            self._retry_at = result.retry_at
            self._heal_to_hash = result.heal_to_hash
        self.emit(StageRoundEvent(stage=self.stage, round=c.round, committed=result.committed, members=result.members,
                                  hash=self.hash if result.committed else "", steps=c.steps,
                                  bytes_sent=result.bytes_sent, bytes_received=result.bytes_received,
                                  comm_s=round(c.comm_s, 4), peer=self.discovery.peer_id, reason=result.reason,
                                  at=time.time()))

    def _apply_heal(self, h: _Heal) -> None:
        state = h.state
        before = self.round
        with self._theta_lock:
            self.theta.copy_(state.theta_global)
            if state.outer_momentum is None:  # the donor's part never stepped (or has no momentum)
                self._outer = None
            else:
                self.outer.load_state_tensors({"momentum": state.outer_momentum})
            self.round, self.hash = state.round, flat_hash(self.theta)
            self.version += 1
        assign_flat(self.theta, self.params)
        if self.on_heal is not None:
            self.on_heal(state.round)
        with self._mu:
            self.steps = 0
        self._retry_at, self._heal_to_hash = 0.0, ""
        self.plane.publish_state(self._state())
        self.emit(HealEvent(from_round=before, to_round=state.round, source=",".join(h.donors), hash=self.hash,
                            peer=self.discovery.peer_id, transfer_s=round(h.transfer_s, 4)))

    async def _read_others(self) -> None:
        try:
            peers = await self.discovery.live_peers(timeout_s=self.cfg.rpc.call_timeout_s)
        except Exception as e:  # a slow control plane: keep the last list
            log.warning("part %s: could not list its holders (%s); keeping the last list", self._part, e)
            return
        self._others = tuple(p for p in peers if p.peer_id != self.discovery.peer_id)

    async def _maybe_heal(self) -> bool:
        """Take θ_global from holders past this round (or holding the hash a group averaged from); True if
        a heal is now applied or waiting for `settle()`."""
        with self._mu:
            if self._busy:
                return False
            want = self._heal_to_hash

            def ahead(p: PeerRecord) -> bool:
                return p.round > self.round or (bool(want) and p.state_hash == want and p.round >= self.round)

            donors = [p for p in self._others if p.endpoint and ahead(p)]
            if not donors:
                return False
            self._busy = True
            self._steps_ended_at = 0.0
        top = max(p.round for p in donors)
        hashes = collections.Counter(p.state_hash for p in donors if p.round == top)
        want = hashes.most_common(1)[0][0]
        chosen = [p for p in donors if p.round == top and p.state_hash == want][: self.cfg.rpc.state_donors]
        start = self.clock()
        try:
            state, served = await self.plane.fetch_state([p.endpoint for p in chosen])
            problem = ""
            if state.theta_global.numel() != self.theta.numel():
                problem = f"θ_global of {state.theta_global.numel()} values, this part holds {self.theta.numel()}"
            elif state.round != top or await asyncio.to_thread(flat_hash, state.theta_global) != want:
                problem = f"round {state.round} with another θ_global than the round {top}, {want[:12]} announced"
        except Exception as e:  # PeerError, a transfer error, a dead donor: try again on the next beat
            served, problem = (), str(e)
        if problem:
            log.warning("part %s: no θ_global from %s: %s", self._part, [p.peer_id for p in chosen], problem)
            with self._mu:
                self._busy = False
            return False
        source = tuple(p.peer_id for p in chosen if p.endpoint in served)
        await self._finish(_Heal(state, source, self.clock() - start))
        return True

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.discovery.heartbeat_s)
            await self._read_others()
            if await self._maybe_heal():
                log.info("part %s: behind its holders (round %d); healing", self._part, self.round)
            else:
                await self._maybe_join()

    # -- the state others take ----------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """No round or heal in flight: θ_global changes only when the part steps again (or a holder moves on)."""
        with self._mu:
            return not self._busy

    @property
    def _part(self) -> str:
        return "ends" if self.stage < 0 else f"stage {self.stage}"

    def _state(self) -> PeerState:
        momentum = None if self._outer is None else self._outer.momentum_buffer
        return PeerState(round=self.round, theta_global=self.theta, outer_momentum=momentum,
                         state_hash=self.hash, version=self.version)

    @contextlib.contextmanager
    def _live(self) -> Iterator[PeerState]:
        with self._theta_lock:
            yield self._state()

"""DilocoWorker: one peer's model, inner optimizer, data stream and θ_global, round by round."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn

from swarmtrain.compress.codec import Codec
from swarmtrain.config import RunConfig
from swarmtrain.diloco.averager import Averager, AverageResult, Delta, Previews, ShardedMean
from swarmtrain.diloco.eager import EagerScale, dot_with_mean
from swarmtrain.diloco.flat import (
    PseudoGradient,
    assign_flat,
    combine_digest,
    flat_hash,
    flatten,
    snapshot,
    state_digest,
)
from swarmtrain.diloco.fragments import Ranges, fragment_params, fragment_ranges
from swarmtrain.diloco.inner import (
    build_inner_optimizer,
    lr_factor,
    set_lr,
)
from swarmtrain.diloco.outer import STEP_SLICE, OuterOptimizer, count_non_finite
from swarmtrain.diloco.pace import RoundBudget
from swarmtrain.diloco.precision import Precision, forward_backward
from swarmtrain.diloco.spans import Fragment, Span, Whole
from swarmtrain.diloco.steps import BatchStream, Carry, DeltaError, InnerStats, InnerStep, RoundReport
from swarmtrain.diloco.worker_state import load_worker_state, save_worker_state
from swarmtrain.round.ballots import Voter

__all__ = ["BatchStream", "Carry", "DeltaError", "DilocoWorker", "InnerStats", "InnerStep", "RoundReport",
           "resolve_device", "resolve_round_device", "round_device_of"]

log = logging.getLogger(__name__)

PREVIEWS_KEPT = 8  # named means whose outer step's digests a worker remembers for its current state


def resolve_round_device(name: str, device: torch.device) -> torch.device:
    """`train.round_device` -> where θ_global and the round's arithmetic live: `train` = the training `device`."""
    if name == "train":
        return device
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"train.round_device: {name!r} is not 'train' or 'cpu'")


def round_device_of(cfg: RunConfig) -> torch.device:
    """Where a one-process worker of `cfg` runs its round (build its codec there)."""
    return resolve_round_device(cfg.train.round_device, resolve_device(cfg.train.device))


def resolve_device(name: str) -> torch.device:
    """`train.device` -> a torch device ("auto" = cuda when available, else cpu)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device: {name!r} requested but CUDA is not available")
    return device


class DilocoWorker:
    """Runs H inner steps, hands Δ = θ_global − θ_local to an Averager, applies the outer step.

    On an aborted round (`committed=False`) θ_global is kept, θ_local is reset to θ_global (the
    round's local progress is dropped, so the peer never drifts from the swarm's weights) and the
    round number stays; the inner optimizer's moments, the lr schedule and the data position keep
    going (data is not replayed). With `compress.error_feedback` the part of this peer's own Δ that
    the codec lost is added to its next committed round's Δ.

    For a local island, `forward_module` (e.g. `DistributedDataParallel(model)`) is what the inner
    steps call, `model` the module whose parameters form θ; `after_round(worker)` runs after every
    `apply` (e.g. to broadcast θ_global from local rank 0) and `adopt_global` installs a received θ.
    `on_step(InnerStep)` runs after every inner step (a progress display).
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        model: nn.Module,
        batches: BatchStream | Iterator[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device | None = None,
        codec: Codec | None = None,
        rng_seed: int = 0,
        forward_module: nn.Module | None = None,
        after_round: Callable[[DilocoWorker], None] | None = None,
        on_step: Callable[[InnerStep], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.device = device if device is not None else resolve_device(cfg.train.device)
        self.model = model.to(self.device)
        self.forward_module = forward_module if forward_module is not None else self.model
        if cfg.train.compile:
            self.forward_module = cast(nn.Module, torch.compile(self.forward_module))  # an OptimizedModule
        self.precision = Precision(cfg.train.precision, device=self.device)
        self.params: list[nn.Parameter] = list(self.model.parameters())
        self.batches = batches
        self.after_round = after_round
        self.on_step = on_step
        self.total_inner_steps = cfg.diloco.rounds * cfg.diloco.round_steps
        # θ_global, the outer momentum and the residual live where the round runs (train.round_device): on the
        # training GPU, Δ, the codec and the outer step run there and only encoded bytes cross to the host.
        self.round_device = resolve_round_device(cfg.train.round_device, self.device)
        self.theta_global = snapshot(self.params, device=self.round_device, pin=self.device.type == "cuda")
        self.numel = self.theta_global.numel()
        # Streaming DiLoCo (diloco.fragments > 1): round r syncs fragment r mod P; None = all of θ (classic)
        self.fragments = fragment_ranges(self.model, cfg.diloco.fragments) if cfg.diloco.fragments > 1 else None
        # What each round syncs (diloco/spans.py): all of θ, or round r's fragment, whose parameters alone it reads
        self._spans: list[Span] = ([Whole(self.params, self.numel)] if self.fragments is None
                                   else [Fragment(f, fragment_params(self.params, f)) for f in self.fragments])
        self.outer = OuterOptimizer(cfg.outer, numel=self.numel, device=self.round_device)
        if cfg.averaging.mode == "gossip" and self.outer.momentum_buffer is None:  # NoLoCo's b lives there
            self.outer.momentum_buffer = torch.zeros(self.numel, device=self.round_device)
        self.inner = build_inner_optimizer(self.model, cfg.inner)
        self.round = 0
        # Who decides the next round (round/ballots.py): the voters θ_global's commit named; empty before one (genesis).
        self.voters: tuple[Voter, ...] = ()
        self.inner_step = 0  # inner steps this worker took in all (statistics and checkpoints)
        self.round_step = 0  # inner steps taken at `round` (the schedule's position within the round)
        self._sent_early = False  # overlapped: Δ of `round` is out, and the steps now taken are round + 1's
        self._hash: tuple[int, str] | None = None  # (θ_global version, its hash): hashed once per change
        self._digest: tuple[int, str] | None = None  # (θ_global version, the state digest): likewise
        self._theta_version = 0
        self._previews = Previews(keep=PREVIEWS_KEPT)  # outer steps previewed from this state, by the mean's key
        self._local_version = 0  # changes with every change of θ_local (an inner step, an assignment)
        # Held while θ_global, the outer momentum, the round and the members change together (an outer
        # step, a heal, a resume): a reader holding it sees one committed state (e.g. a peer serving it).
        self.global_lock = threading.Lock()
        if cfg.compress.error_feedback and codec is None:
            raise ValueError("compress.error_feedback needs the codec the averager uses (codec=None given)")
        if codec is not None and torch.device(codec.device) != self.round_device:
            raise ValueError(f"the codec runs on {codec.device} but this worker's round runs on {self.round_device} "
                             f"(train.round_device={cfg.train.round_device!r}): build the codec on the round's device")
        self.codec = codec
        self.residual = torch.zeros(self.numel, device=self.round_device) if cfg.compress.error_feedback else None
        self._pending_residual: torch.Tensor | None = None
        self._eager = EagerScale()  # diloco.overlap: λ of the eager estimate, fitted from committed rounds
        self._rng_state = torch.Generator().manual_seed(rng_seed).get_state()

    # ------------------------------------------------------------------ the round

    def train_inner(self, num_steps: int | None = None, *, budget: RoundBudget | None = None,
                    interrupt: threading.Event | None = None, between: Callable[[], bool] | None = None,
                    ) -> InnerStats:
        """Run `num_steps` (default: a round's, `diloco.inner_steps / diloco.fragments`) inner steps on θ_local.

        With `budget` (a time-paced round, `diloco.pace`), each step is added to it and the call ends
        early once the budget has no step left; with `interrupt`, once it is set (checked after every
        step: an overlapped peer trains on until the swarm's mean lands). `between` runs after every
        step but the last (an overlapped peer applies the swarm's mean there); it ends the call by
        returning True, and its time counts neither in the stats' nor in the budget's compute. At
        least one step runs.
        """
        steps = self.cfg.diloco.round_steps if num_steps is None else num_steps
        if steps < 1:
            raise ValueError(f"train_inner: num_steps must be >= 1, got {steps}")
        self.forward_module.train()
        loss_sum = torch.zeros((), device=self.device)
        tokens = done = 0
        hooks_s = 0.0
        start = last = time.perf_counter()
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self._rng_state)
            while done < steps:
                before = loss_sum.clone() if self.on_step is not None else None
                step_tokens = self._inner_step(loss_sum)
                tokens += step_tokens
                done += 1
                if budget is not None and self.device.type == "cuda" and budget.span_s is not None:
                    torch.cuda.synchronize(self.device)  # the span is compute time, not queueing time
                now = time.perf_counter()
                if budget is not None:
                    budget.add(steps=1, compute_s=now - last)
                if before is not None:
                    self._report_step(loss_sum - before, tokens=step_tokens, step_s=now - last, budget=budget,
                                      call_steps=done, call_limit=steps, call_s=now - start)
                last = now
                if budget is not None and not budget.steps_left():
                    break
                if interrupt is not None and interrupt.is_set():
                    break
                if between is not None and done < steps:
                    ended = between()
                    last = time.perf_counter()
                    hooks_s += last - now
                    if ended or (budget is not None and not budget.steps_left()):
                        break
            self._rng_state = torch.get_rng_state()
        loss = float(loss_sum.item()) / done
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return InnerStats(steps=done, loss=loss, tokens=tokens, compute_s=time.perf_counter() - start - hooks_s)

    def _report_step(self, loss: torch.Tensor, *, tokens: int, step_s: float, budget: RoundBudget | None,
                     call_steps: int, call_limit: int, call_s: float) -> None:
        assert self.on_step is not None
        if budget is None:
            step, max_steps, span_s, compute_s = call_steps, call_limit, None, call_s
        else:
            step, max_steps, span_s, compute_s = budget.steps, budget.max_steps, budget.span_s, budget.compute_s
        self.on_step(InnerStep(round=self.round, step=step, max_steps=max_steps, span_s=span_s, compute_s=compute_s,
                               tokens=tokens, step_s=step_s, loss=loss))

    def _inner_step(self, loss_sum: torch.Tensor) -> int:
        x, y = next(self.batches)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        loss = forward_backward(self.forward_module, x, y, pass_size=self.cfg.data.pass_size, precision=self.precision)
        if self.cfg.inner.grad_clip > 0:
            self.precision.unscale_(self.inner)
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.inner.grad_clip)
        factor = lr_factor(self.schedule_step(), cfg=self.cfg.inner, total_steps=self.total_inner_steps)
        set_lr(self.inner, self.cfg.inner.lr * factor)
        self.precision.step(self.inner)
        self.inner.zero_grad(set_to_none=True)
        self._local_version += 1
        self.inner_step += 1
        self.round_step += 1
        loss_sum += loss.detach().float()
        return y.numel()

    def schedule_step(self) -> int:
        """The inner schedule's position: the swarm's progress, not this peer's step count.

        round × H + the steps taken at this round (H / P with fragments). Every peer at round r trains at the same
        learning rate whenever it joined or healed: a joiner at 80% of the run trains at the swarm's rate instead of
        warming up from the peak. With `diloco.pace = "time"` a fast peer takes more than H steps in a round; it holds
        the round's last rate (H − 1) instead of running ahead. A worker that never commits a round (the data-parallel
        baseline of `simulate`) walks the whole schedule.
        """
        h = self.cfg.diloco.round_steps
        step = self.round_step if self.cfg.diloco.pace == "steps" else min(self.round_step, h - 1)
        return (self.round + self._sent_early) * h + step

    def delta_problem(self, delta: Delta) -> str:
        """Why `delta` must not be sent ("" when it may): NaN or Inf from a diverged inner step."""
        # In slices: a mask of the whole Δ would be one more model-sized temporary (a quarter of fp32).
        read = delta.read if not isinstance(delta, torch.Tensor) else lambda lo, hi: delta[lo:hi]
        n = delta.numel()
        bad = sum(count_non_finite(read(lo, min(n, lo + STEP_SLICE))) for lo in range(0, n, STEP_SLICE))
        return f"non-finite pseudo-gradient: {bad} of {n} values are NaN or Inf" if bad else ""

    def _set_local(self, flat: torch.Tensor) -> None:
        """θ_local ← `flat` (a flat fp32 vector)."""
        self._set_params(self.params, flat)

    def _set_params(self, params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        """`params` (all of θ_local, or a fragment's) ← `flat`."""
        assign_flat(flat, params)
        self._local_version += 1

    def resync(self) -> None:
        """Drop this round's local progress after a local failure (a non-finite Δ, a codec error).

        θ_local restarts from θ_global; inner-optimizer moments and the error-feedback residual that
        hold NaN or Inf are reset (the swarm's weights are untouched: θ_global never took the bad Δ).
        """
        self._set_local(self.theta_global)
        self._pending_residual = None
        self._sent_early = False
        if self.residual is not None and not bool(torch.isfinite(self.residual).all()):
            self.residual.zero_()
        if any(not bool(torch.isfinite(v).all()) for st in self.inner.state.values() for v in st.values()
               if isinstance(v, torch.Tensor)):
            log.warning("inner optimizer state holds NaN/Inf after a failed round: starting it afresh")
            self.inner.state.clear()

    def fragment(self) -> Ranges | None:
        """The flat ranges this round syncs (diloco.fragments > 1), None for all of θ."""
        return None if self.fragments is None else self.fragments[self.round % len(self.fragments)]

    def span(self) -> Span:
        """What this round syncs: all of θ, or its fragment with diloco.fragments (diloco/spans.py)."""
        return self._spans[self.round % len(self._spans)]

    def delta(self) -> torch.Tensor:
        """This round's contribution: Δ = θ_global − θ_local (+ β × the error-feedback residual), of this
        round's fragment only with diloco.fragments (the fragment's values, in order)."""
        span = self.span()
        d = span.delta(self.theta_global)
        if self.residual is not None:
            assert self.codec is not None
            residual = span.part(self.residual)
            decay = self.cfg.compress.error_feedback_decay
            if decay == 1.0:
                d += residual
            else:  # SparseLoCo's decayed accumulator
                d.add_(residual, alpha=decay)
            # What the wire loses of our own contribution; adopted only if the round commits.
            self._pending_residual = d - self.codec.decode(self.codec.encode(d)).reshape(-1)
        return d

    def delta_source(self) -> torch.Tensor | PseudoGradient:
        """This round's Δ for a classic round: read a slice at a time from θ_global and θ_local when it
        is just their difference (no error-feedback residual, no fragments), so that no model-sized Δ
        is held while the round averages; `delta()` otherwise. Valid until θ_global or θ_local change
        (an inner step, an outer step, a heal): a read after that raises."""
        span = self.span()
        if self.residual is not None or not isinstance(span, Whole):
            return self.delta()
        return span.source(self.theta_global, version=lambda: (self._theta_version, self._local_version))

    def send_overlapped(self) -> tuple[torch.Tensor, Carry]:
        """`diloco.overlap`: this round's Δ, and θ_local moved to where θ_global lands if the mean is
        this peer's guess of it.

        DeltaError (θ_local untouched) when Δ holds NaN or Inf.

        The next round's inner steps start from that eager estimate of θ_global(new) (the outer
        step, momentum included, applied to the guess: `eager_scale()` × `own_contribution(Δ)`)
        instead of waiting for the swarm's mean; `apply(result, carry=...)` later shifts θ_local by
        the estimate's error, and fits the next guess's λ to the mean.
        """
        delta = self.delta()
        problem = self.delta_problem(delta)
        if problem:
            raise DeltaError(problem)
        sent = self.own_contribution(delta)
        span = self.span()  # its part of θ_local moves to the estimate; a fragment's others go on where they are
        on_abort = span.local(self.round_device)
        estimate = span.estimate(self.outer, self.theta_global, sent * self.eager_scale())
        self._set_params(span.params, estimate)
        carry = Carry(base=estimate, on_abort=on_abort, sent=sent)
        self._sent_early, self.round_step = True, 0
        return delta, carry

    def own_contribution(self, delta: torch.Tensor) -> torch.Tensor:
        """What of this round's `delta` (from `delta()`) enters the mean: Δ as the wire carries it with
        error feedback (the residual it leaves behind moves θ_global in no round yet), else Δ."""
        return delta if self._pending_residual is None else delta - self._pending_residual

    def eager_scale(self) -> float:
        """λ, the share of this peer's own contribution it expects in the round's mean (`diloco.eager`).

        `own`: 1 for a dense round (peers that trained from the same θ move it the same way), 1 / the
        group's size for a gathered (sparse) round (the members' kept positions mostly differ).
        `fitted` starts there and, from the first committed overlapped round on, uses λ fitted to the
        rounds this peer saw commit (swarmtrain/diloco/eager.py): neither guess is right for K peers
        whose Δs agree only in part.
        """
        gathered = self.residual is not None and self.cfg.averaging.gathers(self.cfg.compress.codec)
        own = 1.0 / max(1, len(self.voters)) if gathered else 1.0
        return own if self.cfg.diloco.eager == "own" else self._eager.value(own)

    def has_local_progress(self) -> bool:
        """Whether θ_local holds progress not yet in θ_global (trained since the last commit/heal)."""
        return not torch.equal(flatten(self.params, device=self.round_device), self.theta_global)

    def apply(self, result: AverageResult, *, carry: Carry | None = None) -> bool:
        """Apply a round's outcome; returns whether an outer step was taken.

        Classic DiLoCo (`carry` None): θ_local restarts from θ_global, committed or not.
        Overlapped (`carry` from `send_overlapped`): the inner steps taken since Δ was sent are
        kept, θ_local ← θ_global(new) + (θ_local − carry.base); on an abort θ_local goes back to
        carry.on_abort plus those steps, so the next attempt's Δ carries the whole progress.
        """
        if result.round != self.round:
            raise ValueError(f"averaging result is for round {result.round}, this worker is at round {self.round}")
        span = self.span()  # this round's, before it moves on
        if carry is not None and not carry.base.shape == carry.on_abort.shape == (span.size,):
            raise ValueError(f"apply: carry has shapes {tuple(carry.base.shape)}/{tuple(carry.on_abort.shape)}, "
                             f"need ({span.size},)")
        if result.committed:
            if result.mean is None:
                raise ValueError(f"round {result.round} committed without a mean pseudo-gradient")
            mean = result.mean
            with self.global_lock:
                span.step(self.outer, self.theta_global, mean)
                self._theta_version += 1
                if result.certificate is not None:
                    self.voters = result.certificate.value.next_voters
                self.round += 1
            if carry is not None and carry.sent is not None:
                self._eager.observe(carry.sent, dot_with_mean(carry.sent, mean))
            if self._pending_residual is not None:
                assert self.residual is not None
                self.residual = span.adopt(self.residual, self._pending_residual)
            if carry is None:  # overlapped, the steps taken since Δ was sent were already the new round's
                self.round_step = 0
        elif carry is None:
            log.warning("round %d aborted (%s): keeping θ_global, dropping local progress", result.round, result.reason)
        self._pending_residual = None
        self._sent_early = False
        # θ_local over the span restarts from θ_global; overlapped, the inner steps since Δ was sent go on top of
        # the new θ_global (or back where Δ was taken); a fragment's others keep their local progress
        theta = span.part(self.theta_global)
        if carry is not None:
            theta = (theta if result.committed else carry.on_abort) + (span.local(self.round_device) - carry.base)
        self._set_params(span.params, theta)
        if self.after_round is not None:
            self.after_round(self)
        return result.committed

    def gossip_step(self, step: Callable[[torch.Tensor], None]) -> None:
        """A gossip round's outer step (diloco/noloco.py): `step(θ_global)` moves θ_global (this peer's slow
        weights φ) in place; the round moves on and θ_local restarts from φ."""
        with self.global_lock:
            step(self.theta_global)
            self._theta_version += 1
            self.round += 1
        self.round_step = 0
        self._set_local(self.theta_global)
        if self.after_round is not None:
            self.after_round(self)

    def run_round(self, averager: Averager) -> RoundReport:
        """Inner steps, then average Δ through `averager`, then apply the outcome."""
        stats = self.train_inner()
        attempted = self.round
        start = time.perf_counter()
        result = averager.average(attempted, self.delta())
        comm_s = time.perf_counter() - start
        self.apply(result)
        return RoundReport(
            round=attempted, committed=result.committed, loss=stats.loss, tokens=stats.tokens,
            compute_s=stats.compute_s, comm_s=comm_s, bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received, members=result.members, hash=self.global_hash(),
            reason=result.reason,
        )

    # ------------------------------------------------------------------ evaluation and identity

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss of the current weights (= θ_global right after `apply`) on fixed batches."""
        if not batches:
            raise ValueError("evaluate: no validation batches given")
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for x, y in batches:
            with self.precision.autocast():
                _, loss = self.model(x.to(self.device), y.to(self.device))
            total += loss.float()
        return float(total.item()) / len(batches)

    def evaluate_global(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss of θ_global (θ_local differs from it under `diloco.overlap`); θ_local is restored."""
        local = flatten(self.params, device=self.device)
        self._set_local(self.theta_global)
        try:
            return self.evaluate(batches)
        finally:
            self._set_local(local)

    @property
    def theta_version(self) -> int:
        """Changes with every change of θ_global (an outer step, a heal, a resume)."""
        return self._theta_version

    def global_hash(self) -> str:
        """Hex sha256 of θ_global's fp32 bytes: committed peers must agree bit for bit.

        Hashed once per change of θ_global (an outer step, a heal, a resume) and cached: heartbeats,
        round lines and checkpoints read the cache. Safe to call from a worker thread right after a
        change, so that the hashing runs off the event loop.
        """
        version = self._theta_version
        cached = self._hash
        if cached is not None and cached[0] == version:
            return cached[1]
        digest = flat_hash(self.theta_global)
        self._hash = (version, digest)
        return digest

    def digest(self) -> str:
        """The committed state's digest (round, θ_global, outer momentum, voters: diloco.flat.state_digest),
        computed once per change of θ_global and cached; safe to call from a worker thread after a change."""
        version = self._theta_version
        cached = self._digest
        if cached is not None and cached[0] == version:
            return cached[1]
        digest = state_digest(self.round, self.theta_global, self.outer.momentum_buffer, self.voters)
        self._digest = (version, digest)
        return digest

    def preview(self, mean: ShardedMean | torch.Tensor, next_voters: Sequence[Voter]) -> str:
        """The digest of the committed state that `apply` of a commit with `mean` (naming `next_voters`) would
        leave, θ_global and the momentum untouched: the same slices through the same outer step, hashed as
        they are made (no model-sized copy)."""
        theta_digest, momentum_digest = self._previews.get(
            (self._theta_version, self.round), mean, lambda: self.span().preview(self.outer, self.theta_global, mean))
        return combine_digest(self.round + 1, self.numel, theta_digest, momentum_digest, next_voters)

    def adopt_global(self, *, round_index: int, theta_global: torch.Tensor, outer_momentum: torch.Tensor | None,
                     keep_progress: bool = False, voters: Sequence[Voter] = ()) -> None:
        """Install θ_global/outer momentum/round received from a peer (joining, healing, island broadcast).

        `voters`: who decides the next round (the state's voters; empty: the scope's genesis).

        θ_local restarts from the new θ_global, or with `keep_progress` (`diloco.overlap`, a peer one
        round late) keeps its unsent steps on top of it: θ_local ← θ_global(new) − (θ_global − θ_local).
        """
        if theta_global.shape != (self.numel,):
            raise ValueError(f"adopt_global: θ_global has shape {tuple(theta_global.shape)}, need ({self.numel},)")
        if round_index < 0:
            raise ValueError(f"adopt_global: round must be >= 0, got {round_index}")
        progress = flatten(self.params, device=self.round_device) - self.theta_global if keep_progress else None
        with self.global_lock:
            self.theta_global.copy_(theta_global.detach().to(torch.float32).reshape(-1))
            self._theta_version += 1
            self.outer.load_state_tensors({} if outer_momentum is None else {"momentum": outer_momentum})
            if round_index != self.round:
                self.round_step = 0
            self.round, self._sent_early = round_index, False
            self.voters = tuple(voters)
        self._pending_residual = None
        self._set_local(self.theta_global if progress is None else self.theta_global + progress)

    def discard_pending_residual(self) -> None:
        """The Δ just taken is not in the mean about to be applied: what the codec lost of it is no residual."""
        self._pending_residual = None

    def forget_residual(self) -> None:
        """After a heal: drop the error-feedback residual (the inner optimizer's moments are kept).

        The residual is what the codec lost of this peer's Δs in rounds the swarm went on without; it
        was measured against a θ_global the swarm no longer holds, and adding it to a later Δ would
        push stale progress into the mean. AdamW's moments describe the loss surface near θ_global
        and stay useful after a heal, so they are kept (a fresh joiner starts with none, and bias
        correction makes its first steps full-size at the swarm's learning rate).
        """
        if self.residual is not None:
            self.residual.zero_()
        self._pending_residual = None

    # ------------------------------------------------------------------ resumable state

    def state_dict(self, *, copy: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Everything needed to resume exactly: (tensors for safetensors, JSON-able metadata); see
        `worker_state.save_worker_state`. Without `copy` the tensors are the worker's own."""
        return save_worker_state(self, copy=copy)

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore a `state_dict()`; raises ValueError naming what does not fit this worker."""
        load_worker_state(self, tensors, meta)


"""A stage server's compute, without networking: forward, backward by recomputation, inner steps.

The forward keeps only the micro-batch's input (bounded by `max_contexts` and `context_ttl_s`); the
backward runs the stage's forward again on it with the weights of that moment and back-propagates
the trainer's gradient. So a server may step between a micro-batch's forward and its backward (its
weights change in place, which saved autograd tensors would not survive), and the gradient it
returns is exact for its weights at backward time; what the micro-batch saw downstream was computed
with the weights of forward time. That staleness is bounded: a backward whose forward ran more than
`max_stale_steps` steps ago is refused (StaleContext), and the trainer runs the forward again. An
outer step of the stage's round (or a heal: `moving()`) counts as a step here.

Gradients accumulate over backwards until `samples_per_step` samples are in; then the inner
optimizer steps (the run's AdamW and schedule, this part's own gradient clipping). Calls are
serialized by one lock: a CPU server computes one micro-batch at a time anyway.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from swarmtrain.config import InnerConfig, PipelineConfig
from swarmtrain.diloco.inner import build_inner_optimizer, lr_factor, set_lr
from swarmtrain.pipeline.errors import BadActivation, StaleContext, UnknownMicrobatch, WrongStage
from swarmtrain.pipeline.parts import Stage

__all__ = ["StageServer", "StageStats"]


@dataclass
class _Context:
    x: torch.Tensor
    seed: int
    moves: int  # inner and outer steps this server had taken at the forward
    born: float  # clock()


@dataclass(frozen=True)
class StageStats:
    """What a server reports of itself (records, step lines)."""

    stage: int
    step: int  # inner steps taken
    samples: int  # samples accumulated toward the next step
    forwards: int
    backwards: int
    contexts: int  # micro-batch inputs held
    refused: int  # calls answered with a typed error


class StageServer:
    def __init__(self, part: Stage, *, stage: int, pipeline: PipelineConfig, inner: InnerConfig,
                 total_steps: int, seq_len: int, clock: Callable[[], float] = time.monotonic,
                 on_step: Callable[[StageStats], None] | None = None) -> None:
        self.part = part
        self.stage = stage
        self.cfg = pipeline
        self.inner = inner
        self.total_steps = total_steps
        self.seq_len = seq_len
        self.clock = clock
        self.on_step = on_step
        self.optimizer = build_inner_optimizer(part, inner)
        self._lock = threading.Lock()
        self._contexts: collections.OrderedDict[str, _Context] = collections.OrderedDict()
        self.step = 0
        self.outer_moves = 0  # outer steps and heals applied (they move the weights as inner steps do)
        self.version = 0  # changes whenever the weights do (a step, an adoption, an outer step)
        self.samples = 0
        self.forwards = self.backwards = self.refused = 0
        part.train()
        set_lr(self.optimizer, inner.lr * lr_factor(0, cfg=inner, total_steps=total_steps))

    @contextlib.contextmanager
    def still(self) -> Iterator[None]:
        """Hold the part's weights still (no call runs meanwhile): a joiner's copy of them is taken inside."""
        with self._lock:
            yield

    @contextlib.contextmanager
    def moving(self) -> Iterator[None]:
        """Hold the calls off while the weights are moved from outside (an outer step, a heal): counted
        like an inner step against `max_stale_steps`."""
        with self._lock:
            yield
            self.outer_moves += 1
            self.version += 1

    def resume_at(self, step: int) -> None:
        """Take up the run's schedule at inner step `step` (a server that healed to its stage's round: call
        inside `moving()`)."""
        self.step = step
        set_lr(self.optimizer, self.inner.lr * lr_factor(step, cfg=self.inner, total_steps=self.total_steps))

    @property
    def _moves(self) -> int:
        return self.step + self.outer_moves

    def adopt(self, params: Mapping[str, torch.Tensor], *, step: int) -> None:
        """Take a live server's weights and step count (a server joining its stage); the optimizer's moments
        start afresh, and contexts from before are dropped."""
        with self._lock:
            own = self.part.state_dict()
            if set(params) != set(own) or any(params[k].shape != own[k].shape for k in own):
                raise ValueError(f"stage {self.stage}: the weights offered do not fit this part")
            self.part.load_state_dict(dict(params))
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer.state.clear()
            self.version += 1
            self._contexts.clear()
            self.step, self.samples = step, 0
            set_lr(self.optimizer, self.inner.lr * lr_factor(step, cfg=self.inner, total_steps=self.total_steps))

    def stats(self) -> StageStats:
        with self._lock:
            return StageStats(self.stage, self.step, self.samples, self.forwards, self.backwards,
                              len(self._contexts), self.refused)

    # -- checks ----------------------------------------------------------------------------------
    def _check(self, stage: int, x: torch.Tensor, what: str) -> None:
        if stage != self.stage:
            self.refused += 1
            raise WrongStage(f"{what} for stage {stage} reached a server of stage {self.stage}")
        c = self.part.shape.n_embd
        if x.dim() != 3 or x.shape[0] < 1 or x.shape[0] > self.cfg.microbatch_size or x.shape[2] != c \
                or not 1 <= x.shape[1] <= self.seq_len:
            self.refused += 1
            raise BadActivation(f"{what} of shape {tuple(x.shape)}: stage {self.stage} takes "
                                f"(1..{self.cfg.microbatch_size}, 1..{self.seq_len}, {c})")
        if x.dtype != torch.float32:
            self.refused += 1
            raise BadActivation(f"{what} of dtype {x.dtype}: stage {self.stage} takes float32")
        if not bool(torch.isfinite(x).all()):
            self.refused += 1
            raise BadActivation(f"{what} holds NaN or Inf")

    def _expire(self) -> None:
        now = self.clock()
        while self._contexts:
            mb, ctx = next(iter(self._contexts.items()))
            if now - ctx.born <= self.cfg.context_ttl_s and len(self._contexts) <= self.cfg.max_contexts:
                break
            del self._contexts[mb]

    # -- the calls -------------------------------------------------------------------------------
    def forward(self, stage: int, microbatch: str, x: torch.Tensor, *, seed: int) -> torch.Tensor:
        """The stage's output for input `x`; keeps `x` for the backward of `microbatch`."""
        with self._lock:
            self._check(stage, x, "forward input")
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                y = self.part(x)
            self._contexts.pop(microbatch, None)
            self._contexts[microbatch] = _Context(x, seed, self._moves, self.clock())
            self._expire()
            self.forwards += 1
            return y

    def backward(self, stage: int, microbatch: str, grad_y: torch.Tensor, *, samples: int) -> torch.Tensor:
        """The gradient w.r.t. the input of `microbatch`'s forward; accumulates this part's gradients
        and steps once `samples_per_step` samples are in."""
        with self._lock:
            self._check(stage, grad_y, "backward gradient")
            self._expire()
            ctx = self._contexts.pop(microbatch, None)
            if ctx is None:
                self.refused += 1
                raise UnknownMicrobatch(f"stage {self.stage} holds no forward of micro-batch {microbatch} (never "
                                        "seen, expired or evicted, or this server restarted)")
            if grad_y.shape != ctx.x.shape:
                self.refused += 1
                raise BadActivation(f"backward gradient of shape {tuple(grad_y.shape)} for a forward of "
                                    f"{tuple(ctx.x.shape)}")
            if self._moves - ctx.moves > self.cfg.max_stale_steps:
                self.refused += 1
                raise StaleContext(f"micro-batch {microbatch}'s forward ran {self._moves - ctx.moves} steps ago "
                                   f"(at most {self.cfg.max_stale_steps})")
            if not 1 <= samples <= ctx.x.shape[0]:
                self.refused += 1
                raise BadActivation(f"backward claims {samples} samples for a micro-batch of {ctx.x.shape[0]}")
            x = ctx.x.detach().requires_grad_(True)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(ctx.seed)
                y = self.part(x)
            y.backward(grad_y)
            assert x.grad is not None
            self.backwards += 1
            self.samples += samples
            if self.samples >= self.cfg.samples_per_step:
                self._step()
            return x.grad

    def _step(self) -> None:
        if self.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.part.parameters(), self.inner.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.version += 1
        self.samples -= self.cfg.samples_per_step
        set_lr(self.optimizer, self.inner.lr * lr_factor(self.step, cfg=self.inner, total_steps=self.total_steps))
        if self.on_step is not None:
            self.on_step(StageStats(self.stage, self.step, self.samples, self.forwards, self.backwards,
                                    len(self._contexts), self.refused))


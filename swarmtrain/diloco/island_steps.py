"""The inner steps of a local island (island.py): rank 0's `IslandWorker` leads, the `IslandFollower`s of the
other ranks mirror its steps, and `RankSlice` gives each rank its rows of the peer's batch.

The peer's batch of one island step is `data.batch_size` × ranks sequences, one window order for the whole
island (the stream a single process with that batch would read); rank r takes rows [r·B, (r+1)·B). DDP
averages the ranks' gradients before clipping and the optimizer step, so an island of N equals one process
with N× the batch up to floating-point summation order, and its data position (the island's steps) is
rank 0's alone: a checkpoint is rank 0's.

Before every inner step rank 0 sends the step's command; when θ_local changed since its last step (an outer
step, a heal, a resync, an overlapped landing) it first sends θ_local and its data position, and with them
the inner optimizer's state when that changed outside a step too (a resume, a reset after a non-finite
step). Between rounds (matchmaking, the all-reduce, a heal) `keepalive()` pings the followers, so that a
follower that waits for its next command waits at most the island's timeout for a live rank 0.

With FSDP rank 0 gathers θ_local whole from the shards (a collective, the `gather` command) only where
something reads it: at the end of each `train_inner` call and before its `between` hook (an overlapped
landing), not after every step. A step's own all-gathers move the weights once each way already; gathering
the whole model after each step too cost one more full all-gather per step.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from swarmtrain.config import RunConfig
from swarmtrain.data.sharding import ShardedBatches, take_windows
from swarmtrain.diloco.flat import assign_flat, flatten
from swarmtrain.diloco.inner import build_inner_optimizer, lr_factor, set_lr
from swarmtrain.diloco.island import Island, IslandError, IslandLost
from swarmtrain.diloco.island_shards import (
    full_optimizer_state,
    gather_full,
    load_sharded_optimizer_state,
    scatter_full,
    shard_model,
)
from swarmtrain.diloco.pace import RoundBudget
from swarmtrain.diloco.precision import Precision, forward_backward
from swarmtrain.diloco.steps import InnerStats
from swarmtrain.diloco.worker import DilocoWorker

__all__ = ["IslandFollower", "IslandWorker", "RankSlice"]

log = logging.getLogger(__name__)

PING_S = 10.0  # rank 0 idle this long (not training): it pings the followers


class RankSlice:
    """Rank `rank`'s rows of each batch of `stream` (whose batch is the whole island's): resumable like it."""

    def __init__(self, stream: ShardedBatches, *, rank: int, world_size: int) -> None:
        if stream.batch_size % world_size:
            raise IslandError(f"an island batch of {stream.batch_size} does not split over {world_size} ranks")
        self.stream, self.rank, self.world_size = stream, rank, world_size
        self.rows = stream.batch_size // world_size

    @property
    def position(self) -> int:
        return self.stream.position

    @position.setter
    def position(self, value: int) -> None:
        self.stream.position = value

    def __iter__(self) -> RankSlice:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.stream
        windows = s.windows_at(s.position)[self.rank * self.rows:(self.rank + 1) * self.rows]
        chunk = take_windows(s.tokens, windows * (s.seq_len + 1), s.seq_len + 1)
        s.position += 1
        return chunk[:, :-1], chunk[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)


class IslandWorker(DilocoWorker):
    """Rank 0's worker: a DilocoWorker whose inner steps go through DDP or FSDP (`train.parallel`) and lead the
    followers' (module docstring). DDP is built here (a collective).

    With FSDP the inner steps run on a sharded copy of `model` (its weights, gradients and the inner
    optimizer's moments 1/N per rank, island_shards.py), and `model` stays whole on this rank: what θ_local,
    Δ, evaluations and checkpoints read, gathered where it is read (module docstring); a checkpoint holds the
    inner optimizer's state whole, so it resumes on an island of any size or on one process."""

    batches: RankSlice

    def __init__(self, cfg: RunConfig, *, island: Island, model: nn.Module, batches: RankSlice,
                 **kwargs: Any) -> None:
        if not island.is_leader:
            raise IslandError(f"island rank {island.rank} runs an IslandFollower; only rank 0 leads")
        model = model.to(island.device)
        self.fsdp = cfg.train.parallel == "fsdp"
        sharded = shard_model(copy.deepcopy(model)) if self.fsdp else None
        super().__init__(cfg, model=model, batches=batches, device=island.device,
                         forward_module=sharded if sharded is not None else island.wrap(model), **kwargs)
        self.island = island
        self._lock = threading.Lock()  # one collective at a time: a step, a ping, the stop
        # DDP's constructor gave every rank this θ_local; sharded copies take it at the first step
        self._synced = -1 if self.fsdp else self._local_version
        self._inner_changed = False  # the inner optimizer's state changed outside a step
        self._full_inner: dict[str, Any] | None = None  # FSDP: a whole optimizer state to shard at the next sync
        self._whole_behind = False  # FSDP: steps moved the shards since θ_local's whole copy was gathered
        self.sharded: list[torch.Tensor] = []
        if sharded is not None:
            self.sharded = list(sharded.parameters())
            self.inner = build_inner_optimizer(sharded, cfg.inner)
        self._last_s = time.monotonic()
        self.stopped = False

    def train_inner(self, num_steps: int | None = None, *, budget: RoundBudget | None = None,
                    interrupt: threading.Event | None = None, between: Callable[[], bool] | None = None,
                    ) -> InnerStats:
        """As a DilocoWorker's; with FSDP θ_local's whole copy is gathered once the steps end and before each
        `between` (which reads and may move θ_local), not after every step."""
        if not self.fsdp:
            return super().train_inner(num_steps, budget=budget, interrupt=interrupt, between=between)
        hook = between

        def gathered_first() -> bool:
            assert hook is not None
            self.gather_whole()
            return hook()

        stats = super().train_inner(num_steps, budget=budget, interrupt=interrupt,
                                    between=None if hook is None else gathered_first)
        self.gather_whole()
        return stats

    def gather_whole(self) -> None:
        """FSDP: θ_local's whole copy from the shards when steps moved them since (a collective)."""
        with self._lock:
            self._gather_whole_locked()

    def _gather_whole_locked(self) -> None:
        if not self._whole_behind:
            return
        if self.stopped:
            raise IslandLost("the island was stopped")
        self._send(("gather",))
        with self.island.collective("gathering θ_local"):
            gather_full(self.sharded, self.params)
        self._whole_behind = False
        self._last_s = time.monotonic()

    def _set_params(self, params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        """As a DilocoWorker's; with FSDP the whole copy is brought up to the shards first (a fragment's write
        leaves the rest of θ_local as the steps left it, and the next step scatters all of it)."""
        if self.fsdp:
            self.gather_whole()
        super()._set_params(params, flat)

    def _inner_step(self, loss_sum: torch.Tensor) -> int:
        with self._lock:
            if self.stopped:
                raise IslandLost("the island was stopped")
            if self._local_version != self._synced or self._inner_changed:
                self._gather_whole_locked()  # a no-op: whatever set θ_local gathered it first (_set_params)
                self._send_sync()
            lr = self.cfg.inner.lr * lr_factor(self.schedule_step(), cfg=self.cfg.inner,
                                               total_steps=self.total_inner_steps)
            self._send(("step", lr))
            with self.island.collective("an inner step"):
                tokens = self._sharded_step(loss_sum, lr) if self.fsdp else super()._inner_step(loss_sum)
            self._synced, self._last_s = self._local_version, time.monotonic()
            return tokens

    def _sharded_step(self, loss_sum: torch.Tensor, lr: float) -> int:
        """One inner step on the shards (what the followers' `_step` does too); θ_local's whole copy is behind."""
        x, y = next(self.batches)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        loss = forward_backward(self.forward_module, x, y, pass_size=self.cfg.data.pass_size, precision=self.precision)
        _optimizer_step(self.cfg, self.inner, self.precision, self.sharded, lr)
        self._whole_behind = True
        self._local_version += 1
        self.inner_step += 1
        self.round_step += 1
        loss_sum += loss.detach().float()
        return y.numel()

    def _send(self, command: tuple[Any, ...]) -> None:
        self.island.broadcast_object(command)

    def _send_sync(self) -> None:
        inner = "load" if self._inner_changed else ""
        if self.fsdp and self._inner_changed and self._full_inner is None:
            inner = "clear"
        self._send(("sync", {"position": self.batches.position, "inner": inner}))
        flat = flatten(self.params)
        self.island.broadcast_(flat)
        if self.fsdp:
            scatter_full(flat, self.sharded, rank=0, world_size=self.island.world_size)
        if inner == "load":
            state = self._full_inner if self.fsdp else self.inner.state_dict()
            self.island.broadcast_object({"inner": state, "scaler": self.precision.state()})
            if self.fsdp:
                assert state is not None
                load_sharded_optimizer_state(self.inner, state, rank=0, world_size=self.island.world_size)
        elif inner == "clear":
            self.inner.state.clear()
        self._inner_changed, self._full_inner = False, None

    def resync(self) -> None:
        if not self.fsdp:
            super().resync()
        else:  # the moments are sharded: the whole island starts them afresh (checked here, they would be
            # read on this rank alone, a collective the others do not join)
            self._set_local(self.theta_global)
            self._pending_residual = None
            self._sent_early = False
            if self.residual is not None and not bool(torch.isfinite(self.residual).all()):
                self.residual.zero_()
        self._inner_changed = True  # moments that held NaN or Inf may have been reset

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        if not self.fsdp:
            super().load_state_dict(tensors, meta)
        else:  # the checkpoint's optimizer state is whole: loaded into a whole one, sharded at the next step
            whole, sharded = build_inner_optimizer(self.model, self.cfg.inner), self.inner
            self.inner = whole
            try:
                super().load_state_dict(tensors, meta)
            finally:
                self.inner = sharded
            self._full_inner = whole.state_dict()
        self._inner_changed = True

    def state_dict(self, *, copy: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """As a DilocoWorker's; with FSDP the inner optimizer's state gathered whole first (a collective)."""
        if not self.fsdp:
            return super().state_dict(copy=copy)
        with self._lock:
            self._gather_whole_locked()
            self._send(("gather_inner",))
            with self.island.collective("gathering the inner optimizer's state"):
                full = full_optimizer_state(self.inner)
            self._last_s = time.monotonic()
        whole, sharded = build_inner_optimizer(self.model, self.cfg.inner), self.inner
        whole.load_state_dict(full)
        self.inner = whole
        try:
            return super().state_dict(copy=True)
        finally:
            self.inner = sharded

    def keepalive(self) -> None:
        """Ping the followers when rank 0 has not trained for `PING_S` (called between rounds, off the loop)."""
        if not self._lock.acquire(blocking=False):
            return  # a step or the stop is under way: that is a sign of life too
        try:
            if not self.stopped and time.monotonic() - self._last_s >= PING_S:
                self._send(("ping",))
                self._last_s = time.monotonic()
        finally:
            self._lock.release()

    def stop_island(self, reason: str) -> None:
        """The peer left: tell the followers to exit (once; a follower already gone is logged)."""
        with self._lock:
            if self.stopped:
                return
            self.stopped = True
            try:
                self._send(("stop", reason))
            except IslandLost as e:
                log.warning("could not tell the island's other ranks to stop: %s", e)


class IslandFollower:
    """A rank > 0: the same model and inner optimizer as rank 0's, stepping when told (module docstring)."""

    def __init__(self, cfg: RunConfig, *, island: Island, model: nn.Module, batches: RankSlice) -> None:
        if island.is_leader:
            raise IslandError("island rank 0 leads (IslandWorker); it does not follow")
        self.cfg, self.island, self.batches = cfg, island, batches
        self.fsdp = cfg.train.parallel == "fsdp"
        self.model = model.to(island.device)
        self.module = shard_model(self.model) if self.fsdp else island.wrap(self.model)
        self.params = list(self.model.parameters())  # with FSDP: this rank's shards
        if cfg.train.compile:
            self.module = cast(nn.Module, torch.compile(self.module))  # an OptimizedModule
        self.inner = build_inner_optimizer(self.model, cfg.inner)
        self.precision = Precision(cfg.train.precision, device=island.device)
        self.steps = 0

    def run(self) -> str:
        """Follow rank 0 until it says stop; returns its reason. Raises IslandLost when rank 0 is gone."""
        self.module.train()
        while True:
            command = self.island.broadcast_object(None)
            kind = command[0]
            if kind == "step":
                self._step(float(command[1]))
            elif kind == "sync":
                self._sync(command[1])
            elif kind == "gather":
                with self.island.collective("gathering θ_local"):
                    gather_full(self.params, None)  # rank 0 gathers θ_local whole: every rank takes part
            elif kind == "gather_inner":
                with self.island.collective("gathering the inner optimizer's state"):
                    full_optimizer_state(self.inner)
            elif kind == "stop":
                log.info("island rank %d: rank 0 stopped the island (%s) after %d steps", self.island.rank,
                         command[1], self.steps)
                return str(command[1])
            elif kind != "ping":
                raise IslandError(f"island rank {self.island.rank}: unknown command {kind!r} from rank 0")

    def _step(self, lr: float) -> None:
        x, y = next(self.batches)
        device = self.island.device
        with self.island.collective("an inner step"):
            forward_backward(self.module, x.to(device), y.to(device), pass_size=self.cfg.data.pass_size,
                             precision=self.precision)
            _optimizer_step(self.cfg, self.inner, self.precision, self.params, lr)
        self.steps += 1

    def _sync(self, info: dict[str, Any]) -> None:
        flat = torch.empty(sum(p.numel() for p in self.params), dtype=torch.float32)
        self.island.broadcast_(flat)
        if self.fsdp:
            scatter_full(flat, self.params, rank=self.island.rank, world_size=self.island.world_size)
        else:
            assign_flat(flat, self.params)
        self.batches.position = int(info["position"])
        if info["inner"] == "load":
            state = self.island.broadcast_object(None)
            if self.fsdp:
                load_sharded_optimizer_state(self.inner, state["inner"], rank=self.island.rank,
                                             world_size=self.island.world_size)
            else:
                self.inner.load_state_dict(state["inner"])
            self.precision.load_state(state["scaler"])
        elif info["inner"] == "clear":
            self.inner.state.clear()


def _optimizer_step(cfg: RunConfig, optimizer: torch.optim.Optimizer, precision: Precision,
                    params: Sequence[torch.Tensor], lr: float) -> None:
    """Clip (over the sharded parameters: a collective with FSDP), set the step's rate, step, zero."""
    if cfg.inner.grad_clip > 0:
        precision.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, cfg.inner.grad_clip)
    set_lr(optimizer, lr)
    precision.step(optimizer)
    optimizer.zero_grad(set_to_none=True)

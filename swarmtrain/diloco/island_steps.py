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
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
from torch import nn

from swarmtrain.config import RunConfig
from swarmtrain.data.sharding import ShardedBatches, take_windows
from swarmtrain.diloco.flat import assign_flat, flatten
from swarmtrain.diloco.inner import build_inner_optimizer, lr_factor, set_lr
from swarmtrain.diloco.island import Island, IslandError, IslandLost
from swarmtrain.diloco.precision import Precision, forward_backward
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
    """Rank 0's worker: a DilocoWorker whose inner steps go through DDP and lead the followers' (module
    docstring). `model` must be on the island's device; DDP is built here (a collective)."""

    def __init__(self, cfg: RunConfig, *, island: Island, model: nn.Module, batches: RankSlice,
                 **kwargs: Any) -> None:
        if not island.is_leader:
            raise IslandError(f"island rank {island.rank} runs an IslandFollower; only rank 0 leads")
        model = model.to(island.device)
        super().__init__(cfg, model=model, batches=batches, device=island.device, forward_module=island.wrap(model),
                         **kwargs)
        self.island = island
        self._lock = threading.Lock()  # one collective at a time: a step, a ping, the stop
        self._synced = self._local_version  # DDP's constructor gave every rank this θ_local
        self._inner_changed = False  # the inner optimizer's state changed outside a step
        self._last_s = time.monotonic()
        self.stopped = False

    def _inner_step(self, loss_sum: torch.Tensor) -> int:
        with self._lock:
            if self.stopped:
                raise IslandLost("the island was stopped")
            if self._local_version != self._synced or self._inner_changed:
                self._send_sync()
            lr = self.cfg.inner.lr * lr_factor(self.schedule_step(), cfg=self.cfg.inner,
                                               total_steps=self.total_inner_steps)
            self._send(("step", lr))
            with self.island.collective("an inner step"):
                tokens = super()._inner_step(loss_sum)
            self._synced, self._last_s = self._local_version, time.monotonic()
            return tokens

    def _send(self, command: tuple[Any, ...]) -> None:
        self.island.broadcast_object(command)

    def _send_sync(self) -> None:
        with_inner = self._inner_changed
        self._send(("sync", {"position": self.batches.position, "inner": with_inner}))  # type: ignore[attr-defined]
        self.island.broadcast_(flatten(self.params))
        if with_inner:
            self.island.broadcast_object({"inner": self.inner.state_dict(), "scaler": self.precision.state()})
        self._inner_changed = False

    def resync(self) -> None:
        super().resync()
        self._inner_changed = True  # moments that held NaN or Inf may have been reset

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        super().load_state_dict(tensors, meta)
        self._inner_changed = True

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
        self.model = model.to(island.device)
        self.params = list(self.model.parameters())
        self.module = island.wrap(self.model)
        if cfg.train.compile:
            self.module = torch.compile(self.module)
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
        if self.cfg.inner.grad_clip > 0:
            self.precision.unscale_(self.inner)
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.inner.grad_clip)
        set_lr(self.inner, lr)
        self.precision.step(self.inner)
        self.inner.zero_grad(set_to_none=True)
        self.steps += 1

    def _sync(self, info: dict[str, Any]) -> None:
        flat = torch.empty(sum(p.numel() for p in self.params), dtype=torch.float32)
        self.island.broadcast_(flat)
        assign_flat(flat, self.params)
        self.batches.position = int(info["position"])
        if info["inner"]:
            state = self.island.broadcast_object(None)
            self.inner.load_state_dict(state["inner"])
            self.precision.load_state(state["scaler"])

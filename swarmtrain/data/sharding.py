"""Deterministic, disjoint, resumable batches: worker k of K never sees another worker's windows."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from swarmtrain.data.order import FeistelPermutation
from swarmtrain.data.shards import ShardStream

__all__ = ["ShardedBatches", "eval_batches", "take_windows"]

Tokens = torch.Tensor | ShardStream


def take_windows(tokens: Tokens, starts: torch.Tensor, length: int) -> torch.Tensor:
    """(len(starts), length) int64 tokens of a stream, row i from token starts[i] on."""
    if isinstance(tokens, ShardStream):
        return torch.from_numpy(tokens.windows(starts.numpy(), length))
    return tokens[starts[:, None] + torch.arange(length)[None, :]].long()


class ShardedBatches:
    """Batches of (x, y) windows from one token stream, sharded by worker index.

    The stream is cut into non-overlapping windows of `seq_len + 1` tokens. Each epoch the window
    order is a seeded permutation; global batch slot `s` of step `t` takes window
    `perm[(t * num_workers * batch_size) + k * batch_size + s]` for worker `k`, so the K workers'
    batches at one step are disjoint and together equal one data-parallel batch of K×B.
    `position` (steps taken) is the only state, so resuming is exact. Shards on disk are ordered by a
    Feistel permutation computed window by window (data/order.py), which needs no memory; in-memory tensors
    by `torch.randperm`.
    """

    def __init__(
        self,
        tokens: Tokens,
        *,
        worker_index: int,
        num_workers: int,
        batch_size: int,
        seq_len: int,
        seed: int,
        position: int = 0,
    ) -> None:
        if not 0 <= worker_index < num_workers:
            raise ValueError(f"worker_index {worker_index} is not in [0, num_workers={num_workers})")
        self.num_windows = (tokens.numel() - 1) // (seq_len + 1)
        self.steps_per_epoch = self.num_windows // (num_workers * batch_size)
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"corpus of {tokens.numel()} tokens has {self.num_windows} windows of {seq_len + 1}; "
                f"need >= {num_workers * batch_size} (num_workers x batch_size)"
            )
        self.tokens = tokens
        self.worker_index = worker_index
        self.num_workers = num_workers
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.position = position
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)
        self._lazy = isinstance(tokens, ShardStream)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_windows, generator=g)
            self._perm_epoch = epoch
        return self._perm

    def windows_at(self, step: int) -> torch.Tensor:
        """Indices of the windows this worker reads at `step`, shape (batch_size,)."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        start = (in_epoch * self.num_workers + self.worker_index) * self.batch_size
        if self._lazy:
            perm = FeistelPermutation(self.num_windows, seed=self.seed * 1_000_003 + epoch)
            return torch.from_numpy(perm(np.arange(start, start + self.batch_size)))
        return self._permutation(epoch)[start : start + self.batch_size]

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = take_windows(self.tokens, self.windows_at(step) * (self.seq_len + 1), self.seq_len + 1)  # (B, T+1)
        return chunk[:, :-1], chunk[:, 1:]

    def __iter__(self) -> ShardedBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch

    # A position only means the same batches for the same stream and layout, so all of it is checked.
    _IDENTITY = ("seed", "worker_index", "num_workers", "batch_size", "seq_len", "num_windows")

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, **{key: getattr(self, key) for key in self._IDENTITY}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in (*self._IDENTITY, "position"):
            if key not in state:
                raise ValueError(f"data state has no {key!r} (saved by an older version?)")
        for key in self._IDENTITY:
            if state[key] != getattr(self, key):
                raise ValueError(f"data state was saved with {key}={state[key]}, this stream has {getattr(self, key)}")
        if not isinstance(state["position"], int) or state["position"] < 0:
            raise ValueError(f"data state position {state['position']!r} is not an int >= 0")
        self.position = state["position"]


def eval_batches(tokens: Tokens, *, batch_size: int, seq_len: int,
                 num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed, evenly spread set of validation batches (the same on every worker)."""
    num_windows = (tokens.numel() - 1) // (seq_len + 1)
    total = min(num_windows, batch_size * num_batches)
    if total < 1:
        raise ValueError(f"validation stream of {tokens.numel()} tokens is shorter than one window of {seq_len + 1}")
    starts = torch.linspace(0, num_windows - 1, total).long() * (seq_len + 1)
    chunk = take_windows(tokens, starts, seq_len + 1)
    return [(c[:, :-1], c[:, 1:]) for c in chunk.split(batch_size)]

"""The outer optimizer: SGD (optionally Nesterov) on θ_global with the averaged Δ as gradient."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import blake3
import torch

from swarmtrain.compress.staging import hash_into
from swarmtrain.config import OuterConfig

__all__ = ["OuterOptimizer", "count_non_finite"]


STEP_SLICE = 1 << 20  # values per slice of the outer step (4 MiB of fp32)


class OuterOptimizer:
    """`torch.optim.SGD(lr, momentum, nesterov, dampening=0, weight_decay=0)` on one flat fp32 vector.

    Written out rather than wrapping `torch.optim.SGD` so that the only state is one explicit
    momentum buffer (a flat tensor on θ's device that checkpoints and state transfer can carry as-is). A
    zero buffer reproduces torch's first step (which sets buf = grad).

    Every operation is one correctly rounded fp32 multiply or add (never `add(x, alpha=a)`, which a CPU's
    vector unit or a GPU's compiler may fuse into one FMA and round once): the result is the same bits on
    any IEEE machine, so a peer whose round runs on a GPU and one whose round runs on a CPU agree on θ_global.
    """

    def __init__(self, cfg: OuterConfig, *, numel: int, device: torch.device | str = "cpu") -> None:
        if numel < 1:
            raise ValueError(f"OuterOptimizer: numel must be >= 1, got {numel}")
        self.cfg = cfg
        self.numel = numel
        self.device = torch.device(device)
        self.momentum_buffer: torch.Tensor | None = (torch.zeros(numel, device=self.device) if cfg.momentum > 0
                                                     else None)

    def step(self, theta: torch.Tensor, grad: torch.Tensor) -> None:
        """θ ← θ − lr·(g + μ·buf) for Nesterov (buf ← μ·buf + g first), θ ← θ − lr·buf for heavy ball."""
        if theta.shape != (self.numel,) or grad.shape != (self.numel,):
            raise ValueError(
                f"outer step: theta shape {tuple(theta.shape)} and grad shape {tuple(grad.shape)} "
                f"must both be ({self.numel},)"
            )
        grad = grad.to(device=theta.device, dtype=torch.float32)
        # Element-wise, so done in slices: the same bits as one pass, with temporaries of one slice
        # instead of the model's size (a peer of 1B parameters would need 8 GB more at every commit).
        if count_non_finite(grad):
            raise ValueError("outer step: the averaged pseudo-gradient contains NaN/Inf")
        self._apply(theta, grad, 0)

    def step_pieces(self, theta: torch.Tensor, pieces: Callable[[], Iterable[tuple[int, torch.Tensor]]]) -> None:
        """`step(theta, grad)` with grad given as (offset, values) pieces that cover it once, in order.

        `pieces()` is called twice (a ShardedMean decodes its shards again each time): first every
        piece is checked, so that θ and the momentum change only if the whole gradient is finite;
        then each is applied. The same bits as `step` on the assembled gradient."""
        if theta.shape != (self.numel,):
            raise ValueError(f"outer step: theta shape {tuple(theta.shape)} must be ({self.numel},)")
        at = 0
        for lo, grad in pieces():
            if lo != at or grad.dim() != 1 or lo + grad.numel() > self.numel:
                raise ValueError(f"outer step: a piece of {grad.numel()} values at {lo} does not follow value {at}")
            if count_non_finite(grad):
                raise ValueError("outer step: the averaged pseudo-gradient contains NaN/Inf")
            at = lo + grad.numel()
        if at != self.numel:
            raise ValueError(f"outer step: the pieces cover {at} of {self.numel} values")
        for lo, grad in pieces():
            self._apply(theta, grad.to(device=theta.device, dtype=torch.float32), lo)

    def preview_pieces(self, theta: torch.Tensor,
                       pieces: Callable[[], Iterable[tuple[int, torch.Tensor]]]) -> tuple[bytes, bytes | None]:
        """The BLAKE3 digests of θ and of the momentum buffer (None without one) as `step_pieces(theta, pieces)`
        would leave them, neither changed: the same slices through the same operations, on copies of one slice
        at a time, so the digests are those of the step's bits (a round's value names its result before it
        commits)."""
        if theta.shape != (self.numel,):
            raise ValueError(f"outer step: theta shape {tuple(theta.shape)} must be ({self.numel},)")
        hashes = (blake3.blake3(), None if self.momentum_buffer is None else blake3.blake3())
        at = 0
        for lo, grad in pieces():
            if lo != at or grad.dim() != 1 or lo + grad.numel() > self.numel:
                raise ValueError(f"outer step: a piece of {grad.numel()} values at {lo} does not follow value {at}")
            if count_non_finite(grad):
                raise ValueError("outer step: the averaged pseudo-gradient contains NaN/Inf")
            self._apply(theta, grad.to(device=theta.device, dtype=torch.float32), lo, into=hashes)
            at = lo + grad.numel()
        if at != self.numel:
            raise ValueError(f"outer step: the pieces cover {at} of {self.numel} values")
        return hashes[0].digest(), None if hashes[1] is None else hashes[1].digest()

    def _apply(self, theta: torch.Tensor, grad: torch.Tensor, offset: int,
               into: tuple[blake3.blake3, blake3.blake3 | None] | None = None) -> None:
        """The update of θ[offset : offset + len(grad)] and its momentum, in slices of STEP_SLICE; with `into`,
        of copies of each slice, whose bytes go to those hashes instead."""
        buf = self.momentum_buffer
        for lo in range(0, grad.numel(), STEP_SLICE):
            g = grad[lo:lo + STEP_SLICE]
            t = theta[offset + lo:offset + lo + g.numel()]
            b = None if buf is None else buf[offset + lo:offset + lo + g.numel()]
            if into is not None:
                t, b = t.clone(), None if b is None else b.clone()
            if b is None:
                step = g.mul(self.cfg.lr)
            else:
                b.mul_(self.cfg.momentum).add_(g)
                step = b.mul(self.cfg.momentum).add_(g) if self.cfg.nesterov else b.mul(self.cfg.lr)
                if self.cfg.nesterov:
                    step.mul_(self.cfg.lr)
            t.sub_(step)  # θ − lr·(g + μ·buf): each product and sum rounded on its own
            if into is not None:
                hash_into(into[0], t)
                if b is not None and into[1] is not None:
                    hash_into(into[1], b)

    def preview(self, theta: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """θ after `step(theta, grad)`, as a new tensor; neither `theta` nor the momentum buffer change."""
        saved = self.momentum_buffer
        self.momentum_buffer = None if saved is None else saved.clone()
        out = theta.detach().to(torch.float32).clone()
        try:
            self.step(out, grad)
        finally:
            self.momentum_buffer = saved
        return out

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.momentum_buffer is None else {"momentum": self.momentum_buffer}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.momentum_buffer is None:
            if tensors:
                raise ValueError(f"outer state has {sorted(tensors)} but outer.momentum is 0")
            return
        buf = tensors.get("momentum")
        if buf is None or buf.shape != (self.numel,):
            got = None if buf is None else tuple(buf.shape)
            raise ValueError(f"outer momentum buffer must have shape ({self.numel},), got {got}")
        self.momentum_buffer = buf.detach().to(device=self.device, dtype=torch.float32, copy=True)


def count_non_finite(t: torch.Tensor) -> int:
    """How many values of `t` are NaN or ±Inf, checked in slices (no model-sized mask).

    A slice's sum is finite when all its values are (NaN and Inf carry through a sum; +Inf with −Inf
    gives NaN), so the mask is built only for a slice whose sum is not: one that holds a non-finite
    value, or whose finite values overflow fp32 when added. One pass over clean data instead of a
    mask, a reduction and a pass over the mask (an overlapped round checks Δ and the mean this way
    between two inner steps).
    """
    bad = 0
    for lo in range(0, t.numel(), STEP_SLICE):
        part = t[lo:lo + STEP_SLICE]
        if not bool(torch.isfinite(part.sum())):
            bad += int((~torch.isfinite(part)).sum())
    return bad

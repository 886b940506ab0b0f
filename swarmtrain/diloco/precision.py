"""How an inner step computes: `train.precision` (autocast dtype, fp16's gradient scaler) and micro-batches.

Weights, gradients, optimizer states and θ_global stay fp32 whatever the setting: autocast only runs the
matrix products (and what torch lists with them) in the lower precision. fp16's narrow range needs the
loss scaled up before the backward; a step whose unscaled gradients hold Inf or NaN is skipped and the
scale halved (torch's GradScaler), so a peer never sends a Δ poisoned by an fp16 overflow.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["Precision", "forward_backward"]

log = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """The arithmetic of `train.precision` on `device`: `autocast()`, `backward(loss)`, `step(optimizer)`."""

    def __init__(self, name: str, *, device: torch.device) -> None:
        if name == "auto":
            name = "bf16" if device.type == "cuda" else "fp32"
        if name not in ("fp32", *_DTYPES):
            raise ValueError(f"train.precision: {name!r} is not auto, fp32, bf16 or fp16")
        self.name = name
        self.device_type = device.type
        self.dtype = _DTYPES.get(name)
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None
        log.info("inner steps in %s on %s%s", name, device, " with a gradient scaler" if self.scaler else "")

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients at their true size (before clipping them)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)  # skipped when the gradients hold Inf/NaN
        self.scaler.update()

    def state(self) -> dict[str, Any] | None:
        return None if self.scaler is None else dict(self.scaler.state_dict())

    def load_state(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def forward_backward(module: nn.Module, x: torch.Tensor, y: torch.Tensor, *, pass_size: int,
                     precision: Precision) -> torch.Tensor:
    """A step's gradients, in passes of `pass_size` sequences (`data.micro_batch_size`; one pass when it
    covers the batch); returns the batch's mean loss. Each pass's loss is weighted by its share of the batch,
    so the gradients add up to the whole batch's, whatever the split."""
    if pass_size >= x.shape[0]:
        with precision.autocast():
            _, loss = module(x, y)
        precision.backward(loss)
        return loss.detach()
    total = torch.zeros((), device=x.device)
    starts = range(0, x.shape[0], pass_size)
    for i, lo in enumerate(starts):
        last = i == len(starts) - 1
        # A local island's DDP all-reduces once, after the last pass
        no_sync: Callable[[], contextlib.AbstractContextManager[None]] | None = getattr(module, "no_sync", None)
        sync = contextlib.nullcontext() if last or no_sync is None else no_sync()
        with sync:
            with precision.autocast():
                _, loss = module(x[lo:lo + pass_size], y[lo:lo + pass_size])
            part = loss * (min(pass_size, x.shape[0] - lo) / x.shape[0])
            precision.backward(part)
        total += part.detach().float()
    return total

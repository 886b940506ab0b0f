"""Parameters <-> one flat fp32 vector, the pseudo-gradient Δ = θ_global − θ_local, and θ's hash."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch

__all__ = ["assign_flat", "flat_hash", "flatten", "pseudo_gradient", "snapshot"]


def flatten(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """Concatenate `params` (any device/dtype) into a new flat fp32 CPU vector."""
    parts = [p.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for p in params]
    if not parts:
        raise ValueError("flatten: no parameters given")
    return torch.cat(parts)


def snapshot(params: Iterable[torch.Tensor], *, pin: bool) -> torch.Tensor:
    """θ_global's storage: a flat fp32 CPU copy of `params`, page-locked when `pin` (for fast H2D copies)."""
    flat = flatten(params)
    return flat.pin_memory() if pin else flat


def assign_flat(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Copy a flat vector back into `params` in place (casting to each parameter's dtype/device)."""
    total = sum(p.numel() for p in params)
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"flat vector has shape {tuple(flat.shape)}; the parameters need ({total},)")
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p), non_blocking=flat.is_pinned())
            offset += n
    if flat.is_pinned() and any(p.is_cuda for p in params):
        torch.cuda.synchronize()  # the pinned source may be overwritten by the next outer step


def pseudo_gradient(theta_global: torch.Tensor, params: Iterable[torch.Tensor]) -> torch.Tensor:
    """Δ = θ_global − θ_local in fp32: the direction the outer optimizer *descends* along.

    H inner steps move θ_local downhill, so Δ points uphill like a gradient; the outer step
    θ_global ← θ_global − lr·Δ (momentum aside) moves θ_global towards the workers' mean θ_local.
    """
    # One new vector, the result: each parameter is subtracted from its slice in place, instead of
    # first concatenating θ_local into a second model-sized temporary.
    delta = theta_global.detach().to(device="cpu", dtype=torch.float32, copy=True)
    offset = 0
    for p in params:
        n = p.numel()
        delta[offset:offset + n].sub_(p.detach().reshape(-1).to(device="cpu", dtype=torch.float32))
        offset += n
    if offset != delta.numel():
        raise ValueError(f"pseudo_gradient: the parameters hold {offset} values, θ_global {delta.numel()}")
    return delta


def flat_hash(flat: torch.Tensor) -> str:
    """Hex sha256 of a flat fp32 vector's bytes: equal hashes mean bit-identical weights."""
    if flat.dtype != torch.float32 or flat.dim() != 1:
        raise ValueError(f"flat_hash needs a 1-D fp32 tensor, got {flat.dtype} with shape {tuple(flat.shape)}")
    # hashlib reads the array's buffer in place (no copy of θ) and releases the GIL while it hashes.
    return hashlib.sha256(flat.detach().cpu().contiguous().numpy()).hexdigest()

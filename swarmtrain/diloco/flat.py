"""Parameters <-> one flat fp32 vector, the pseudo-gradient Δ = θ_global − θ_local, and θ's hash."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterable, Sequence

import blake3
import torch

from swarmtrain.compress.staging import hash_into

__all__ = ["PseudoGradient", "assign_flat", "combine_digest", "flat_hash", "flatten", "param_shapes", "pseudo_gradient",
           "snapshot", "state_digest", "tensor_digest"]


def param_shapes(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """`module`'s (name, shape) of every parameter, in θ's flat order (what named state transfer sends)."""
    return [(name, tuple(p.shape)) for name, p in module.named_parameters()]


def flatten(params: Iterable[torch.Tensor], *, device: torch.device | str = "cpu") -> torch.Tensor:
    """Concatenate `params` (any device/dtype) into a new flat fp32 vector on `device`."""
    parts = [p.detach().reshape(-1).to(device=device, dtype=torch.float32) for p in params]
    if not parts:
        raise ValueError("flatten: no parameters given")
    return torch.cat(parts)


def snapshot(params: Iterable[torch.Tensor], *, device: torch.device, pin: bool) -> torch.Tensor:
    """θ_global's storage: a flat fp32 copy of `params` on `device` (the round's device); in host memory, page-locked
    when `pin` (for fast copies to a GPU that trains)."""
    flat = flatten(params, device=device)
    return flat.pin_memory() if pin and flat.device.type == "cpu" else flat


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
    # first concatenating θ_local into a second model-sized temporary (PseudoGradient.read, whole).
    return PseudoGradient(theta_global, list(params), version=lambda: 0).read(0, theta_global.numel())


class PseudoGradient:
    """Δ = θ_global − θ_local read a slice at a time, never held as one model-sized vector.

    `read(lo, hi)` returns a new fp32 vector on θ_global's device equal to `pseudo_gradient(θ_global, params)[lo:hi]`
    to the bit (each value is the same one fp32 subtraction). The source is only valid while neither
    θ_global nor the parameters change: `version()` (a counter the owner bumps at every change) is
    taken here and checked at every read, and a read after a change raises instead of mixing weights.
    """

    def __init__(self, theta_global: torch.Tensor, params: Sequence[torch.Tensor], *,
                 version: Callable[[], object]) -> None:
        self._theta, self._params, self._version = theta_global, list(params), version
        self._taken_at = version()
        self._ends: list[int] = []
        offset = 0
        for p in self._params:
            offset += p.numel()
            self._ends.append(offset)
        if offset != theta_global.numel():
            raise ValueError(f"pseudo_gradient: the parameters hold {offset} values, θ_global {theta_global.numel()}")

    def numel(self) -> int:
        return self._theta.numel()

    def read(self, lo: int, hi: int) -> torch.Tensor:
        if not 0 <= lo <= hi <= self.numel():
            raise IndexError(f"PseudoGradient.read: [{lo}, {hi}) is not within [0, {self.numel()})")
        if self._version() != self._taken_at:
            raise RuntimeError("PseudoGradient.read: θ_global or θ_local changed since this Δ was taken")
        device = self._theta.device
        out = self._theta[lo:hi].detach().to(dtype=torch.float32, copy=True)
        start = 0
        for p, end in zip(self._params, self._ends, strict=True):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                out[a - lo:b - lo].sub_(p.detach().reshape(-1)[a - start:b - start]
                                        .to(device=device, dtype=torch.float32))
            if end >= hi:
                break
            start = end
        return out


def flat_hash(flat: torch.Tensor) -> str:
    """Hex sha256 of a flat fp32 vector's bytes: equal hashes mean bit-identical weights."""
    if flat.dtype != torch.float32 or flat.dim() != 1:
        raise ValueError(f"flat_hash needs a 1-D fp32 tensor, got {flat.dtype} with shape {tuple(flat.shape)}")
    # hashlib reads a CPU array's buffer in place (no copy of θ) and releases the GIL while it hashes; a GPU's
    # θ streams through one page-locked buffer a slice at a time.
    h = hashlib.sha256()
    hash_into(h, flat)
    return h.hexdigest()


def tensor_digest(t: torch.Tensor) -> bytes:
    """BLAKE3 of a flat fp32 vector's bytes (one part of a state digest), on any device: a GPU's vector is
    hashed a slice at a time as it reaches the host."""
    h = blake3.blake3()
    hash_into(h, t)
    return h.digest()


def combine_digest(round_index: int, numel: int, theta: bytes, momentum: bytes | None,
                   voters: Sequence[tuple[str, int]]) -> str:
    """A state digest from its parts' digests (`tensor_digest` of θ_global and of the momentum)."""
    h = blake3.blake3(b"swarmtrain/state\0")
    h.update(struct.pack("<qq", round_index, numel))
    h.update(theta)
    h.update(b"\0" if momentum is None else b"\1" + momentum)
    h.update(json.dumps([[p, int(i)] for p, i in voters], separators=(",", ":")).encode())
    return h.hexdigest()


def state_digest(round_index: int, theta: torch.Tensor, momentum: torch.Tensor | None,
                 voters: Sequence[tuple[str, int]]) -> str:
    """The digest of a committed state: (round, θ_global, outer momentum, the round's voters), hex BLAKE3.

    What peer records and match entries announce, a round's value names as its result, and a heal checks a
    download against: equal digests mean the same round, bit-identical weights and momentum, and the same
    voters. BLAKE3 (a cryptographic hash, a few GB/s on one core) because it covers two model-sized vectors
    at every commit."""
    for name, t in (("θ", theta), ("momentum", momentum)):
        if t is not None and (t.dtype != torch.float32 or t.dim() != 1):
            raise ValueError(f"state_digest: {name} must be a 1-D fp32 tensor, got {t.dtype} {tuple(t.shape)}")
    return combine_digest(round_index, theta.numel(), tensor_digest(theta),
                          None if momentum is None else tensor_digest(momentum), voters)

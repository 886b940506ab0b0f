"""Device tensors to host bytes through pinned, reused buffers (a GPU-resident round's only crossing).

A round that runs on a GPU (`train.round_device = "train"`) keeps θ_global, Δ and the decoded means there;
what crosses to the host is the codec's output (to be sent) and the bytes a digest hashes. `host_bytes`
copies a device tensor into this thread's page-locked arena (one DMA, no driver bounce buffer) and gives a
view of it; the views stay valid until the thread's current `arena()` block ends, so an encode can stage
all its parts and frame them once. `host_chunks` streams a device tensor's bytes a slice at a time through
one reused page-locked buffer (hashing θ_global never copies it whole). CPU tensors are viewed in place.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Protocol

import torch

__all__ = ["CHUNK_BYTES", "Hasher", "arena", "hash_into", "host_bytes", "host_chunks"]

CHUNK_BYTES = 1 << 24  # bytes per slice streamed by host_chunks (16 MiB)

_local = threading.local()


def _pinned(nbytes: int) -> torch.Tensor:
    """A page-locked byte buffer where CUDA can pin one, else an ordinary one."""
    pin = torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class _Arena:
    """A thread's bump allocator over page-locked buffers, emptied when its outermost `arena()` block ends."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.index = 0  # the buffer being filled
        self.used = 0  # bytes taken from it
        self.depth = 0

    def take(self, nbytes: int) -> torch.Tensor:
        while self.index < len(self.buffers):
            buf = self.buffers[self.index]
            if buf.numel() - self.used >= nbytes:
                out = buf[self.used:self.used + nbytes]
                self.used += nbytes
                return out
            self.index, self.used = self.index + 1, 0
        size = max(nbytes, 2 * sum(b.numel() for b in self.buffers), 1 << 20)
        self.buffers.append(_pinned(size))
        self.used = nbytes
        return self.buffers[-1][:nbytes]

    def reset(self) -> None:
        if len(self.buffers) > 1:  # next time, one buffer that holds all of this time's parts
            total = sum(b.numel() for b in self.buffers)
            self.buffers = [_pinned(total)]
        self.index = self.used = 0


def _arena() -> _Arena:
    held: _Arena | None = getattr(_local, "arena", None)
    if held is None:
        held = _local.arena = _Arena()
    return held


@contextlib.contextmanager
def arena() -> Iterator[None]:
    """A block within which `host_bytes` views stay valid (blocks nest; the outermost one frees them)."""
    a = _arena()
    a.depth += 1
    try:
        yield
    finally:
        a.depth -= 1
        if a.depth == 0:
            a.reset()


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of `t` (made contiguous, flattened) in host memory: a view of a CPU tensor's own memory, or of
    a copy of a device tensor in this thread's page-locked arena (inside an `arena()` block, valid until it
    ends)."""
    t = t.detach().contiguous().view(-1)
    if t.numel() == 0:
        return memoryview(b"")
    raw = t.view(torch.uint8)
    if t.device.type == "cpu":
        return raw.numpy().data
    a = _arena()
    if a.depth == 0:
        raise RuntimeError("host_bytes of a device tensor outside an arena() block")
    out = a.take(raw.numel())
    out.copy_(raw)  # synchronous: the view is read as soon as it is returned
    return out.numpy().data


def host_chunks(t: torch.Tensor, *, chunk_bytes: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """`t`'s bytes (contiguous, in order) as host views of at most `chunk_bytes` each: a CPU tensor's in place, a
    device tensor's through one reused page-locked buffer, each view valid until the next is asked for."""
    if chunk_bytes < 1:
        raise ValueError(f"host_chunks: chunk_bytes must be >= 1, got {chunk_bytes}")
    flat = t.detach().contiguous().view(-1).view(torch.uint8)
    if flat.numel() == 0:
        return
    step = min(chunk_bytes, flat.numel())
    if flat.device.type == "cpu":
        for lo in range(0, flat.numel(), step):
            yield flat[lo:lo + step].numpy().data
        return
    with arena():
        buf = _arena().take(step)
        for lo in range(0, flat.numel(), step):
            part = flat[lo:lo + step]
            out = buf[:part.numel()]
            out.copy_(part)
            yield out.numpy().data


class Hasher(Protocol):
    """What `hash_into` feeds: hashlib's and blake3's objects."""

    def update(self, data: memoryview, /) -> object: ...


def hash_into(h: Hasher, t: torch.Tensor) -> None:
    """`h.update` with `t`'s bytes (contiguous, in order), from any device: a CPU tensor's in place, a device
    tensor's through `host_chunks` (θ_global on a GPU is never copied to the host whole)."""
    if t.device.type == "cpu":  # one view, no generator: the outer step hashes many small slices
        flat = t.detach().contiguous().view(-1)
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy().data)
        return
    for chunk in host_chunks(t):
        h.update(chunk)

"""BufferPool: payload-sized receive buffers reused across rounds instead of fresh pages.

A fresh 25 MB buffer costs the kernel a zeroing page fault per 4 KiB page, and glibc hands such
buffers straight back to the OS on free (they are mmapped, or live in a thread arena that trims), so
every round paid that again: a third of the all-reduce's CPU time on a 2-core box. Rounds move the
same sizes again and again, so blocks are kept, rounded up to a size class, and handed out as exact-
size views. Thread-safe: the event loop takes receive buffers while codec threads frame pushes and means
into lent ones, and lent arrays may be freed on any thread.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections import OrderedDict, deque

import numpy as np

__all__ = ["BufferPool"]

_CLASS_BYTES = 1 << 20  # blocks of at least this size are rounded up to a multiple of it
_SMALL_BYTES = 64 << 10  # smaller requests are not pooled


class BufferPool:
    """`take(size)` a writable view of exactly `size` bytes; `give(view)` it back once nothing refers to
    its memory. At most `max_bytes` of idle blocks are kept (least recently returned go first)."""

    def __init__(self, *, max_bytes: int = 1 << 30) -> None:
        if max_bytes < 0:
            raise ValueError(f"BufferPool.max_bytes: must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._idle: OrderedDict[int, bytearray | mmap.mmap] = OrderedDict()  # id(block) -> block, oldest first
        self._idle_bytes = 0
        self._returned: deque[memoryview] = deque()  # from `lend` finalizers, on any thread
        self._lock = threading.Lock()

    @staticmethod
    def _capacity(size: int) -> int:
        return -(-size // _CLASS_BYTES) * _CLASS_BYTES

    def take(self, size: int) -> memoryview:
        if size < 0:
            raise ValueError(f"BufferPool.take: size must be >= 0, got {size}")
        self._reclaim()
        if size >= _SMALL_BYTES:
            want = self._capacity(size)
            with self._lock:
                for key, block in self._idle.items():
                    if len(block) == want:
                        del self._idle[key]
                        self._idle_bytes -= want
                        return memoryview(block)[:size]
            # Anonymous pages: zero without a memset, so the caller (often the event loop) does not fault in
            # the whole block; each page is faulted in where it is first written (a decode thread, a socket).
            return memoryview(mmap.mmap(-1, want))[:size]
        return memoryview(bytearray(size))

    def _reclaim(self) -> None:
        """Take back the lent blocks whose arrays were dropped (their finalizers queue them, on any thread)."""
        while True:
            try:
                view = self._returned.popleft()
            except IndexError:
                return
            self.give(view)

    def give(self, view: memoryview) -> None:
        """Return a view from `take`. The caller must hold no other reference into its memory (no tensor
        over it: Python cannot tell us). Memory a caller keeps is lent instead (`lend`, `lent`)."""
        block = view.obj
        view.release()
        if not isinstance(block, (bytearray, mmap.mmap)) or len(block) < _SMALL_BYTES or len(block) > self.max_bytes:
            return
        with self._lock:
            self._idle[id(block)] = block
            self._idle_bytes += len(block)
            while self._idle_bytes > self.max_bytes:
                _, old = self._idle.popitem(last=False)
                self._idle_bytes -= len(old)

    def lend(self, size: int) -> np.ndarray:
        """`size` bytes of pooled memory as a uint8 array that comes back by itself once nothing refers
        to it any more (e.g. `torch.from_numpy(pool.lend(n))` handed to a caller who drops it later)."""
        view = self.take(size)
        array = np.frombuffer(view, dtype=np.uint8)
        weakref.finalize(array, self._returned.append, view)  # deque.append is atomic: any thread may free it
        return array

    def lent(self, size: int) -> memoryview:
        """`lend(size)` as a writable byte view (an Allocator for `Codec.encode(into=...)`): the block comes back
        once the view and everything made from it are dropped."""
        return self.lend(size).data

    def release_idle(self) -> int:
        """Free every idle block (e.g. before a memory-hungry phase); returns the bytes released."""
        self._reclaim()
        with self._lock:
            released, self._idle_bytes = self._idle_bytes, 0
            self._idle.clear()
        return released

    @property
    def idle_bytes(self) -> int:
        """Bytes of idle blocks, lent ones whose arrays were dropped included (taken back at the next `take`)."""
        blocks = [view.obj for view in list(self._returned)]
        return self._idle_bytes + sum(len(b) for b in blocks if isinstance(b, (bytearray, mmap.mmap))
                                      and _SMALL_BYTES <= len(b) <= self.max_bytes)

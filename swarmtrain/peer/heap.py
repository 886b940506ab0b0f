"""Give the C heap's free memory back to the OS after a round (glibc's `malloc_trim`; elsewhere a no-op).

An inner step and an all-reduce allocate and free hundreds of MB in blocks below glibc's mmap
threshold (it rises to 32 MiB as large blocks are freed), in several threads' arenas. glibc keeps
what they free for reuse, so a peer's RSS ratchets up to the sum of every arena's high-water mark
while the inner steps of the next round run beside it. `malloc_trim(0)` returns those free pages
(the top of each heap and every whole free page inside it) in a few milliseconds.

`round_heap()` and `steps_heap()` also set where glibc maps blocks instead of carving them from an
arena: during a round, blocks of 4 MiB and up (a piece of Δ being encoded, a shard's mean being
decoded, received messages) get their own mapping and go back to the OS when freed, instead of
staying resident in an arena until the next trim, at the round's peak; during inner steps, 32 MiB,
where glibc's own sliding threshold settles, so that the gradients a step frees are reused by the
next without page faults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable

__all__ = ["round_heap", "steps_heap", "trim_heap"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
ROUND_MMAP_BYTES = 4 << 20
STEPS_MMAP_BYTES = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


@functools.cache
def _libc(name: str, *argtypes: type) -> Callable[..., int] | None:
    """The C library's function `name` (returning int, taking `argtypes`); None where it has none."""
    lib = ctypes.util.find_library("c")
    try:
        fn = getattr(ctypes.CDLL(lib), name) if lib else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return fn


def _thresholds(mmap_bytes: int) -> bool:
    """Blocks of `mmap_bytes` and up are mapped on their own; the heap's top is trimmed past twice that
    (glibc's own pairing). False where the C library has no `mallopt`."""
    fn = _libc("mallopt", ctypes.c_int, ctypes.c_int)
    if fn is None:
        return False
    return bool(fn(_M_MMAP_THRESHOLD, mmap_bytes)) and bool(fn(_M_TRIM_THRESHOLD, 2 * mmap_bytes))


def round_heap() -> bool:
    """Before a round: free pages back to the OS, and blocks of 4 MiB and up mapped on their own."""
    trimmed = trim_heap()
    return _thresholds(ROUND_MMAP_BYTES) and trimmed


def steps_heap() -> bool:
    """Before inner steps: free pages back to the OS, and blocks below 32 MiB reused from the arenas."""
    trimmed = trim_heap()
    return _thresholds(STEPS_MMAP_BYTES) and trimmed


def trim_heap() -> bool:
    """Release the heap's free pages to the OS; False where the C library has no `malloc_trim`."""
    fn = _libc("malloc_trim", ctypes.c_size_t)
    if fn is None:
        return False
    fn(0)
    return True

"""Give the C heap's free memory back to the OS after a round (glibc's `malloc_trim`; elsewhere a no-op).

An inner step and an all-reduce allocate and free hundreds of MB in blocks below glibc's mmap
threshold (it rises to 32 MiB as large blocks are freed), in several threads' arenas. glibc keeps
what they free for reuse, so a peer's RSS ratchets up to the sum of every arena's high-water mark
while the inner steps of the next round run beside it. `malloc_trim(0)` returns those free pages
(the top of each heap and every whole free page inside it) in a few milliseconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable

__all__ = ["trim_heap"]

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim_heap() -> bool:
    """Release the heap's free pages to the OS; False where the C library has no `malloc_trim`."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True

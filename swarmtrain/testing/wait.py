"""Deadline-bound waiting for tests: never sleep to synchronise, poll a predicate until a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["wait_until"]

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], *, timeout_s: float, interval_s: float = 0.02, what: str = "condition") -> T:
    """Return the first truthy value of `predicate()`; raise TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s:.1f}s")
        time.sleep(interval_s)

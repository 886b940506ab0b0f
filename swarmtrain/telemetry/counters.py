"""Per-round counters (bytes moved, compute and communication seconds) and the StatusSnapshot."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["RoundCounters", "RoundTotals", "StatusSnapshot"]


@dataclass(frozen=True)
class RoundTotals:
    """What one round cost; `tokens` counts the inner steps' training tokens."""

    bytes_sent: int = 0
    bytes_received: int = 0
    compute_s: float = 0.0
    comm_s: float = 0.0
    tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.compute_s if self.compute_s > 0 else 0.0


class RoundCounters:
    """Accumulates one round's costs from any thread; `take()` returns them and starts the next round."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current = RoundTotals()
        self._lifetime = RoundTotals()

    def add(self, *, bytes_sent: int = 0, bytes_received: int = 0, compute_s: float = 0.0,
            comm_s: float = 0.0, tokens: int = 0) -> None:
        if min(bytes_sent, bytes_received, tokens) < 0 or min(compute_s, comm_s) < 0:
            raise ValueError("RoundCounters.add: counts and durations must be >= 0")
        with self._lock:
            self._current = _plus(self._current, bytes_sent, bytes_received, compute_s, comm_s, tokens)
            self._lifetime = _plus(self._lifetime, bytes_sent, bytes_received, compute_s, comm_s, tokens)

    @contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        """Time a block as "compute" or "comm"."""
        if kind not in ("compute", "comm"):
            raise ValueError(f"RoundCounters.timed: kind must be 'compute' or 'comm', got {kind!r}")
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            if kind == "compute":
                self.add(compute_s=elapsed)
            else:
                self.add(comm_s=elapsed)

    def take(self) -> RoundTotals:
        with self._lock:
            totals, self._current = self._current, RoundTotals()
        return totals

    @property
    def lifetime(self) -> RoundTotals:
        with self._lock:
            return self._lifetime


def _plus(t: RoundTotals, sent: int, received: int, compute_s: float, comm_s: float, tokens: int) -> RoundTotals:
    return RoundTotals(
        bytes_sent=t.bytes_sent + sent,
        bytes_received=t.bytes_received + received,
        compute_s=t.compute_s + compute_s,
        comm_s=t.comm_s + comm_s,
        tokens=t.tokens + tokens,
    )


@dataclass(frozen=True)
class StatusSnapshot:
    """A peer's state at one instant: the only thing the dashboard and status RPCs read."""

    peer_id: str
    run_id: str
    phase: str  # "starting" | "healing" | "training" | "averaging" | "leaving" | "stopped"
    round: int
    state_hash: str = ""
    loss: float | None = None
    val_loss: float | None = None
    members: tuple[str, ...] = ()
    rounds_committed: int = 0
    rounds_aborted: int = 0
    bytes_sent_total: int = 0
    bytes_received_total: int = 0
    tokens_per_s: float = 0.0
    updated_unix_s: float = field(default_factory=time.time)

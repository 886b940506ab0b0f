"""Tally: a peer's work so far, folded from the event lines it prints (one source for its record's stats,
its `/metrics` and its JSON lines, so the three always agree).

Hook it to the peer's EventWriter (`EventWriter(stream, listeners=[tally.observe])`); it reads round
lines (a DiLoCo worker), step and stage round lines (pipeline trainers and servers) and heal lines.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import threading
from dataclasses import dataclass, field

from swarmtrain import __version__
from swarmtrain.discovery.stats import MAX_TEXT_CHARS, PeerStats
from swarmtrain.telemetry.events import (
    Event,
    HealEvent,
    RoundEvent,
    StageRoundEvent,
    StageStepEvent,
    StepEvent,
)

__all__ = ["SECONDS_BUCKETS", "Histogram", "Tally"]

# Upper bounds of the seconds histograms (an all-reduce on a LAN takes ~0.1 s, over a WAN tens of seconds).
SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Histogram:
    """Cumulative-bucket histogram, Prometheus-style (`counts[i]`: observations <= bounds[i]; +Inf last)."""

    bounds: tuple[float, ...] = SECONDS_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs, "+Inf" last."""
        out, running = [], 0
        for bound, count in zip((*[repr(b) for b in self.bounds], "+Inf"), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


class Tally:
    """Thread-safe fold of one peer's events; `tokens_per_step` converts a worker's inner steps to tokens."""

    def __init__(self, *, tokens_per_step: int = 0, seq_len: int = 0) -> None:
        self.tokens_per_step = tokens_per_step
        self.seq_len = seq_len  # a trainer's samples -> tokens
        self.peer = ""  # the peer's id and role, once it knows them (labels of its metrics)
        self.role = ""
        self._lock = threading.Lock()
        self._stats = PeerStats(version=__version__)
        self.round = 0  # the newest round this peer committed (worker) or its part did (pipeline)
        self.allreduce_s = Histogram()
        self.inner_step_s = Histogram()
        self.steps = 0

    def observe(self, event: Event) -> None:
        with self._lock:
            if isinstance(event, RoundEvent):
                self._round(event.committed, event.round, event.bytes_sent, event.bytes_received, event.comm_s,
                            event.reason)
                tokens = event.steps * self.tokens_per_step
                s = self._stats
                self._stats = _replace(s, tokens=s.tokens + tokens, compute_s=s.compute_s + event.compute_s,
                                       tokens_per_s=tokens / event.compute_s if event.compute_s > 0 else s.tokens_per_s,
                                       loss=_known(event.loss, s.loss), val_loss=_known(event.val_loss, s.val_loss),
                                       val_bpb=_known(event.val_bpb, s.val_bpb), spread=_known(event.spread, s.spread))
                if event.steps:
                    self.steps += event.steps
                    for _ in range(event.steps):
                        self.inner_step_s.observe(event.compute_s / event.steps)
            elif isinstance(event, StageRoundEvent):
                self._round(event.committed, event.round, event.bytes_sent, event.bytes_received, event.comm_s,
                            event.reason)
            elif isinstance(event, StepEvent):  # a pipeline trainer's inner step
                s = self._stats
                self.steps += 1
                self._stats = _replace(s, tokens=s.tokens + event.samples * self.seq_len,
                                       loss=_known(event.loss, s.loss))
            elif isinstance(event, StageStepEvent):
                self.steps += 1
                self._stats = _replace(self._stats, tokens_per_s=event.samples_per_s * self.seq_len)
            elif isinstance(event, HealEvent):
                self._stats = _replace(self._stats, heals=self._stats.heals + 1)
                self.round = max(self.round, event.to_round)

    def _round(self, committed: bool, round_index: int, sent: int, received: int, comm_s: float,
               reason: str) -> None:
        s = self._stats
        self._stats = _replace(s, bytes_sent=s.bytes_sent + sent, bytes_received=s.bytes_received + received,
                               comm_s=s.comm_s + comm_s, rounds_committed=s.rounds_committed + int(committed),
                               rounds_aborted=s.rounds_aborted + int(not committed),
                               abort_reason=s.abort_reason if committed else reason[:MAX_TEXT_CHARS])
        self.allreduce_s.observe(comm_s)
        if committed:
            self.round = max(self.round, round_index + 1)

    def stats(self) -> PeerStats:
        with self._lock:
            return self._stats


def _replace(s: PeerStats, **changes: object) -> PeerStats:
    return dataclasses.replace(s, **changes)  # type: ignore[arg-type]


def _known(value: float | None, last: float | None) -> float | None:
    """`value` when it is a number, else `last`: an aborted round's loss is NaN (nothing trained into Δ), and a
    NaN in the peer's record would make every reader refuse the record, hiding the peer from the swarm."""
    return value if value is not None and math.isfinite(value) else last

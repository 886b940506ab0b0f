"""Which server of a stage gets a micro-batch: expected completion time, randomized (SWARM's wiring).

Each server's expected time is its latency EWMA (what its record says, then the stage's median, while
this trainer has none) times one plus the calls this trainer has in flight to it plus the queue it
last reported. A server is drawn
with probability proportional to 1 / expected time, so load spreads and a slow server still gets a
share in proportion to its speed. A call that fails or passes its deadline (a multiple of that
server's p95 latency) marks the server failed: it is avoided for `avoid_s`, doubling with each
further failure up to 8×, unless no other server of the stage is left; an answer clears it.
Pure: the clock and the random draws are the caller's.
"""

from __future__ import annotations

import collections
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from swarmtrain.config import PipelineConfig

__all__ = ["Router", "Server"]

_EWMA = 0.3  # weight of the newest latency
_WINDOW = 64  # latencies kept per server for its p95
_MIN_FOR_P95 = 4  # latencies needed before a server gets an adaptive deadline
_MAX_AVOID_DOUBLINGS = 3


@dataclass(frozen=True)
class Server:
    peer_id: str
    endpoint: str
    stage: int


@dataclass
class _Health:
    ewma_s: float | None = None
    hinted_s: float | None = None  # from the server's record, until this trainer measured it
    latencies: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=_WINDOW))
    in_flight: int = 0
    queue: int = 0
    failures: int = 0
    avoid_until: float = 0.0


class Router:
    def __init__(self, cfg: PipelineConfig, *, clock: Callable[[], float], rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self.clock = clock
        self.rng = rng or random.Random()
        self._servers: dict[int, list[Server]] = {}
        self._health: dict[Server, _Health] = {}

    def update(self, servers: Sequence[Server], *, hints: Mapping[Server, tuple[float, int]] | None = None) -> None:
        """The live servers (from their records); others are forgotten, known ones keep their history.
        `hints`: (latency EWMA, queue) a server published, used until this trainer has its own figures."""
        by_stage: dict[int, list[Server]] = {}
        for s in servers:
            by_stage.setdefault(s.stage, []).append(s)
        self._servers = by_stage
        live = set(servers)
        self._health = {s: h for s, h in self._health.items() if s in live}
        for s in servers:
            h = self._health.setdefault(s, _Health())
            latency, queue = (hints or {}).get(s, (0.0, 0))
            if h.ewma_s is None and latency > 0:
                h.hinted_s = latency
            if not h.latencies:
                h.queue = queue

    def servers(self, stage: int) -> list[Server]:
        return list(self._servers.get(stage, ()))

    def expected_s(self, server: Server) -> float:
        h = self._health[server]
        base = h.ewma_s if h.ewma_s is not None else h.hinted_s or self._stage_median(server.stage)
        return base * (1 + h.in_flight + h.queue)

    def _stage_median(self, stage: int) -> float:
        ewmas = (self._health[s].ewma_s for s in self._servers.get(stage, ()))
        known = [e for e in ewmas if e is not None]
        return statistics.median(known) if known else self.cfg.min_deadline_s

    def choose(self, stage: int, *, exclude: frozenset[Server] | set[Server] = frozenset()) -> Server | None:
        """A server of `stage` for the next call, or None when the stage has none but those in `exclude`."""
        candidates = [s for s in self._servers.get(stage, ()) if s not in exclude]
        if not candidates:
            return None
        now = self.clock()
        healthy = [s for s in candidates if self._health[s].avoid_until <= now]
        pool = healthy or [min(candidates, key=lambda s: self._health[s].avoid_until)]  # the one avoided least long
        weights = [1.0 / max(self.expected_s(s), 1e-6) for s in pool]
        return self.rng.choices(pool, weights=weights)[0]

    def _of(self, server: Server) -> _Health:
        # A server the list no longer names (it moved to another stage, its record expired) may still be
        # called: the backward of a micro-batch whose forward it ran.
        return self._health.setdefault(server, _Health())

    def deadline_s(self, server: Server) -> float:
        """How long a call to `server` may take before it is re-sent elsewhere."""
        h = self._of(server)
        if len(h.latencies) < _MIN_FOR_P95:
            return self.cfg.call_timeout_s
        p95 = sorted(h.latencies)[max(0, int(0.95 * len(h.latencies)) - 1)]
        return min(max(self.cfg.deadline_factor * p95, self.cfg.min_deadline_s), self.cfg.call_timeout_s)

    def started(self, server: Server) -> None:
        self._of(server).in_flight += 1

    def answered(self, server: Server, seconds: float, *, queue: int = 0) -> None:
        h = self._of(server)
        h.in_flight = max(0, h.in_flight - 1)
        h.latencies.append(seconds)
        h.ewma_s = seconds if h.ewma_s is None else (1 - _EWMA) * h.ewma_s + _EWMA * seconds
        h.queue, h.failures, h.avoid_until = queue, 0, 0.0

    def failed(self, server: Server) -> None:
        h = self._health.get(server)
        if h is None:
            return
        h.in_flight = max(0, h.in_flight - 1)
        h.failures += 1
        h.avoid_until = self.clock() + self.cfg.avoid_s * 2 ** min(h.failures - 1, _MAX_AVOID_DOUBLINGS)

    def avoided(self, server: Server) -> bool:
        return self._health[server].avoid_until > self.clock()

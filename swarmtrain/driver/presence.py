"""What a peer knows of the others' presence: when it last saw one (and says when it has seen no one for
long), and how far its clock is from theirs (and says when it is too far).

Only heartbeats that moved since a recent read estimate the clock. A record that stopped moving while it is
still live (its writer frozen, or across a partition until the record expires) ages like a clock falling
behind; counted, it would pull every peer that sees it off the swarm's clock, each side of a partition by
its own amount, and after the heal their matchmaking windows would no longer line up."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from swarmtrain.config import DiscoveryConfig
from swarmtrain.discovery import Discovery, PeerRecord, estimate_clock_offset_s

__all__ = ["Presence"]

log = logging.getLogger(__name__)


class Presence:
    """Fed with every read of the live peers (`note`) and every group (`saw_others`); each problem is
    said once per episode, and once more when it is over."""

    def __init__(self, cfg: DiscoveryConfig, *, run_id: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self._clock = clock
        self.clock_offset_s = 0.0  # the correction applied: (swarm clock − this clock), announced in the peer record
        self._last_saw_peer = self._clock()
        self._said_alone = False
        self._said_skew = False
        self._estimated = False  # whether a read of the others' records gave an estimate yet
        self.settled = False  # the last estimate found this clock within half a heartbeat of the swarm's
        self._last_rebootstrap = self._clock()  # the DHT bootstrapped at start
        self._beats: dict[str, float] = {}  # each other peer's heartbeat_at at the last read
        self._read_at: float | None = None  # this peer's clock at the last read

    def note(self, peers: Sequence[PeerRecord], *, own_id: str, now: float) -> float:
        """A read of the live peer records (this peer's own among them or not), at swarm clock `now`;
        returns the step to add to this peer's clock correction (0.0 when it stays).

        `now` is already corrected, so the estimate is what is left of the skew. It counts only the peers
        whose heartbeat moved since the previous read, and only when that read was at most two heartbeats
        ago: a record that moved since then is at most that gap plus a heartbeat old (plus the skew), however
        long its writer has been gone since, and the median keeps one such record from moving the estimate.
        A read after a longer gap only notes the heartbeats, and marks the clock unsettled when they look
        off, so that the next heartbeat's read checks it.

        Past half a heartbeat (the estimate's own error) half of it is corrected: every peer moves halfway
        towards the others, so two peers with skewed clocks meet instead of swapping, and a swarm settles on
        one clock. The first estimate is taken whole: a peer joining a running swarm adopts its clock at once.
        """
        others = [p for p in peers if p.peer_id != own_id]
        self.saw_others(len(others))
        at, before = self._clock(), self._beats
        recent = self._read_at is not None and at - self._read_at <= 2 * self.cfg.heartbeat_s
        self._read_at, self._beats = at, {p.peer_id: p.heartbeat_at for p in others}
        dead_band = self.cfg.heartbeat_s / 2
        if not recent:
            seen = estimate_clock_offset_s(others, own_id=own_id, now=now, heartbeat_s=self.cfg.heartbeat_s)
            if seen is not None and abs(seen) > dead_band:
                self.settled = False
            return 0.0
        beating = [p for p in others if p.heartbeat_at > before.get(p.peer_id, p.heartbeat_at)]
        residual = estimate_clock_offset_s(beating, own_id=own_id, now=now, heartbeat_s=self.cfg.heartbeat_s)
        if residual is None:
            return 0.0
        first, self._estimated = not self._estimated, True
        self.settled = abs(residual) <= dead_band
        if self.settled:
            return 0.0
        step = residual if first else residual / 2  # a joiner adopts the swarm's clock at once
        self.clock_offset_s = round(self.clock_offset_s + step, 3)
        skewed = abs(self.clock_offset_s) > self.cfg.max_clock_skew_s
        if skewed and not self._said_skew:
            log.warning("this machine's clock is about %.1f s %s the swarm's (median of %d peers' heartbeats; "
                        "discovery.max_clock_skew_s=%g): this peer stamps and compares times on the swarm's clock "
                        "instead, which holds while the skew stays below discovery.record_ttl_s - "
                        "discovery.heartbeat_s. Sync the clock (NTP)", abs(self.clock_offset_s),
                        "behind" if self.clock_offset_s > 0 else "ahead of", len(beating), self.cfg.max_clock_skew_s)
        elif not skewed and self._said_skew:
            log.info("clock within %.1f s of the swarm's again", abs(self.clock_offset_s))
        self._said_skew = skewed
        return step

    def correct(self, discovery: Discovery, peers: Sequence[PeerRecord]) -> None:
        """Note a read of the live peers and move `discovery`'s estimate of the swarm's clock if it is off."""
        self.note(peers, own_id=discovery.peer_id, now=discovery.now())
        discovery.clock_offset_s = self.clock_offset_s

    def saw_others(self, others: int) -> None:
        """`others` other peers were seen just now (in a record read or in a round's group)."""
        if others:
            if self._said_alone:
                log.info("sees %d other live peer(s) of run %s again", others, self.run_id)
            self._last_saw_peer, self._said_alone = self._clock(), False

    def unseen_s(self) -> float:
        """Seconds since another live peer was last seen."""
        return self._clock() - self._last_saw_peer

    def rebootstrap_due(self) -> bool:
        """Whether to rebuild the DHT node's links now: no other live peer seen for two record TTLs (its
        links may all have dropped: frozen, partitioned, a network change), at most once per two TTLs."""
        now, wait_s = self._clock(), 2 * self.cfg.record_ttl_s
        if now - self._last_saw_peer < wait_s or now - self._last_rebootstrap < wait_s:
            return False
        self._last_rebootstrap = now
        return True

    def alone_s(self) -> float:
        """Seconds without another live peer once past discovery.alone_warning_s (said once), else 0."""
        limit = self.cfg.alone_warning_s
        alone = self._clock() - self._last_saw_peer
        if not limit or alone < limit:
            return 0.0
        if not self._said_alone:
            self._said_alone = True
            log.warning("has seen no other live peer of run %s for %.0f s: no one to average with. Check that "
                        "--join names a live coordinator, that the DHT and gRPC ports are reachable, and that "
                        "this machine's clock is synced (records from a skewed clock look expired)",
                        self.run_id, alone)
        return round(alone, 1)

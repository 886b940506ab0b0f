"""How far this peer's clock is from the swarm's, estimated from the heartbeat times in live peer records.

Matchmaking windows and record expiry compare timestamps written on one machine with clocks read on
another, so a skewed clock makes a peer late for every window, or invisible once its records look
expired. A record's `heartbeat_at` is the writer's clock when it beat; a synced reader finds it between
one heartbeat interval old and now. The median over the other live peers, shifted by half an interval,
estimates (swarm clock − this clock) to within about half a heartbeat interval.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from swarmtrain.discovery.records import PeerRecord

__all__ = ["estimate_clock_offset_s"]


def estimate_clock_offset_s(peers: Sequence[PeerRecord], *, own_id: str, now: float,
                            heartbeat_s: float) -> float | None:
    """Estimated (swarm clock − this peer's clock) in seconds; None without another live peer.

    Positive: this clock is behind the swarm's. The median keeps one peer with a wrong clock from
    moving the estimate.
    """
    ages = [now - p.heartbeat_at for p in peers if p.peer_id != own_id and p.heartbeat_at > 0]
    if not ages:
        return None
    return heartbeat_s / 2 - statistics.median(ages)

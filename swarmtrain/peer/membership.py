"""Who a peer's commits count on (the electorate) and how it says it left for good (its departure)."""

from __future__ import annotations

import logging

from swarmtrain.discovery import DepartureRecord, Discovery, DiscoveryError, RecordError

__all__ = ["Membership"]

log = logging.getLogger(__name__)


class Membership:
    """One peer's side of the commit rule's electorate (averaging/allreduce.py, docs/protocol.md)."""

    def __init__(self, discovery: Discovery, *, run_id: str, timeout_s: float) -> None:
        self.discovery = discovery
        self.run_id = run_id
        self.timeout_s = timeout_s
        self.sent_round = -1  # the newest round this peer sent (or was about to send) a Δ of

    async def electorate(self, members: tuple[str, ...], round_index: int) -> tuple[str, ...]:
        """Who a commit of round `round_index` needs a strict majority of: `members` (those of the commit
        that produced this peer's θ_global) less those that announced they left before that round. Two
        sides of a partition cannot both reach it, whichever departures each side sees. Also notes that
        this peer is about to send its Δ of the round (see `departure`)."""
        self.sent_round = max(self.sent_round, round_index)
        if not members:
            return ()
        try:
            gone = await self.discovery.departures(timeout_s=self.timeout_s)
        except DiscoveryError as e:  # counting every member is always safe, just less live
            log.info("could not read departures (%s): counting every member of the last commit", e)
            return members
        left = {d.peer_id for d in gone if d.from_round <= round_index}
        return tuple(m for m in members if m not in left)

    def departure(self, current_round: int, *, now: float) -> DepartureRecord:
        """This peer leaving at `current_round`: it takes part in no round from that one on, unless it
        already sent its Δ of it (then from the next one: the round may still commit with it)."""
        first = current_round + 1 if self.sent_round >= current_round else current_round
        return DepartureRecord(run_id=self.run_id, peer_id=self.discovery.peer_id, from_round=first, left_at=now)

    async def announce_departure(self, current_round: int) -> None:
        """Leaving: say so (best effort; without it the others wait for this peer, or outvote it)."""
        try:
            await self.discovery.announce_departure(self.departure(current_round, now=self.discovery.now()),
                                                    timeout_s=self.timeout_s)
        except (DiscoveryError, RecordError) as e:
            log.warning("could not announce this peer's departure: %s", e)

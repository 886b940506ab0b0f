"""Matchmaking: turn round r's DHT entries into one Group that is identical on every member.

Protocol for one peer and round r (all times are unix seconds on the posting peer's clock):

1. post a MatchEntry(member, posted_at=now) under (run, r);
2. the window opens at the earliest entry's `posted_at` (the *anchor*) and closes at
   anchor + `window_s`; an entry posted after the close is *late*: its peer skips round r
   and joins r+1 (it never waits for a group it cannot be in);
3. after close + `settle_s` (time for in-flight stores to land), every peer reads the entries;
   the eligible ones are those posted by the close, and the *leader* is the smallest eligible
   peer_id;
4. the leader publishes a GroupRecord (signed by it) with the members it sees, sorted; every
   other peer waits (until `decision_timeout_s` after its settle) for a GroupRecord from the
   leader *it* computed and adopts exactly that member list, or nothing.

Why a single leader and no fallback: DHT reads are eventually consistent, so peers can disagree
on who is eligible; only one signed list per round can be adopted, and a round number must map
to at most one θ_global. If the leader vanishes (or a follower sees a different leader), the
follower aborts the round instead of electing the next-smallest id: a fallback leader could
publish a second, different list for the same round, while an abort costs one round for the
peers involved and keeps the invariant. A member that is listed by the leader but did not adopt
the list simply does not deliver, which the all-reduce's commit rule (majority of the group)
already handles. Fewer than `min_peers` members: no group, the round is skipped by everyone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from swarmtrain.averaging.group import Group, Member
from swarmtrain.config import AveragingConfig
from swarmtrain.discovery import Discovery, DiscoveryError, GroupRecord, MatchEntry

__all__ = ["MatchOutcome", "Matchmaker"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MatchOutcome:
    """Round `round`'s matchmaking result for this peer: `group` is None when the round is skipped."""

    round: int
    group: Group | None
    leader_id: str = ""
    reason: str = ""  # why there is no group ("late", "too few peers", "leader silent", ...)
    late: bool = False  # this peer missed round's window: it should enter round + 1


class Matchmaker:
    """Forms round groups through a Discovery; one instance per peer, one `form_group` per round."""

    def __init__(self, discovery: Discovery, *, min_peers: int, window_s: float, settle_s: float | None = None,
                 decision_timeout_s: float | None = None, io_timeout_s: float | None = None,
                 poll_s: float | None = None) -> None:
        if min_peers < 1:
            raise ValueError(f"min_peers must be >= 1, got {min_peers}")
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self._d = discovery
        self.min_peers = min_peers
        self.window_s = window_s
        self.settle_s = settle_s if settle_s is not None else 0.25 * window_s
        self.decision_timeout_s = decision_timeout_s if decision_timeout_s is not None else max(window_s, 1.0)
        self.io_timeout_s = io_timeout_s if io_timeout_s is not None else max(window_s, 2.0)
        self.poll_s = poll_s if poll_s is not None else min(max(window_s / 20, 0.01), 0.2)

    @classmethod
    def from_config(cls, discovery: Discovery, cfg: AveragingConfig) -> Matchmaker:
        return cls(discovery, min_peers=cfg.min_peers, window_s=cfg.matchmaking_timeout_s)

    def _now(self) -> float:
        return self._d.now()

    async def _sleep_until(self, t: float) -> None:
        delay = t - self._now()
        if delay > 0:
            await asyncio.sleep(delay)

    async def _entries(self, round_index: int, own: MatchEntry) -> list[MatchEntry]:
        seen = await self._d.round_entries(round_index, timeout_s=self.io_timeout_s)
        # Our own entry counts even if the read raced our store.
        return sorted({e.member.peer_id: e for e in (*seen, own)}.values(), key=lambda e: e.member.peer_id)

    async def form_group(self, round_index: int, member: Member) -> MatchOutcome:
        """Run matchmaking for `round_index` as `member`; returns within ~window + settle + decision timeout."""
        if member.peer_id != self._d.peer_id:
            raise ValueError(f"member.peer_id {member.peer_id!r} is not this peer ({self._d.peer_id!r})")
        own = MatchEntry(run_id=self._d.run_id, round=round_index, member=member, posted_at=self._now())
        try:
            await self._d.post_entry(own, timeout_s=self.io_timeout_s)
            close_at = _close_at(await self._entries(round_index, own), self.window_s)
            if own.posted_at > close_at:
                return self._late(round_index, close_at, own)
            await self._sleep_until(close_at + self.settle_s)
            entries = await self._entries(round_index, own)
        except (DiscoveryError, TimeoutError) as e:
            return self._skip(round_index, "", f"control plane failed during matchmaking: {e}")
        close_at = _close_at(entries, self.window_s)  # an earlier anchor may have surfaced meanwhile
        if own.posted_at > close_at:
            return self._late(round_index, close_at, own)
        eligible = [e for e in entries if e.posted_at <= close_at]
        leader_id = eligible[0].member.peer_id
        if leader_id == self._d.peer_id:
            return await self._lead(round_index, eligible, close_at)
        return await self._follow(round_index, leader_id, close_at)

    async def _lead(self, round_index: int, eligible: Sequence[MatchEntry], close_at: float) -> MatchOutcome:
        me = self._d.peer_id
        record = GroupRecord(run_id=self._d.run_id, round=round_index, leader_id=me,
                             members=tuple(e.member for e in eligible), window_close_at=close_at)
        try:
            # Published even when too small: followers learn "skipped" now instead of at their deadline.
            await self._d.post_group(record, timeout_s=self.io_timeout_s)
        except (DiscoveryError, TimeoutError) as e:
            return self._skip(round_index, me, f"leader could not publish the group: {e}")
        return self._adopt(record)

    async def _follow(self, round_index: int, leader_id: str, close_at: float) -> MatchOutcome:
        deadline = close_at + self.settle_s + self.decision_timeout_s
        while True:
            try:
                groups = await self._d.round_groups(round_index, timeout_s=self.io_timeout_s)
            except (DiscoveryError, TimeoutError) as e:
                log.warning("round %d: reading the group failed (%s); retrying until the deadline", round_index, e)
                groups = ()
            for record in groups:
                if record.leader_id == leader_id:
                    return self._adopt(record)
            if self._now() >= deadline:
                others = sorted(g.leader_id for g in groups)
                return self._skip(round_index, leader_id, f"leader {leader_id} published no group by the deadline"
                                  + (f" (groups seen from {others} ignored)" if others else ""))
            await asyncio.sleep(self.poll_s)

    def _adopt(self, record: GroupRecord) -> MatchOutcome:
        ids = [m.peer_id for m in record.members]
        if self._d.peer_id not in ids:
            return self._skip(record.round, record.leader_id, f"not in leader {record.leader_id}'s group {ids}")
        if len(ids) < self.min_peers:
            return self._skip(record.round, record.leader_id, f"too few peers: {len(ids)} < min_peers {self.min_peers}")
        group = Group(run_id=record.run_id, round=record.round, members=record.members)
        log.info("round %d: group %s of %d members (leader %s)", record.round, group.group_id, len(ids),
                 record.leader_id)
        return MatchOutcome(round=record.round, group=group, leader_id=record.leader_id)

    def _skip(self, round_index: int, leader_id: str, reason: str) -> MatchOutcome:
        log.info("round %d: no group for %s: %s", round_index, self._d.peer_id, reason)
        return MatchOutcome(round=round_index, group=None, leader_id=leader_id, reason=reason)

    def _late(self, round_index: int, close_at: float, own: MatchEntry) -> MatchOutcome:
        reason = f"late: posted {own.posted_at - close_at:.3f}s after the window closed; join round {round_index + 1}"
        log.info("round %d: %s is %s", round_index, self._d.peer_id, reason)
        return MatchOutcome(round=round_index, group=None, reason=reason, late=True)


def _close_at(entries: Sequence[MatchEntry], window_s: float) -> float:
    return min(e.posted_at for e in entries) + window_s

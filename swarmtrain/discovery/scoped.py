"""ScopedDiscovery: one averaging scope's view of a Discovery (the peers that hold one part of the model).

A pipeline's stage servers average their stage's blocks only with servers of the same stage, and its
trainers the embeddings and head only with trainers. Their matchmaking goes through this view: match
entries and groups live under the scope's own DHT keys, and `live_peers` lists the scope's members only
(the matchmaker's early close, its "is the swarm past this round" check and heals see no one else).
Everything else (the run record, announcing and withdrawing this peer's record) passes through.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from swarmtrain.discovery.protocol import DirectoryIo, Discovery
from swarmtrain.discovery.records import DepartureRecord, GroupRecord, MatchEntry, PeerRecord, RunRecord
from swarmtrain.trust.identity import Identity, KeyBinding

__all__ = ["ScopedDiscovery"]


class ScopedDiscovery:
    """`inner` seen by the members of `scope` (one path segment); `member` says which peer records are."""

    def __init__(self, inner: Discovery, *, scope: str, member: Callable[[PeerRecord], bool]) -> None:
        if not scope or "/" in scope:
            raise ValueError(f"an averaging scope is one non-empty path segment, got {scope!r}")
        self.inner = inner
        self.scope = scope
        self.member = member

    @property
    def peer_id(self) -> str:
        return self.inner.peer_id

    @property
    def run_id(self) -> str:
        return self.inner.run_id

    @property
    def io(self) -> DirectoryIo:  # the inner directory's counters
        return self.inner.io

    @property
    def identity(self) -> Identity:
        return self.inner.identity

    @property
    def key_binding(self) -> KeyBinding:
        return self.inner.key_binding

    @property
    def clock_offset_s(self) -> float:
        return self.inner.clock_offset_s

    @clock_offset_s.setter
    def clock_offset_s(self, value: float) -> None:
        self.inner.clock_offset_s = value

    def now(self) -> float:
        return self.inner.now()

    async def publish_run(self, record: RunRecord, *, timeout_s: float) -> None:
        await self.inner.publish_run(record, timeout_s=timeout_s)

    async def fetch_run(self, *, coordinator_id: str | None = None, join_ids: Sequence[str] = (),
                        timeout_s: float) -> RunRecord | None:
        return await self.inner.fetch_run(coordinator_id=coordinator_id, join_ids=join_ids, timeout_s=timeout_s)

    async def announce(self, record: PeerRecord, *, timeout_s: float) -> None:
        await self.inner.announce(record, timeout_s=timeout_s)

    async def live_peers(self, *, timeout_s: float) -> tuple[PeerRecord, ...]:
        return tuple(p for p in await self.inner.live_peers(timeout_s=timeout_s) if self.member(p))

    async def withdraw(self, *, timeout_s: float) -> None:
        await self.inner.withdraw(timeout_s=timeout_s)

    async def announce_departure(self, record: DepartureRecord, *, timeout_s: float) -> None:
        await self.inner.announce_departure(record, timeout_s=timeout_s)

    async def departures(self, *, timeout_s: float) -> tuple[DepartureRecord, ...]:
        return await self.inner.departures(timeout_s=timeout_s)

    async def rejoin(self, *, timeout_s: float) -> None:
        await self.inner.rejoin(timeout_s=timeout_s)

    async def rebootstrap(self, maddrs: Sequence[str], *, timeout_s: float) -> int:
        return await self.inner.rebootstrap(maddrs, timeout_s=timeout_s)

    async def post_entry(self, entry: MatchEntry, *, keep_s: float, timeout_s: float, scope: str = "") -> None:
        await self.inner.post_entry(entry, keep_s=keep_s, timeout_s=timeout_s, scope=self._scope(scope))

    async def round_entries(self, round_index: int, attempt: int, *, timeout_s: float,
                            scope: str = "") -> tuple[MatchEntry, ...]:
        return await self.inner.round_entries(round_index, attempt, timeout_s=timeout_s, scope=self._scope(scope))

    async def post_group(self, record: GroupRecord, *, keep_s: float, timeout_s: float, scope: str = "") -> None:
        await self.inner.post_group(record, keep_s=keep_s, timeout_s=timeout_s, scope=self._scope(scope))

    async def round_groups(self, round_index: int, attempt: int, *, timeout_s: float,
                           scope: str = "") -> tuple[GroupRecord, ...]:
        return await self.inner.round_groups(round_index, attempt, timeout_s=timeout_s, scope=self._scope(scope))

    def _scope(self, scope: str) -> str:
        if scope and scope != self.scope:
            raise ValueError(f"this view is of scope {self.scope!r}, not {scope!r}")
        return self.scope

    async def aclose(self) -> None:
        """A view owns nothing: the inner discovery is closed by whoever opened it."""

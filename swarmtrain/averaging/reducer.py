"""The reducer side of the all-reduce: per-attempt sessions that validate, hold and average one shard.

A reducer accepts shard j of each member's encoded Δ until every member delivered (on a retry: every member
the failed attempt's live reducers heard from) or its contribution window closes; the set of members it
accepted is then fixed (its *contributors*). A member that crashed after its group formed would hold the
window open to its end: once a majority pushed (and a quarter of the window passed), the reducer asks each
serving member still missing for its shard (the fetch a stand-in makes). One that cannot be reached is not
waited for; a live one answers that it is pushing the shard or has none yet (its group unread), and is waited
for to the window's end as before.
Members ask every reducer for that set, intersect them, and fetch each shard's mean over the
intersection, which the reducer computes once per set: decoded contributions summed in fp32 in
group order (so the result never depends on arrival order), divided by their number, encoded once.
A gathering reducer (sparse codecs, aggregate.py) serves the contributions over the intersection
instead, less the caller's own, and each member averages them.

A reducer serves the means of any session; what keeps a round to one mean is the round's decision among
its voters (deciding.py, voting.py). Bounds: every wait on a session ends with its window (a dropped
session wakes its waiters with a refusal), and a session caches the means of at most
`MAX_MEANS_PER_SESSION` contributor sets (honest members all ask for one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from swarmtrain.averaging.aggregate import Aggregation, encoded_aggregate, pack_bundle
from swarmtrain.averaging.standin import StandIns
from swarmtrain.compress import Codec, CodecError
from swarmtrain.round.group import Group, Member
from swarmtrain.rpc.averaging_wire import PushHeader, SessionKey
from swarmtrain.rpc.buffers import BufferPool
from swarmtrain.rpc.errors import RpcError, RpcUnavailable
from swarmtrain.rpc.node import Rejected

__all__ = ["ENCODED_SLACK_BYTES", "ReducerRegistry", "max_encoded_bytes", "shard_bounds"]

log = logging.getLogger(__name__)

ENCODED_SLACK_BYTES = 64 << 10  # codec header + shape + block scales beyond 4 bytes per value
MAX_MEANS_PER_SESSION = 4
PROBE_AFTER = 0.25  # of the window: when a reducer first asks the members it has not heard from for their shard


def _all_in(s: _Session) -> bool:
    """Whether every awaited member's shard came: checked at each push, so it stops at the first one missing
    (building a set of the received each time cost N per push, N² per window)."""
    return all(p in s.received for p in s.awaited)


def max_encoded_bytes(numel: int) -> int:
    """The most bytes any codec may use for `numel` values (fp32 is the widest)."""
    return 4 * numel + ENCODED_SLACK_BYTES


def shard_bounds(numel: int, weights: tuple[float, ...], *, align: int = 1) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) ranges of a flat tensor, one per reducer, sized by `weights`
    (equal when any weight is unknown, i.e. <= 0). Identical on every member for the same input.
    Inner edges fall on multiples of `align` (the codec's block) so shards quantize like the whole."""
    if not weights:
        raise ValueError("shard_bounds: no reducers")
    if any(w <= 0 for w in weights):
        weights = tuple(1.0 for _ in weights)
    total, acc, edges = sum(weights), 0.0, [0]
    for w in weights[:-1]:
        acc += w
        edges.append(min(numel, round(numel * acc / total / align) * align))
    edges.append(numel)
    return [(edges[i], edges[i + 1]) for i in range(len(weights))]


@dataclass
class _Round:
    group: Group
    numel: int


@dataclass
class _Session:
    key: SessionKey
    group: Group
    shard: int
    numel: int
    expected: frozenset[str]  # the group's members: whom it accepts pushes from
    total: int  # values of the whole Δ (every shard's bounds follow from it and the session's reducers)
    received: dict[str, bytes | bytearray | memoryview] = field(default_factory=dict)  # sender -> its shard, checked
    rejected: dict[str, str] = field(default_factory=dict)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    contributors: tuple[str, ...] = ()
    contributor_set: frozenset[str] = frozenset()  # the same, for lookups (N fetches of N names each)
    means: dict[tuple[str, ...], bytes | memoryview] = field(default_factory=dict)
    fetched: set[str] = field(default_factory=set)  # members that pulled a mean: a leaving peer waits for them
    mean_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    timer: asyncio.TimerHandle | None = None
    dropped: bool = False  # forgotten (its round is stale): waiters wake and are refused
    awaited: frozenset[str] = frozenset()  # whose pushes close the window early: `expected` unless narrowed
    closes_at: float = 0.0  # loop time
    probe: asyncio.TimerHandle | None = None
    probed: set[str] = field(default_factory=set)  # members asked for their shard (once each)
    pulls: set[asyncio.Task[None]] = field(default_factory=set)


class ReducerRegistry:
    """Implements `rpc.averaging_wire.ReducerSink` for one peer. Lives on the RpcNode's loop."""

    def __init__(self, *, peer_id: str, run_id: str, codec: Codec, window_s: float, open_wait_s: float,
                 buffers: BufferPool | None = None, aggregation: Aggregation | None = None) -> None:
        self.peer_id = peer_id
        self.aggregation = aggregation if aggregation is not None else Aggregation()
        # decoded shards and mean accumulators live in reused memory: a fresh payload-sized tensor costs
        # a zeroing page fault per 4 KiB, as much CPU as the decode itself
        self.buffers = buffers if buffers is not None else BufferPool()
        # what this peer keeps to stand in for a dead reducer of its rounds (standin.py)
        self.standins = StandIns(peer_id=peer_id, codec=codec, aggregation=self.aggregation, buffers=self.buffers,
                                 timeout_s=open_wait_s)
        self.run_id = run_id
        self.codec = codec
        self.window_s = window_s
        self.open_wait_s = open_wait_s
        self._rounds: dict[int, _Round] = {}
        self._sessions: dict[str, _Session] = {}
        self._served: tuple[int, str] | None = None  # (round, session) of the newest mean served: drain() waits on it
        self._abandoned: dict[int, set[str]] = {}  # groups the local member gave up on, per round
        self._min_round = 0
        self._changed: asyncio.Condition | None = None
        # Pushes are checked one at a time: a codec that cannot tell from its payload (sparse) decodes a
        # whole shard into fp32 to check it, and K pushes checked at once would hold K of them.
        self._check_turn = asyncio.Lock()

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:  # created lazily on the node's loop
            self._changed = asyncio.Condition()
        return self._changed

    # -- opening ---------------------------------------------------------------------------
    async def open_round(self, group: Group, *, numel: int) -> None:
        """Called by the local member when it starts round `group.round`; forgets rounds < round - 1."""
        self._rounds[group.round] = _Round(group, numel)
        self._abandoned.get(group.round, set()).discard(group.group_id)  # opened again: live again
        self._min_round = max(self._min_round, group.round - 1)
        for sid in [sid for sid, s in self._sessions.items() if s.key.round < self._min_round]:
            self._drop(sid)
        for r in [r for r in self._rounds if r < self._min_round]:
            del self._rounds[r]
        for r in [r for r in self._abandoned if r < self._min_round]:
            del self._abandoned[r]
        # what it kept to stand in for round r - 1's reducers goes now, before this round encodes anew: a
        # straggler of round r - 1 that loses a reducer later retries instead (kept longer, a model's worth of
        # encoded shards per round stays allocated and every round's new ones cost fresh pages)
        self.standins.forget_before(group.round)
        async with self.changed:
            self.changed.notify_all()

    async def abandon_round(self, group: Group) -> None:
        """Called by the local member when its all-reduce with `group` ended without a commit.

        The member may try the round again with a new group. Until it opens that group here, pushes
        for an unknown group of the round wait (bounded) as they do before a round's first group is
        known, instead of being refused against the abandoned one: the other members of the new
        group may learn of it first. Pushes for the abandoned group are refused from now on.
        """
        rnd = self._rounds.get(group.round)
        if rnd is not None and rnd.group.group_id == group.group_id:
            del self._rounds[group.round]
        self._abandoned.setdefault(group.round, set()).add(group.group_id)

    async def open_session(self, key: SessionKey, *, awaited: frozenset[str] = frozenset()) -> None:
        """Open this peer's reducer session for `key` (its own member is about to push).

        `awaited`: on a retry, the members that the failed attempt's live reducers heard from (this peer's member
        asked them all before retrying). The window then closes as soon as they all pushed: a member that died
        with the reducer the retry goes around would otherwise hold every window of the retry open to its end.
        Others may still push until then. Ignored unless a majority of the group: a narrow set would close
        windows on members that are merely slow."""
        session = self._session_or_open(key)
        if session is not None and awaited and 2 * len(awaited & session.expected) > len(session.expected):
            session.awaited = awaited & session.expected
            if not session.closed.is_set() and _all_in(session):
                self._close(session)
        async with self.changed:
            self.changed.notify_all()

    def _drop(self, sid: str) -> None:
        s = self._sessions.pop(sid)
        if s.timer is not None:
            s.timer.cancel()
        if s.probe is not None:
            s.probe.cancel()
        for task in list(s.pulls):
            task.cancel()
        s.dropped = True
        s.closed.set()  # its waiters wake and are refused
        s.received.clear()  # lent pooled memory: back to the pool once nothing (a mean's thread) reads it

    def _session_or_open(self, key: SessionKey) -> _Session | None:
        """The session for `key`, opening it when this peer knows the round's group; None if unknown yet."""
        if key.run_id != self.run_id:
            raise Rejected(f"run {key.run_id!r} is not this peer's run {self.run_id!r}", kind="precondition")
        if key.round < self._min_round:
            raise Rejected(f"round {key.round} is stale (this peer is at round {self._min_round + 1})",
                           kind="precondition")
        if self.peer_id not in key.reducers:
            raise Rejected(f"{self.peer_id} is not a reducer of this session", kind="invalid")
        session = self._sessions.get(key.session_id)
        if session is not None:
            return session
        if key.group_id in self._abandoned.get(key.round, ()):
            raise Rejected(f"group {key.group_id} of round {key.round} was abandoned by this peer",
                           kind="precondition")
        rnd = self._rounds.get(key.round)
        if rnd is None:
            return None
        if rnd.group.group_id != key.group_id:
            raise Rejected(f"group {key.group_id} is not round {key.round}'s group {rnd.group.group_id}",
                           kind="precondition")
        reducer_ids = [m.peer_id for m in rnd.group.reducers]
        if [r for r in reducer_ids if r in key.reducers] != list(key.reducers) or len(set(key.reducers)) != len(
                key.reducers):
            raise Rejected("the session's reducers are not reducers of the group, in group order", kind="invalid")
        shard = key.reducers.index(self.peer_id)
        lo, hi = self._bounds(rnd, key)[shard]
        members = frozenset(m.peer_id for m in rnd.group.members)
        session = _Session(key, rnd.group, shard, hi - lo, members, rnd.numel, awaited=members)
        loop = asyncio.get_running_loop()
        session.timer = loop.call_later(self.window_s, self._close, session)
        session.closes_at = loop.time() + self.window_s
        if self.standins.fetch_contribution is not None:
            session.probe = loop.call_later(PROBE_AFTER * self.window_s, self._probe_missing, session)
        self._sessions[key.session_id] = session
        log.debug("%s opened reducer session %s (round %d attempt %d, shard %d, %d values)", self.peer_id,
                  key.session_id, key.round, key.attempt, shard, hi - lo)
        return session

    def _bounds(self, rnd: _Round, key: SessionKey) -> list[tuple[int, int]]:
        """Every shard's [lo, hi) in session `key` (as each member computes them: allreduce.py)."""
        by_id = {m.peer_id: m for m in rnd.group.members}
        weights = tuple(by_id[r].bandwidth_bytes_per_s for r in key.reducers)
        return shard_bounds(rnd.numel, weights, align=self.codec.alignment)

    async def _session(self, key: SessionKey) -> _Session:
        """The session for `key`, waiting (bounded) for the local member to open its round."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.open_wait_s
        async with self.changed:
            while True:
                session = self._session_or_open(key)
                if session is not None:
                    return session
                left = deadline - loop.time()
                if left <= 0:
                    raise Rejected(f"no session for round {key.round} attempt {key.attempt}", kind="not_found")
                try:
                    await asyncio.wait_for(self.changed.wait(), timeout=left)
                except TimeoutError:
                    continue

    def _probe_missing(self, s: _Session) -> None:
        """Ask the serving members still missing for their shard, once a majority of the awaited pushed (before
        that, look again a quarter of a window later)."""
        if s.closed.is_set() or s.dropped:
            return
        loop = asyncio.get_running_loop()
        if 2 * len(s.awaited & set(s.received)) <= len(s.awaited):
            s.probe = loop.call_later(PROBE_AFTER * self.window_s, self._probe_missing, s)
            return
        for m in s.group.members:
            p = m.peer_id
            if (p in s.awaited and p not in s.received and p not in s.probed and p != self.peer_id
                    and not m.client_mode and m.endpoint):  # a client-mode member cannot be called: only pushes
                s.probed.add(p)
                task = loop.create_task(self._pull(s, m))
                s.pulls.add(task)
                task.add_done_callback(s.pulls.discard)

    async def _pull(self, s: _Session, member: Member) -> None:
        assert self.standins.fetch_contribution is not None
        try:
            data = await self.standins.fetch_contribution(member, s.key, s.shard, s.numel, s.closes_at)
        except RpcUnavailable as e:  # its process or its link is gone: its push cannot come either
            if not s.closed.is_set():
                s.awaited = s.awaited - {member.peer_id}
                log.info("%s: shard %d of round %d attempt %d does not wait for %s: %s", self.peer_id, s.shard,
                         s.key.round, s.key.attempt, member.peer_id, e)
                if _all_in(s):
                    self._close(s)
            return
        except (RpcError, Rejected, TimeoutError):  # alive without its shard yet (or slow): its push may come
            return
        with contextlib.suppress(Rejected):  # one it sent that does not check out: as a push, not taken
            await self._take(s, member.peer_id, data)

    def _close(self, session: _Session) -> None:
        if session.closed.is_set():
            return
        if session.timer is not None:
            session.timer.cancel()
        if session.probe is not None:
            session.probe.cancel()
        order = [m.peer_id for m in session.group.members]
        session.contributors = tuple(p for p in order if p in session.received)
        session.contributor_set = frozenset(session.contributors)
        session.closed.set()
        missing = sorted(session.awaited - set(session.received))
        log.info("%s closed shard %d of round %d attempt %d: %d/%d contributors%s", self.peer_id, session.shard,
                 session.key.round, session.key.attempt, len(session.contributors), len(session.awaited),
                 f"; missing {missing}" if missing else "")

    # -- ReducerSink -----------------------------------------------------------------------
    async def check_push(self, header: PushHeader, *, peer: str) -> int:
        s = await self._session(header.session)
        if header.shard != s.shard:
            raise Rejected(f"shard {header.shard} is not reduced here (this peer reduces shard {s.shard})")
        if header.sender not in s.expected:
            raise Rejected(f"sender {header.sender!r} is not a member of round {header.session.round}'s group")
        if header.sender != peer:  # the caller's id is covered by its call's MAC (trust/calls.py)
            raise Rejected(f"sender {header.sender!r} is not the caller {peer!r}: a member pushes only its own "
                           "contribution")
        numel = self._numel_of(s, header.shard)
        if header.numel != numel:
            raise Rejected(f"shard {header.shard} has {numel} values, the push claims {header.numel}")
        if header.codec != self.codec.name:
            raise Rejected(f"codec {header.codec!r} is not the run's codec {self.codec.name!r}")
        if s.closed.is_set():
            raise Rejected(f"shard {s.shard}'s contribution window has closed", kind="precondition")
        return max_encoded_bytes(numel)

    def _numel_of(self, s: _Session, shard: int) -> int:
        if shard == s.shard:
            return s.numel
        lo, hi = self._bounds(_Round(s.group, s.total), s.key)[shard]
        return hi - lo

    async def accept_push(self, header: PushHeader, payload: bytes | bytearray | memoryview, *, peer: str) -> None:
        s = await self._session(header.session)
        await self._take(s, header.sender, payload)

    async def _take(self, s: _Session, sender: str, payload: bytes | bytearray | memoryview) -> None:
        """`sender`'s shard, pushed or pulled (`_pull`): checked, then kept."""
        if sender in s.received:
            return  # a retried push whose first copy landed, or a push its pull raced: idempotent
        # Kept encoded as it came (a quarter of fp32 with int8): decoded again, in group order, for each mean.
        async with self._check_turn:
            try:
                await asyncio.to_thread(self.codec.validate, payload, numel=s.numel)
            except CodecError as e:
                s.rejected[sender] = str(e)
                raise Rejected(f"shard {s.shard} from {sender}: {e}") from None
        if s.closed.is_set() or sender in s.received:
            if sender in s.received:
                return  # a retry raced its first copy
            raise Rejected(f"shard {s.shard}'s contribution window closed while decoding", kind="precondition")
        s.received[sender] = payload
        if _all_in(s):
            self._close(s)

    async def _closed(self, s: _Session) -> None:
        """Wait until `s`'s window closed (bounded by it); refused if it was dropped meanwhile."""
        try:
            await asyncio.wait_for(s.closed.wait(), timeout=self.window_s + 1.0)
        except TimeoutError:  # its timer cannot be late by a second: the loop was starved or the session lost
            raise Rejected(f"shard {s.shard} of round {s.key.round} did not close in time", kind="aborted") from None
        if s.dropped:
            raise Rejected(f"round {s.key.round} is stale here: its session was dropped", kind="precondition")

    async def contributors(self, key: SessionKey, shard: int, *, peer: str) -> tuple[str, ...]:
        s = await self._session(key)
        if shard != s.shard:
            raise Rejected(f"shard {shard} is not reduced here (this peer reduces shard {s.shard})")
        await self._closed(s)
        return s.contributors

    async def mean(self, key: SessionKey, shard: int, contributors: tuple[str, ...], *,
                   peer: str) -> bytes | bytearray | memoryview:
        """Shard `shard`'s mean over `contributors`; for another reducer's shard, as its stand-in (standin.py);
        naming no contributors, this member's own encoded shard, for a reducer of the session reducing it again."""
        if not contributors:
            return self.standins.own_contribution(key, shard, caller=peer)
        s = await self._session(key)
        if shard != s.shard:
            if not 0 <= shard < len(key.reducers):
                raise Rejected(f"shard {shard} is not a shard of this session ({len(key.reducers)} reducers)")
            return await self.standins.serve(key, shard, contributors, caller=peer, group=s.group,
                                             numel=self._numel_of(s, shard))
        await self._closed(s)
        wanted = frozenset(contributors)  # a set: with N members, tuple lookups cost N² per fetch
        if not contributors or not wanted <= s.contributor_set or len(wanted) != len(contributors):
            raise Rejected(f"contributors {list(contributors)} are not a subset of shard {s.shard}'s "
                           f"{list(s.contributors)}", kind="precondition")
        if self._served is None or key.round >= self._served[0]:
            self._served = (key.round, key.session_id)
        order = [p for p in s.contributors if p in wanted]
        if self.aggregation.gather:  # the contributions themselves, less the caller's own (aggregate.py)
            return pack_bundle([s.received[p] for p in order if p != peer])
        async with s.mean_lock:
            data = s.means.get(tuple(order))
            if data is None and len(s.means) >= MAX_MEANS_PER_SESSION:
                raise Rejected(f"shard {s.shard} already serves means of {len(s.means)} contributor sets",
                               kind="too_large")
            if data is None:
                data = await encoded_aggregate(self.codec, [s.received[p] for p in order], self.aggregation,
                                               numel=s.numel, buffers=self.buffers)
                s.means[tuple(order)] = data
        return data

    async def delivered(self, key: SessionKey, shard: int, *, peer: str) -> None:
        s = self._sessions.get(key.session_id)
        if s is None or shard != s.shard:
            return  # dropped as stale meanwhile: nobody drains for it
        s.fetched.add(peer)
        async with self.changed:
            self.changed.notify_all()

    async def drain(self, *, timeout_s: float) -> tuple[str, ...]:
        """Wait (bounded) until every contributor of the newest served round has pulled its mean.

        A peer leaving gracefully right after it committed would otherwise take the shard it reduced
        with it and abort the round for everyone still fetching. Returns the members that never came.
        """
        deadline = asyncio.get_running_loop().time() + timeout_s

        def missing() -> set[str]:
            if self._served is None:
                return set()
            s = self._sessions.get(self._served[1])
            if s is None or not s.closed.is_set():
                return set()
            return set(s.contributors) - s.fetched

        async with self.changed:
            while missing() and (remaining := deadline - asyncio.get_running_loop().time()) > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), timeout=remaining)
        return tuple(sorted(missing()))


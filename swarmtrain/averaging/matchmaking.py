"""Matchmaking: turn round r's DHT entries into one Group that is identical on every member.

A round is matched in *attempts* 0, 1, 2, ...; records live under (run, r, attempt). Protocol for
one peer and round r (all times are unix seconds on the posting peer's clock):

1. find the attempt to enter: the first one with no entries or a still-open window. An attempt
   whose window closed is *in flight* until its end (close + settle + decision timeout + the
   all-reduce's commit timeout), unless its leader published a group too small to commit (a peer that
   comes after the close reads the groups until the leader's decision is due); a peer
   that finds one in flight is *late*: it waits until that end (or until the swarm moves past r,
   then heals) and never opens a competing attempt of r. Stepping past an ended attempt first
   checks that no live peer is already past r (that attempt committed: heal instead);
2. post a MatchEntry(member, attempt, posted_at=now); the window opens at the attempt's earliest
   `posted_at` (the *anchor*) and closes at anchor + `window_s`; an entry posted after the close is
   late as in 1.;
3. after close + `settle_s` (time for in-flight stores to land), every peer reads the entries;
   the eligible ones are those posted by the close, and the *leader* is the smallest eligible peer_id;
   a peer below it passes over a leader whose record stopped beating (silent for `STALE_BEATS`
   heartbeats: it died after posting), and then the smallest id whose record beats leads, without
   the silent ones. A peer stops waiting early once every live peer announced at round r (or behind it
   with its inner steps ended by the close: it heals with them) that beat within its last `STALE_BEATS`
   heartbeats has posted and they are at least `min_peers` (*early close*: a window costs nothing when
   the whole swarm is there, and a lone peer still gives newcomers the whole window); a peer still
   missing whose heartbeat has not moved for `OVERDUE_BEATS` heartbeats of the waiting peer's time is not
   waited for (it died before posting), nor, once half of the expected peers posted, one that this peer
   cannot reach when it asks it (`probe`: a call refused by no process); a leader that finds another
   leader's group for the attempt is late;
4. the leader publishes a GroupRecord (signed by it) with the members it sees, sorted; every
   other peer waits (until `decision_timeout_s` after its settle) for a GroupRecord from the
   leader *it* computed and adopts exactly that member list, or nothing.

θ_global is part of a group's identity: every entry announces the hash of the θ_global its Δ was
taken from, and a group holds only the eligible entries that announce the hash most of them
announce (ties: the hash of the smallest peer id). Its leader is the smallest peer id among those.
A peer announcing another hash is left out with `heal_to_hash` set (a bad heal or a split made its
θ_global differ): averaging with it would apply one mean to different weights, and the peers would
stay apart for good. It heals to a peer holding that hash instead.

Why attempts are sequential and records outlive them: a round number must map to at most one
θ_global. If a late peer could open a fresh window for r while an earlier group of r is still
all-reducing (its records expired, or a retry used a separate window), two disjoint groups could
both commit r. Entries therefore live `keep_s` (far longer than an attempt), and attempt a+1 opens
only once attempt a can no longer commit: its end passed or its group was too small. (A member
whose all-reduce aborted still waits for the end: the commit rule lets other members commit when
this one missed a mean.)

Why a single leader and no fallback: DHT reads are eventually consistent, so peers can disagree
on who is eligible; only one signed list per attempt can be adopted. If the leader vanishes (or a
follower sees a different leader), the follower skips the attempt instead of electing the
next-smallest id: a fallback leader could publish a second, different list, while a skip costs
one attempt and keeps the invariant. A member that is listed by the leader but did not adopt the
list simply does not deliver, which the all-reduce's commit rule (majority of the group) already
handles. Fewer than `min_peers` members: no group, the attempt is over for everyone.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from swarmtrain.config import AveragingConfig
from swarmtrain.discovery import Discovery, DiscoveryError, GroupRecord, MatchEntry, PeerRecord
from swarmtrain.round.group import Group, Member

__all__ = ["OVERDUE_BEATS", "STALE_BEATS", "MatchOutcome", "Matchmaker", "Probe", "overdue_after_s"]

# Whether a peer's process answers a call: True it did, False nothing is there (its process or its link is
# gone), None it cannot tell (the call timed out: a frozen or slow peer).
Probe = Callable[[PeerRecord], Awaitable[bool | None]]

log = logging.getLogger(__name__)
STALE_BEATS = 3.0  # heartbeats a record may miss before early close stops waiting for its peer
# heartbeats an expected peer that has not posted may miss while a window is open before it is not waited for
OVERDUE_BEATS = 1.5
MIN_OVERDUE_S = 1.0  # however fast peers beat: a loaded machine delays a beat by a few hundred ms


def overdue_after_s(heartbeat_s: float) -> float:
    """How long an expected peer's heartbeat may stand still while a window is open before it is not waited for."""
    return max(OVERDUE_BEATS * heartbeat_s, MIN_OVERDUE_S)


@dataclass(frozen=True)
class MatchOutcome:
    """One matchmaking attempt's result for this peer: `group` is None when it has no group.

    `retry_at` (swarm clock): the round must not be matched again before then, because the attempt
    this peer saw (or its group, should its all-reduce abort here) may still commit without it;
    0 means "any time".
    """

    round: int
    group: Group | None
    leader_id: str = ""
    reason: str = ""  # why there is no group ("late", "too few peers", "leader silent", ...)
    late: bool = False  # the attempt went on without this peer, or the round is already past
    attempt: int = 0
    retry_at: float = 0.0
    heal_to_hash: str = ""  # left out for its θ_global: the hash the attempt's group averages from


class Matchmaker:
    """Forms round groups through a Discovery; one instance per peer, `form_group` once per attempt."""

    def __init__(self, discovery: Discovery, *, min_peers: int, window_s: float, settle_s: float | None = None,
                 decision_timeout_s: float | None = None, io_timeout_s: float | None = None,
                 poll_s: float | None = None, commit_timeout_s: float | None = None,
                 early_close: bool = True, role: str = "worker", stale_after_s: float | None = None,
                 overdue_s: float | None = None, clock_margin_s: float = 0.0, probe: Probe | None = None) -> None:
        """`role`: the peers (by their record's role) that average with this one: a round closes early
        once all of them posted. `stale_after_s`: a record whose last heartbeat is older than this is not waited
        for (its peer died or froze; its record lives until it expires), None: every live record is.
        `overdue_s`: an expected peer that has not posted, and whose record shows no new heartbeat for `overdue_s`
        of this peer's time, is not waited for (it died before posting); None: it is waited for until its record
        goes stale. `clock_margin_s`: how far two peers' corrected clocks may disagree (a peer whose announced end
        of steps comes after the close by more is not waited for). `probe`: asks an expected peer that has not
        posted whether its process is there, once half of the expected posted; one that is not is not waited for
        (a peer that crashed just before posting otherwise costs `overdue_s` or the window)."""
        if min_peers < 1:
            raise ValueError(f"min_peers must be >= 1, got {min_peers}")
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self._d = discovery
        self.early_close = early_close
        self.role = role
        self.stale_after_s = stale_after_s
        self.overdue_s = overdue_s
        self.clock_margin_s = clock_margin_s
        self.probe = probe
        self.min_peers = min_peers
        self.window_s = window_s
        self.settle_s = settle_s if settle_s is not None else 0.25 * window_s
        self.decision_timeout_s = decision_timeout_s if decision_timeout_s is not None else max(window_s, 1.0)
        self.io_timeout_s = io_timeout_s if io_timeout_s is not None else max(window_s, 2.0)
        self.poll_s = poll_s if poll_s is not None else min(max(window_s / 20, 0.01), 0.05)
        # How long after its group is known an attempt may still commit (the all-reduce deadline).
        self.commit_timeout_s = commit_timeout_s if commit_timeout_s is not None else window_s
        # After its window closes an attempt is over by then (+ one control-plane I/O for the last beat).
        self.attempt_span_s = self.settle_s + self.decision_timeout_s + self.commit_timeout_s + self.io_timeout_s
        # Records outlive any plausible run of attempts of one round (see the module docstring).
        self.keep_s = max(3600.0, 50 * (self.window_s + self.attempt_span_s))
        self._first_open: dict[int, int] = {}  # round -> the first attempt not known to be over

    @classmethod
    def from_config(cls, discovery: Discovery, cfg: AveragingConfig, *, role: str = "worker",
                    heartbeat_s: float | None = None) -> Matchmaker:
        """`heartbeat_s`: how often peers beat; a record silent for STALE_BEATS of them is not waited for, nor one
        whose heartbeat does not move for OVERDUE_BEATS of them (at least MIN_OVERDUE_S) while this peer waits."""
        return cls(discovery, min_peers=cfg.min_peers, window_s=cfg.matchmaking_timeout_s,
                   commit_timeout_s=cfg.allreduce_timeout_s, role=role,
                   stale_after_s=None if heartbeat_s is None else STALE_BEATS * heartbeat_s,
                   overdue_s=None if heartbeat_s is None else overdue_after_s(heartbeat_s),
                   clock_margin_s=0.0 if heartbeat_s is None else heartbeat_s)

    def _now(self) -> float:
        return self._d.now()

    async def _sleep_until(self, t: float) -> None:
        delay = t - self._now()
        if delay > 0:
            await asyncio.sleep(delay)

    def _mark_over(self, round_index: int, attempt: int) -> None:
        self._first_open[round_index] = max(self._first_open.get(round_index, 0), attempt + 1)
        for r in [r for r in self._first_open if r < round_index - 2]:
            del self._first_open[r]

    async def _entries(self, round_index: int, attempt: int, own: MatchEntry | None = None) -> list[MatchEntry]:
        seen = await self._d.round_entries(round_index, attempt, timeout_s=self.io_timeout_s)
        # Our own entry counts even if the read raced our store.
        mine = () if own is None else (own,)
        return sorted({e.member.peer_id: e for e in (*seen, *mine)}.values(), key=lambda e: e.member.peer_id)

    async def form_group(self, round_index: int, member: Member) -> MatchOutcome:
        """Match `round_index` as `member`; returns within ~window + settle + decision timeout."""
        if member.peer_id != self._d.peer_id:
            raise ValueError(f"member.peer_id {member.peer_id!r} is not this peer ({self._d.peer_id!r})")
        try:
            found = await self._find_attempt(round_index)
            if isinstance(found, MatchOutcome):
                return found
            attempt, seen = found
            own = MatchEntry(run_id=self._d.run_id, round=round_index, member=member, posted_at=self._now(),
                             attempt=attempt)
            # The roster (who is expected) is read while the entry is stored, and where the window closes comes
            # from the entries just read: one round trip after the attempt was found, not two. The window's
            # loop reads the entries again (an earlier anchor may surface: the close is computed again).
            peers = await _beside(self._d.live_peers(timeout_s=self.io_timeout_s) if self.early_close
                                  else _nothing(), self._d.post_entry(own, keep_s=self.keep_s,
                                                                      timeout_s=self.io_timeout_s))
            entries = sorted({e.member.peer_id: e for e in (*seen, own)}.values(), key=lambda e: e.member.peer_id)
            close_at = _close_at(entries, self.window_s)
            if own.posted_at > close_at:
                return self._late(round_index, attempt, close_at, own.posted_at)
            entries = await self._await_close(round_index, attempt, own, close_at, entries, peers)
        except (DiscoveryError, TimeoutError) as e:
            return self._skip(round_index, "", f"control plane failed during matchmaking: {e}",
                              retry_at=self._now() + self.window_s + self.attempt_span_s)
        close_at = _close_at(entries, self.window_s)  # an earlier anchor may have surfaced meanwhile
        if own.posted_at > close_at:
            return self._late(round_index, attempt, close_at, own.posted_at)
        group_hash, agreeing = _agreeing([e for e in entries if e.posted_at <= close_at])
        if not agreeing:
            return self._skip(round_index, "", "no committed state is announced by most of the attempt's entries",
                              attempt=attempt, retry_at=close_at + self.attempt_span_s)
        if member.state_hash != group_hash:
            return self._diverged(round_index, attempt, member.state_hash, group_hash, close_at)
        leader_id = agreeing[0].member.peer_id
        if leader_id == self._d.peer_id:
            return await self._lead(round_index, attempt, agreeing, close_at)
        return await self._follow(round_index, attempt, leader_id, close_at, agreeing)

    async def _stale(self, *, after_s: float = 0.0) -> tuple[set[str], dict[str, float]]:
        """The other peers whose records stopped beating (the last beat older than `stale_after_s`), read `after_s`
        from now, and every live record's last beat: a follower's leader among them died after posting its entry
        (`_follow`). Nobody without `stale_after_s`, or when the roster cannot be read (every entry then counts,
        as before)."""
        if self.stale_after_s is None:
            return set(), {}
        if after_s > 0:
            await asyncio.sleep(after_s)
        try:
            peers = await self._d.live_peers(timeout_s=self.io_timeout_s)
        except (DiscoveryError, TimeoutError):
            return set(), {}
        since = self._now() - self.stale_after_s
        beats = {p.peer_id: p.heartbeat_at for p in peers}
        return {p for p, at in beats.items() if at < since and p != self._d.peer_id}, beats

    async def _await_close(self, round_index: int, attempt: int, own: MatchEntry, close_at: float,
                           entries: list[MatchEntry], peers: Sequence[PeerRecord]) -> list[MatchEntry]:
        """The attempt's entries after close + settle, or as soon as every peer expected at this round posted
        (`entries`: the attempt's entries as read when it was found, with this peer's; `peers`: the live records
        read while it posted).

        Expected: the live peers whose record says they are at `round_index` (they will average it), and
        those behind it whose record says their inner steps ended by the close (they hold trained steps and
        heal towards the round with them: closing without them would make such a peer miss round after
        round). A peer behind without steps under way (one restarted from its checkpoint, announcing no
        round end) must heal and train before it can post: it joins the next round at the swarm's pace, and
        waiting for it would cost every round of a large swarm its whole window. Nor is a peer whose steps
        end after the close by its own record: it could not post in time. Closing early does not
        change who is eligible (posted by `close_at`) or who leads; a peer that was not expected and posts
        after the leader published simply is not in its group.

        A peer crashed just before its round ended looks like one about to post until its record goes stale
        (longer than a window): in a large swarm with churn there is nearly always one. So while expected peers
        are missing their records are read again, and one whose heartbeat has not moved for `overdue_s` of this
        peer's own time is not waited for (a live peer beats every heartbeat while it trains and while it
        posts). Both sides of that test are on one clock each (its stamps, this peer's timer): clock skew cannot
        make a live peer look silent. Whether a peer's steps end by the close compares two peers' clocks, which
        agree within `clock_margin_s` once corrected (discovery/clock.py); the margin goes to the peer. Faster
        than the heartbeat: once half of the expected peers posted, each one still missing is asked once
        (`probe`) whether its process is there; one that no process answers for is not waited for. One whose
        process answers is read again at once: a peer that crashed and restarted while the window was open
        beats again but announces that it cannot post in time (its steps start over, or it must heal), and is
        not waited for either; so is any missing peer whose record, read again, no longer may post by the close.
        """
        expected: dict[str, PeerRecord] = {}

        def may_post(p: PeerRecord) -> bool:
            return p.role == self.role and p.round <= round_index and _may_post_by(
                p, round_index, close_at + self.clock_margin_s)

        if self.early_close:
            # A crashed peer's record stays live until it expires: in a large swarm with churn there is nearly
            # always one, and waiting for it would cost every round its whole window.
            fresh_since = -float("inf") if self.stale_after_s is None else self._now() - self.stale_after_s
            expected = {p.peer_id: p for p in peers if p.heartbeat_at >= fresh_since and may_post(p)}
        timer = asyncio.get_running_loop().time
        beats = {p: (r.heartbeat_at, timer()) for p, r in expected.items()}  # its last beat, and since when seen
        read_at = timer()
        probes: dict[str, asyncio.Task[bool | None]] = {}
        answered: set[str] = set()  # missing peers whose process answered a probe: their records are read again
        first = True
        try:
            while True:
                if not first:
                    entries = await self._entries(round_index, attempt, own)
                    # An earlier anchor that surfaced (its store was in flight at the first read) closes the window
                    # earlier for this peer too: the waits and who may post by the close follow it.
                    close_at = min(close_at, _close_at(entries, self.window_s))
                first = False
                if self._now() >= close_at + self.settle_s:
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("round %d attempt %d: the window ran out waiting for %s", round_index, attempt,
                                  sorted(set(expected) - {e.member.peer_id for e in entries}))
                    return entries
                missing = set(expected) - {e.member.peer_id for e in entries}
                for p in [p for p in sorted(missing) if p in probes and probes[p].done() and p not in answered]:
                    if probes[p].result() is False:
                        log.debug("round %d attempt %d: %s cannot be reached; not waiting for it", round_index,
                                  attempt, p)
                        del expected[p]
                        missing.discard(p)
                    else:
                        answered.add(p)
                        read_at = -float("inf")  # read its record again now
                # Never early when the expected peers cannot make a group: the window is the time newcomers get.
                if len(expected) >= self.min_peers and not missing:
                    log.debug("round %d attempt %d: all %d expected peers posted; closing early", round_index,
                              attempt, len(expected))
                    return entries
                half_posted = 2 * (len(expected) - len(missing)) >= len(expected)
                if self.probe is not None and half_posted:
                    for p in sorted(missing - probes.keys()):  # in order: a replay schedules them alike
                        record = expected[p]
                        if record.endpoint and not record.client_mode:  # a client-mode peer takes no calls
                            probes[p] = asyncio.ensure_future(self._probe_one(record))
                if await self._overdue(round_index, attempt, expected, missing, beats, read_at, may_post,
                                       half_posted=half_posted):
                    read_at = timer()
                    continue
                await asyncio.sleep(max(0.0, min(self.poll_s, close_at + self.settle_s - self._now())))
        finally:
            for task in probes.values():
                task.cancel()

    async def _probe_one(self, record: PeerRecord) -> bool | None:
        """`probe(record)`, bounded by `io_timeout_s`: None (cannot tell) when it runs out. A probe maps the network's
        errors itself (averaging/network.py `reachable`); anything else it raises is a bug and surfaces."""
        assert self.probe is not None
        try:
            return await asyncio.wait_for(self.probe(record), timeout=self.io_timeout_s)
        except TimeoutError:
            return None

    async def _overdue(self, round_index: int, attempt: int, expected: dict[str, PeerRecord], missing: set[str],
                       beats: dict[str, tuple[float, float]], read_at: float,
                       may_post: Callable[[PeerRecord], bool], *, half_posted: bool) -> bool:
        """Drops from `expected` the missing peers whose heartbeat has not moved for `overdue_s`, or whose record no
        longer may post by the close; whether it looked. The records are read every third of `overdue_s` once one
        may be overdue or half of the expected posted (a missing peer's record may change: a restarted peer's
        first beats may not announce its end of steps yet), and at once when `read_at` says so."""
        timer = asyncio.get_running_loop().time
        if read_at > -float("inf") and (self.overdue_s is None or timer() - read_at < self.overdue_s / 3 or not (
                half_posted or any(timer() - beats[p][1] >= self.overdue_s for p in missing))):
            return False
        for p, why in sorted((await self._silent(missing, beats, self.overdue_s, may_post)).items()):
            log.debug("round %d attempt %d: %s %s; not waiting for it", round_index, attempt, p, why)
            del expected[p]
        return True

    async def _silent(self, missing: set[str], beats: dict[str, tuple[float, float]], overdue_s: float | None,
                      may_post: Callable[[PeerRecord], bool]) -> dict[str, str]:
        """Of the `missing` peers, those whose record, read again now, is gone, still shows the heartbeat first
        seen `overdue_s` ago or more (`beats`: peer -> its last beat, the loop time it was first seen; updated
        for those that beat since), or no longer may post by the close (`may_post`: it restarted, or moved its
        end of steps past the close), each with why; none when the roster cannot be read."""
        try:
            read = {p.peer_id: p for p in await self._d.live_peers(timeout_s=self.io_timeout_s)}
        except (DiscoveryError, TimeoutError):
            return {}
        now = asyncio.get_running_loop().time()
        silent: dict[str, str] = {}
        for p in missing:
            if p not in read:
                silent[p] = "has no record any more"
            elif not may_post(read[p]):
                silent[p] = f"announces round {read[p].round} ending at {read[p].round_ends_at:.3f}: too late to post"
            elif read[p].heartbeat_at != beats[p][0]:
                beats[p] = (read[p].heartbeat_at, now)
            elif overdue_s is not None and now - beats[p][1] >= overdue_s:
                silent[p] = f"has not beaten for {overdue_s:.1f} s"
        return silent

    async def _find_attempt(self, round_index: int) -> tuple[int, list[MatchEntry]] | MatchOutcome:
        """The attempt of `round_index` to enter and its entries as read, or the outcome that says why none can be
        entered now."""
        attempt = self._first_open.get(round_index, 0)
        while True:
            entries = await self._entries(round_index, attempt)
            if entries:
                close_at = _close_at(entries, self.window_s)
                arrived = self._now()
                if arrived <= close_at:
                    return attempt, entries  # its window is open: join it
                if not await self._attempt_over(round_index, attempt, entries, close_at):
                    return self._late(round_index, attempt, close_at, arrived)
                self._mark_over(round_index, attempt)
                attempt += 1
            if attempt > 0 and await self._swarm_is_past(round_index):
                return MatchOutcome(round=round_index, group=None, late=True, attempt=attempt,
                                    reason=f"round {round_index} was committed without this peer; heal")
            if not entries:
                return attempt, []  # nobody has opened it: this peer's entry anchors its window

    async def _attempt_over(self, round_index: int, attempt: int, entries: Sequence[MatchEntry],
                            close_at: float) -> bool:
        """A closed attempt can no longer commit: its end passed, or its leader's group is too small.

        Until its leader's decision is due (close + settle + decision timeout) and while no group of that
        leader is readable, the group may still be on its way: a peer that came just after the close
        keeps reading (bounded) instead of taking the attempt for in flight. Otherwise a lone leader's
        "too small" record that had not landed yet would make the newcomer wait out the whole attempt
        span while the leader opened the next attempt alone, and the two would miss each other.
        """
        agreeing = _agreeing([e for e in entries if e.posted_at <= close_at])[1]
        if not agreeing:  # no state most of them hold: no group forms, the attempt ends with its span
            return self._now() >= close_at + self.attempt_span_s
        leader_id = agreeing[0].member.peer_id
        decided_by = close_at + self.settle_s + self.decision_timeout_s
        while True:
            if self._now() >= close_at + self.attempt_span_s:
                return True
            groups = [g for g in await self._d.round_groups(round_index, attempt, timeout_s=self.io_timeout_s)
                      if g.leader_id == leader_id]
            if groups or self._now() >= decided_by:
                return any(len(g.members) < self.min_peers for g in groups)
            await asyncio.sleep(max(self.poll_s, 0.1))

    async def _swarm_is_past(self, round_index: int) -> bool:
        peers = await self._d.live_peers(timeout_s=self.io_timeout_s)
        return any(p.round > round_index for p in peers if p.peer_id != self._d.peer_id)

    async def _lead(self, round_index: int, attempt: int, eligible: Sequence[MatchEntry],
                    close_at: float) -> MatchOutcome:
        me = self._d.peer_id
        try:
            others = [g.leader_id for g in await self._d.round_groups(round_index, attempt, timeout_s=self.io_timeout_s)
                      if g.leader_id != me]
        except (DiscoveryError, TimeoutError) as e:
            return self._skip(round_index, me, f"could not read the attempt's groups: {e}", attempt=attempt,
                              retry_at=close_at + self.attempt_span_s)
        if others:  # another leader closed the attempt early, before this peer's entry reached it
            return self._late(round_index, attempt, close_at, self._now())
        record = GroupRecord(run_id=self._d.run_id, round=round_index, leader_id=me,
                             members=tuple(e.member for e in eligible), window_close_at=close_at, attempt=attempt)
        try:
            # Published even when too small: followers learn "skipped" now instead of at their deadline.
            await self._d.post_group(record, keep_s=self.keep_s, timeout_s=self.io_timeout_s)
        except (DiscoveryError, TimeoutError) as e:
            # Some followers may still have read it: the attempt counts as in flight until its end.
            return self._skip(round_index, me, f"leader could not publish the group: {e}",
                              attempt=attempt, retry_at=close_at + self.attempt_span_s)
        return self._adopt(record)

    async def _follow(self, round_index: int, attempt: int, leader_id: str, close_at: float,
                      agreeing: Sequence[MatchEntry]) -> MatchOutcome:
        """The group `leader_id` publishes. While it has not, the roster is read (`_stale`), and again when the
        leader's last beat seen would turn stale: a leader whose record stopped beating died after posting, and
        the smallest id of `agreeing` whose record beats takes its place (leads, if it is this peer, without the
        silent ones; else is followed). A group that comes at once costs no read's wait: the reads run beside
        the group's."""
        deadline = close_at + self.settle_s + self.decision_timeout_s
        me = self._d.peer_id
        stale: asyncio.Future[tuple[set[str], dict[str, float]]] | None = (
            None if self.stale_after_s is None else asyncio.ensure_future(self._stale()))
        try:
            while True:
                try:
                    groups = await self._d.round_groups(round_index, attempt, timeout_s=self.io_timeout_s)
                except (DiscoveryError, TimeoutError) as e:
                    log.warning("round %d: reading the group failed (%s); retrying until the deadline", round_index,
                                e)
                    groups = ()
                for record in groups:
                    if record.leader_id == leader_id:
                        return self._adopt(record)
                if stale is not None and stale.done():
                    silent, beats = stale.result()
                    assert self.stale_after_s is not None
                    # read again when the leader's last beat seen turns stale (if it beats meanwhile, its group is
                    # due anyway); a leader with no record is taken as live, as before
                    due_s = beats.get(leader_id, self._now()) + self.stale_after_s - self._now()
                    stale = asyncio.ensure_future(self._stale(after_s=max(self.poll_s, due_s + self.poll_s)))
                    if leader_id in silent:
                        alive = [e for e in agreeing if e.member.peer_id not in silent]  # this peer's among them
                        log.info("round %d attempt %d: leader %s stopped beating; %s takes its place", round_index,
                                 attempt, leader_id, alive[0].member.peer_id)
                        leader_id = alive[0].member.peer_id
                        if leader_id == me:
                            return await self._lead(round_index, attempt, alive, close_at)
                        # the new leader learns of the death when this peer does, give or take a read: it gets
                        # the decision time a leader gets from its close (the attempt's span allows for it)
                        deadline = max(deadline, self._now() + self.decision_timeout_s)
                        continue
                if self._now() >= deadline:
                    others = sorted(g.leader_id for g in groups)
                    return self._skip(round_index, leader_id, f"leader {leader_id} published no group by the deadline"
                                      + (f" (groups seen from {others} ignored)" if others else ""),
                                      attempt=attempt, retry_at=close_at + self.attempt_span_s)
                await asyncio.sleep(self.poll_s)
        finally:
            if stale is not None and not stale.done():
                stale.cancel()

    def _adopt(self, record: GroupRecord) -> MatchOutcome:
        ids = [m.peer_id for m in record.members]
        r, a = record.round, record.attempt
        if len(ids) < self.min_peers:
            self._mark_over(r, a)
            return self._skip(r, record.leader_id, f"too few peers: {len(ids)} < min_peers {self.min_peers}",
                              attempt=a)
        if self._d.peer_id not in ids:
            return self._skip(r, record.leader_id, f"not in leader {record.leader_id}'s group {ids}",
                              attempt=a, retry_at=record.window_close_at + self.attempt_span_s)
        group = Group(run_id=record.run_id, round=r, members=record.members, attempt=a)
        log.info("round %d attempt %d: group %s of %d members (leader %s)", r, a, group.group_id, len(ids),
                 record.leader_id)
        # If the group's all-reduce aborts here, other members may still commit until the attempt's end.
        return MatchOutcome(round=r, group=group, leader_id=record.leader_id, attempt=a,
                            retry_at=record.window_close_at + self.attempt_span_s)

    def _skip(self, round_index: int, leader_id: str, reason: str, *, attempt: int = 0,
              retry_at: float = 0.0) -> MatchOutcome:
        log.info("round %d attempt %d: no group for %s: %s", round_index, attempt, self._d.peer_id, reason)
        return MatchOutcome(round=round_index, group=None, leader_id=leader_id, reason=reason, attempt=attempt,
                            retry_at=retry_at)

    def _diverged(self, round_index: int, attempt: int, own_hash: str, group_hash: str,
                  close_at: float) -> MatchOutcome:
        reason = (f"θ_global differs from the round's group (this peer {own_hash[:12] or 'none'}, "
                  f"group {group_hash[:12] or 'none'}): left out; heal to the group's state")
        log.warning("round %d attempt %d: %s", round_index, attempt, reason)
        return MatchOutcome(round=round_index, group=None, reason=reason, attempt=attempt,
                            retry_at=close_at + self.attempt_span_s, heal_to_hash=group_hash)

    def _late(self, round_index: int, attempt: int, close_at: float, at: float) -> MatchOutcome:
        retry_at = close_at + self.attempt_span_s
        reason = (f"late: {at - close_at:.3f}s after attempt {attempt}'s window closed; it may commit until "
                  f"{retry_at - self._now():.1f}s from now (then heal or retry)")
        log.info("round %d: %s is %s", round_index, self._d.peer_id, reason)
        return MatchOutcome(round=round_index, group=None, reason=reason, late=True, attempt=attempt,
                            retry_at=retry_at)


def _agreeing(eligible: Sequence[MatchEntry]) -> tuple[str, list[MatchEntry]]:
    """The state digest a strict majority of `eligible` (sorted by peer id) announce, and its entries; ("", [])
    when none has one (a plurality could be won by made-up identities: no group forms then)."""
    counts = Counter(e.member.state_hash for e in eligible)
    group_hash, top = counts.most_common(1)[0]
    if 2 * top <= len(eligible):
        return "", []
    return group_hash, [e for e in eligible if e.member.state_hash == group_hash]


def _may_post_by(p: PeerRecord, round_index: int, close_at: float) -> bool:
    """Whether `p` (at `round_index` or behind it) may post for the round by `close_at`: a peer at the round unless
    its announced end of steps comes after the close; one behind only with its steps ended by then."""
    if p.round == round_index:
        return p.round_ends_at <= close_at
    return 0 < p.round_ends_at <= close_at


async def _nothing() -> tuple[PeerRecord, ...]:
    return ()


async def _beside(read: Awaitable[Sequence[PeerRecord]], store: Awaitable[None]) -> Sequence[PeerRecord]:
    """The read's result, with `store` done at the same time; the first failure is raised once both ended
    (neither is left running unawaited)."""
    got, stored = await asyncio.gather(read, store, return_exceptions=True)
    for r in (got, stored):
        if isinstance(r, BaseException):
            raise r
    assert not isinstance(got, BaseException)
    return got


def _close_at(entries: Sequence[MatchEntry], window_s: float) -> float:
    return min(e.posted_at for e in entries) + window_s

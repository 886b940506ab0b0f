"""Matchmaking over the in-memory twin: identical groups, min_peers, late joiners, a silent leader, attempts."""

from __future__ import annotations

import asyncio

import pytest

from swarmtrain.averaging.matchmaking import Matchmaker, MatchOutcome
from swarmtrain.discovery import GroupRecord, InMemoryDiscovery, InMemoryRegistry, MatchEntry, PeerRecord
from swarmtrain.round.group import Member

pytestmark = pytest.mark.unit

RUN = "swarmtrain"
WINDOW_S = 0.3  # wide against the 0.09 s arrival spread: a loaded CI box stalls the loop


def _swarm(n: int, reg: InMemoryRegistry | None = None) -> tuple[InMemoryRegistry, list[InMemoryDiscovery]]:
    reg = reg or InMemoryRegistry()
    return reg, [InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=30) for _ in range(n)]


def _member(d: InMemoryDiscovery, i: int, *, client: bool = False) -> Member:
    return Member(peer_id=d.peer_id, endpoint="" if client else f"127.0.0.1:{5000 + i}", client_mode=client,
                  bandwidth_bytes_per_s=1e6 * (i + 1))


def _mm(d: InMemoryDiscovery, *, min_peers: int = 2, **kw: float) -> Matchmaker:
    return Matchmaker(d, min_peers=min_peers, window_s=WINDOW_S, **kw)


def _fast_mm(d: InMemoryDiscovery, *, min_peers: int = 2) -> Matchmaker:
    """Short decision/commit/io timeouts: an attempt is over ~1 s after its window closed."""
    return Matchmaker(d, min_peers=min_peers, window_s=WINDOW_S, decision_timeout_s=0.3, commit_timeout_s=0.3,
                      io_timeout_s=0.3)


async def _match_all(peers: list[InMemoryDiscovery], round_index: int, *, delays_s: list[float] | None = None,
                     min_peers: int = 2) -> list[MatchOutcome]:
    async def one(i: int, d: InMemoryDiscovery) -> MatchOutcome:
        if delays_s:
            await asyncio.sleep(delays_s[i])
        return await _mm(d, min_peers=min_peers).form_group(round_index, _member(d, i, client=i == 2))

    return list(await asyncio.gather(*(one(i, d) for i, d in enumerate(peers))))


def test_all_members_get_the_identical_group() -> None:
    _, peers = _swarm(4)
    outcomes = asyncio.run(_match_all(peers, 0, delays_s=[0.0, 0.03, 0.06, 0.09]))
    groups = [o.group for o in outcomes]
    assert all(g is not None for g in groups)
    assert len({g for g in groups}) == 1  # frozen dataclasses: equal members, order, bandwidths
    g = groups[0]
    assert g is not None and g.round == 0 and g.run_id == RUN
    assert [m.peer_id for m in g.members] == sorted(d.peer_id for d in peers)
    assert [m.peer_id for m in g.reducers] == sorted(d.peer_id for i, d in enumerate(peers) if i != 2)
    assert {o.leader_id for o in outcomes} == {min(d.peer_id for d in peers)}


def test_identical_under_control_plane_latency() -> None:
    reg = InMemoryRegistry(latency_s=0.01)
    _, peers = _swarm(3, reg)
    outcomes = asyncio.run(_match_all(peers, 5, delays_s=[0.05, 0.0, 0.02]))
    assert len({o.group for o in outcomes}) == 1 and outcomes[0].group is not None


def test_fewer_than_min_peers_gives_no_group_on_everyone() -> None:
    _, peers = _swarm(2)
    outcomes = asyncio.run(_match_all(peers, 0, min_peers=3))
    assert all(o.group is None and "too few peers" in o.reason for o in outcomes)
    _, (alone,) = _swarm(1)
    (out,) = asyncio.run(_match_all([alone], 0, min_peers=2))
    assert out.group is None and "too few" in out.reason and not out.late


def test_min_peers_one_lets_a_lone_peer_proceed() -> None:
    _, (alone,) = _swarm(1)
    (out,) = asyncio.run(_match_all([alone], 0, min_peers=1))
    assert out.group is not None and [m.peer_id for m in out.group.members] == [alone.peer_id]


def test_a_late_joiner_lands_in_the_next_round() -> None:
    async def main() -> tuple[list[MatchOutcome], MatchOutcome, list[MatchOutcome]]:
        _, peers = _swarm(3)
        early, late = peers[:2], peers[2]

        async def late_one() -> MatchOutcome:
            await asyncio.sleep(WINDOW_S * 1.5)  # after the window of round 0 closed
            return await _mm(late).form_group(0, _member(late, 2))

        *first, late_out = await asyncio.gather(*(_mm(d).form_group(0, _member(d, i)) for i, d in enumerate(early)),
                                                late_one())
        second = await _match_all(peers, 1)
        return list(first), late_out, second

    first, late_out, second = asyncio.run(main())
    assert len({o.group for o in first}) == 1 and first[0].group is not None
    assert len(first[0].group.members) == 2
    assert late_out.group is None and late_out.late and "after attempt 0's window closed" in late_out.reason
    assert late_out.retry_at > 0 and late_out.attempt == 0
    assert len({o.group for o in second}) == 1 and second[0].group is not None
    assert len(second[0].group.members) == 3 and second[0].group.round == 1


def test_a_silent_leader_aborts_the_round_for_followers() -> None:
    async def main() -> MatchOutcome:
        reg = InMemoryRegistry()
        leader = InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=30, peer_id="aaa")
        follower = InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=30, peer_id="bbb")
        # The leader posts its entry, then dies before publishing the group.
        await leader.post_entry(MatchEntry(run_id=RUN, round=0, member=_member(leader, 0), posted_at=leader.now()),
                                keep_s=60, timeout_s=1)
        return await _mm(follower, decision_timeout_s=0.1).form_group(0, _member(follower, 1))

    out = asyncio.run(main())
    assert out.group is None and out.leader_id == "aaa" and "published no group" in out.reason


def test_a_follower_ignores_a_group_from_a_peer_that_is_not_its_leader() -> None:
    async def main() -> MatchOutcome:
        reg = InMemoryRegistry()
        a = InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=30, peer_id="aaa")
        z = InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=30, peer_id="zzz")
        m = InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=30, peer_id="mmm")
        await a.post_entry(MatchEntry(run_id=RUN, round=0, member=_member(a, 0), posted_at=a.now()), keep_s=60,
                           timeout_s=1)
        # m pretends to lead (it is not the smallest id) and lists z; z must not adopt it.
        await m.post_group(GroupRecord(run_id=RUN, round=0, leader_id="mmm",
                                       members=(_member(m, 1), _member(z, 2)), window_close_at=m.now()),
                           keep_s=60, timeout_s=1)
        return await _mm(z, decision_timeout_s=0.1).form_group(0, _member(z, 2))

    out = asyncio.run(main())
    assert out.group is None and out.leader_id == "aaa" and "['mmm'] ignored" in out.reason


def test_member_must_be_this_peer() -> None:
    _, (a, b) = _swarm(2)
    with pytest.raises(ValueError, match="is not this peer"):
        asyncio.run(_mm(a).form_group(0, _member(b, 1)))


def test_a_late_peer_never_opens_a_competing_attempt_while_the_round_may_commit() -> None:
    """The split-commit regression: records outlive record_ttl_s and a late peer waits out the attempt."""
    async def main() -> tuple[list[MatchOutcome], list[MatchOutcome], MatchOutcome]:
        reg = InMemoryRegistry()
        # record_ttl_s far below the attempt's span: matchmaking records must not expire with it.
        early = [InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=0.2) for _ in range(2)]
        late = InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=0.2)
        first = await asyncio.gather(*(_fast_mm(d).form_group(0, _member(d, i)) for i, d in enumerate(early)))
        lone = _fast_mm(late, min_peers=1)  # would commit alone if it could open its own window
        tries = [await lone.form_group(0, _member(late, 2))]
        while late.now() < tries[0].retry_at - 0.2 and len(tries) < 100:  # keep knocking until just before its end
            await asyncio.sleep(0.05)
            tries.append(await lone.form_group(0, _member(late, 2)))
        # The first group committed round 0: its members announce round 1.
        for d in early:
            await d.announce(PeerRecord(run_id=RUN, peer_id=d.peer_id, endpoint="127.0.0.1:1", round=1,
                                        heartbeat_at=d.now()), timeout_s=1)
        await asyncio.sleep(max(0.0, tries[0].retry_at - late.now()))
        return list(first), tries, await lone.form_group(0, _member(late, 2))

    first, tries, after = asyncio.run(main())
    assert first[0].group is not None and len({o.group for o in first}) == 1
    assert len(tries) > 1 and all(t.group is None and t.late and t.attempt == 0 for t in tries)
    assert after.group is None and after.late and "committed without this peer" in after.reason


def test_after_an_attempt_ends_uncommitted_the_round_opens_its_next_attempt() -> None:
    async def main() -> tuple[MatchOutcome, list[MatchOutcome]]:
        _, peers = _swarm(3)
        first = await asyncio.gather(*(_fast_mm(d).form_group(0, _member(d, i)) for i, d in enumerate(peers[:2])))
        assert first[0].group is not None
        # Nobody committed (no peer past round 0): once attempt 0's end passed, attempt 1 opens for all three.
        await asyncio.sleep(max(0.0, first[0].retry_at - peers[0].now()))
        return first[0], await _match_all_fast(peers, 0)

    first, second = asyncio.run(main())
    assert first.attempt == 0
    assert len({o.group for o in second}) == 1 and second[0].group is not None
    assert second[0].attempt == 1 and second[0].group.attempt == 1 and len(second[0].group.members) == 3
    assert second[0].group.group_id != first.group.group_id  # type: ignore[union-attr]


def test_a_too_small_attempt_is_over_at_once_so_a_newcomer_opens_the_next_one() -> None:
    async def main() -> tuple[MatchOutcome, MatchOutcome]:
        _, (alone, newcomer) = _swarm(2)
        out = await _fast_mm(alone).form_group(0, _member(alone, 0))
        return out, await _fast_mm(newcomer).form_group(0, _member(newcomer, 1))

    alone, newcomer = asyncio.run(main())
    assert alone.group is None and "too few" in alone.reason and alone.retry_at == 0.0
    assert newcomer.attempt == 1 and not newcomer.late  # not late for attempt 0: it could never commit


async def _match_all_fast(peers: list[InMemoryDiscovery], round_index: int) -> list[MatchOutcome]:
    return list(await asyncio.gather(*(_fast_mm(d).form_group(round_index, _member(d, i))
                                       for i, d in enumerate(peers))))


async def _announce(d: InMemoryDiscovery, round_index: int, *, round_ends_at: float = 0.0) -> None:
    await d.announce(PeerRecord(run_id=RUN, peer_id=d.peer_id, endpoint="127.0.0.1:1", round=round_index,
                                heartbeat_at=d.now(), round_ends_at=round_ends_at), timeout_s=1)


@pytest.mark.parametrize("newcomer_id", ["zzz-newcomer", "aaa-newcomer"])  # follows / would lead
def test_the_window_closes_early_once_every_peer_at_the_round_posted(newcomer_id: str) -> None:
    async def main() -> tuple[list[MatchOutcome], MatchOutcome]:
        reg, expected = _swarm(3)
        newcomer = InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=30, peer_id=newcomer_id)
        for d in expected:
            await _announce(d, 2)

        async def one(i: int, d: InMemoryDiscovery) -> MatchOutcome:
            await asyncio.sleep(0.02 * i)
            return await Matchmaker(d, min_peers=2, window_s=30.0).form_group(2, _member(d, i))

        # A 30 s window: only an early close finishes inside the 10 s deadline.
        outcomes = await asyncio.wait_for(asyncio.gather(*(one(i, d) for i, d in enumerate(expected))), timeout=10)
        # A peer nobody expected (no record at round 2) posts inside the nominal window, after the group.
        late = await asyncio.wait_for(Matchmaker(newcomer, min_peers=2, window_s=30.0, decision_timeout_s=0.3)
                                      .form_group(2, _member(newcomer, 3)), timeout=45)
        return list(outcomes), late

    outcomes, late = asyncio.run(main())
    assert len({o.group for o in outcomes}) == 1 and outcomes[0].group is not None
    assert len(outcomes[0].group.members) == 3
    assert late.group is None and late.retry_at > 0  # it waits the attempt out; it never forms a second group


@pytest.mark.parametrize("stale_after_s", [5.0, None])
def test_a_record_that_stopped_beating_is_not_waited_for(stale_after_s: float | None) -> None:
    """A crashed peer's record stays live until it expires (here 30 s): with `stale_after_s` the others close the
    window early without it once its last beat is older than that; without, they wait the whole window."""
    async def main() -> tuple[list[MatchOutcome], float]:
        _, (a, b, dead) = _swarm(3)
        for d in (a, b):
            await _announce(d, 4)
        await dead.announce(PeerRecord(run_id=RUN, peer_id=dead.peer_id, endpoint="127.0.0.1:1", round=4,
                                       heartbeat_at=dead.now() - 20.0), timeout_s=1)  # last beat 20 s ago
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        outs = await asyncio.gather(*(Matchmaker(d, min_peers=2, window_s=3.0, stale_after_s=stale_after_s)
                                      .form_group(4, _member(d, i)) for i, d in enumerate((a, b))))
        return list(outs), loop.time() - t0

    outs, elapsed_s = asyncio.run(main())
    assert len({o.group for o in outs}) == 1 and outs[0].group is not None and len(outs[0].group.members) == 2
    if stale_after_s is None:
        assert elapsed_s >= 3.0  # the whole window, for a peer that will never post
    else:
        assert elapsed_s < 2.0, elapsed_s


def test_a_lone_expected_peer_waits_the_whole_window_for_newcomers() -> None:
    """Early close needs min_peers expected peers: a peer alone at its round must not spin through attempts."""
    async def main() -> tuple[MatchOutcome, float]:
        _, (alone,) = _swarm(1)
        await _announce(alone, 7)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out = await Matchmaker(alone, min_peers=2, window_s=0.5).form_group(7, _member(alone, 0))
        return out, loop.time() - t0

    out, elapsed_s = asyncio.run(main())
    assert out.group is None and "too few" in out.reason
    assert elapsed_s >= 0.5  # the full window (a lower bound, so a slow box cannot fail it)


def _window_with_a_silent_third(third_round: int, ends_in_s: float | None) -> tuple[list[MatchOutcome], float]:
    """a and b at round 5 match it with a 0.5 s window; a third peer announces `third_round` and, unless None, the
    end of its steps `ends_in_s` from now, and never posts. Their outcomes and how long they took."""
    async def main() -> tuple[list[MatchOutcome], float]:
        _, (a, b, third) = _swarm(3)
        for d in (a, b):
            await _announce(d, 5)
        await _announce(third, third_round, round_ends_at=0.0 if ends_in_s is None else third.now() + ends_in_s)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        outs = await asyncio.gather(*(Matchmaker(d, min_peers=2, window_s=0.5).form_group(5, _member(d, i))
                                      for i, d in enumerate((a, b))))
        return list(outs), loop.time() - t0

    outs, elapsed_s = asyncio.run(main())
    assert len({o.group for o in outs}) == 1 and outs[0].group is not None and len(outs[0].group.members) == 2
    return outs, elapsed_s


@pytest.mark.parametrize(("steps_ended", "waits"), [(True, True), (False, False)])
def test_a_peer_behind_the_round_holds_the_window_only_with_its_steps_done(steps_ended: bool, waits: bool) -> None:
    """A peer behind the round whose record says its inner steps ended holds trained steps and heals to the round
    with them: it is expected (closing early would exclude it every round). One restarted from its checkpoint
    announces no round end: it must heal and train first, and waiting for it costs the round its window."""
    _, elapsed_s = _window_with_a_silent_third(3, -1.0 if steps_ended else None)  # it would heal to 5 and post
    assert (elapsed_s >= 0.5) == waits, elapsed_s  # the whole window only while waiting for it


@pytest.mark.parametrize(("ends_in_s", "waits"), [(0.2, True), (5.0, False)])
def test_a_peer_whose_steps_end_after_the_close_does_not_hold_the_window(ends_in_s: float, waits: bool) -> None:
    """A peer at the round whose record says its inner steps end before the close is waited for; one whose steps
    end after it could not post in time (a peer out of step with the swarm, or slower than its window)."""
    _, elapsed_s = _window_with_a_silent_third(5, ends_in_s)
    assert (elapsed_s >= 0.5) == waits, elapsed_s


@pytest.mark.parametrize(("beating", "waits"), [(True, True), (False, False)])
def test_a_peer_whose_heartbeat_stands_still_does_not_hold_the_window(beating: bool, waits: bool) -> None:
    """A peer at the round that has not posted: one that still beats is alive (slow, or posting) and is waited for;
    one whose heartbeat stands still while the others wait died before posting, which its record would show only
    once it goes stale (longer than the window), and is not. Its stamps are compared with each other, never with
    the waiting peer's clock."""
    async def main() -> tuple[list[MatchOutcome], float]:
        _, (a, b, c) = _swarm(3)
        for d in (a, b):
            await _announce(d, 5)
        # Its clock is 10 s off: behind when it lives (its beats look old), ahead when it died (its last one new).
        skew_s = -10.0 if beating else 10.0

        async def announce() -> None:
            await c.announce(PeerRecord(run_id=RUN, peer_id=c.peer_id, endpoint="127.0.0.1:1", round=5,
                                        heartbeat_at=c.now() + skew_s), timeout_s=1)  # no end announced

        await announce()

        async def beat() -> None:  # alive: its heartbeats go on while it (slowly) gets to posting
            while True:
                await asyncio.sleep(0.05)
                await announce()

        beats = asyncio.ensure_future(beat()) if beating else None
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            # A live beat every 0.05 s: standing still for 0.3 s takes six beats missed on a loaded machine.
            outs = await asyncio.gather(*(Matchmaker(d, min_peers=2, window_s=1.0, stale_after_s=30.0,
                                                     overdue_s=0.3).form_group(5, _member(d, i))
                                          for i, d in enumerate((a, b))))
        finally:
            if beats is not None:
                beats.cancel()
        return list(outs), loop.time() - t0

    outs, elapsed_s = asyncio.run(main())
    assert len({o.group for o in outs}) == 1 and outs[0].group is not None and len(outs[0].group.members) == 2
    assert (elapsed_s >= 1.0) == waits, elapsed_s


def _hashed(d: InMemoryDiscovery, i: int, state_hash: str) -> Member:
    return Member(peer_id=d.peer_id, endpoint=f"127.0.0.1:{5000 + i}", state_hash=state_hash)


async def _match_hashed(peers: list[InMemoryDiscovery], hashes: list[str]) -> list[MatchOutcome]:
    return list(await asyncio.gather(*(_mm(d).form_group(0, _hashed(d, i, h))
                                       for i, (d, h) in enumerate(zip(peers, hashes, strict=True)))))


def test_a_member_whose_theta_differs_is_left_out_and_told_which_hash_to_heal_to() -> None:
    _, peers = _swarm(4)
    good, bad = "ab" * 32, "cd" * 32
    hashes = [good] * 4
    smallest = min(range(4), key=lambda i: peers[i].peer_id)
    hashes[smallest] = bad  # the peer that would lead: the group must neither follow nor include it
    outcomes = asyncio.run(_match_hashed(peers, hashes))
    out = outcomes[smallest]
    assert out.group is None and out.heal_to_hash == good and "θ_global differs" in out.reason, out
    groups = {o.group for i, o in enumerate(outcomes) if i != smallest}
    assert len(groups) == 1
    (g,) = groups
    assert g is not None and {m.state_hash for m in g.members} == {good}
    assert sorted(m.peer_id for m in g.members) == sorted(d.peer_id for i, d in enumerate(peers) if i != smallest)
    assert {o.leader_id for i, o in enumerate(outcomes) if i != smallest} == {g.members[0].peer_id}


def test_a_tie_between_two_hashes_forms_no_group_and_the_hash_is_part_of_the_group_id() -> None:
    """Two states announced by two entries each: no strict majority, so no group on either side (a tie broken
    by peer id would let identities ground for small ids outvote the honest peers)."""
    _, peers = _swarm(4)
    order = sorted(range(4), key=lambda i: peers[i].peer_id)
    hashes = [""] * 4
    for rank, i in enumerate(order):
        hashes[i] = "11" * 32 if rank in (0, 3) else "22" * 32
    outcomes = asyncio.run(_match_hashed(peers, hashes))
    assert all(o.group is None and not o.heal_to_hash for o in outcomes), outcomes
    assert all("most of the attempt's entries" in o.reason for o in outcomes)
    _, fresh = _swarm(4)
    good = asyncio.run(_match_hashed(fresh, ["11" * 32] * 4))
    g = good[0].group
    assert g is not None
    other = type(g)(run_id=g.run_id, round=g.round, attempt=g.attempt,
                    members=tuple(Member(peer_id=m.peer_id, endpoint=m.endpoint, state_hash="22" * 32)
                                  for m in g.members))
    assert other.group_id != g.group_id  # the same peers averaging from another θ are another group


def test_a_peer_just_after_the_close_waits_for_the_leaders_decision_instead_of_waiting_the_attempt_out() -> None:
    """A lone leader's "too small" record lands a little after its window closed: a newcomer arriving in
    between must read it and open the next attempt with the leader, not take the attempt for in flight."""
    async def main() -> tuple[MatchOutcome, MatchOutcome, MatchOutcome]:
        _, (leader, newcomer) = _swarm(2)
        lead = Matchmaker(leader, min_peers=2, window_s=WINDOW_S, settle_s=0.4, decision_timeout_s=0.3,
                          commit_timeout_s=0.3, io_timeout_s=0.3)
        new = Matchmaker(newcomer, min_peers=2, window_s=WINDOW_S, decision_timeout_s=1.0, commit_timeout_s=0.3,
                         io_timeout_s=0.3)
        first = asyncio.create_task(lead.form_group(0, _member(leader, 0)))
        await asyncio.sleep(WINDOW_S + 0.05)  # after the close, before the leader publishes its decision
        joined = asyncio.create_task(new.form_group(0, _member(newcomer, 1)))
        alone = await first
        again = await lead.form_group(0, _member(leader, 0))  # the leader goes on to the next attempt
        return alone, again, await joined

    alone, again, joined = asyncio.run(main())
    assert alone.group is None and "too few" in alone.reason
    assert not joined.late and joined.attempt == 1 and joined.group is not None, joined.reason
    assert again.group == joined.group and len(joined.group.members) == 2


@pytest.mark.parametrize(("stale_after_s", "silent_s"), [(5.0, 20.0), (5.0, 4.2), (None, 20.0)])
def test_a_leader_that_died_after_posting_is_passed_over(stale_after_s: float | None, silent_s: float) -> None:
    """The smallest id posted its entry and died: its record's last beat is `silent_s` old when the others start
    (4.2 s: it stops beating, by `stale_after_s`, only while they wait for its group). With `stale_after_s` the
    others stop waiting for its group and leave it out of theirs; the next smallest leads. Without, they wait
    for the dead leader's group until the decision is due, and the attempt is lost."""
    async def main() -> list[MatchOutcome]:
        reg = InMemoryRegistry()
        dead = InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=30, peer_id="aaa")
        live = [InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=30, peer_id=p) for p in ("bbb", "ccc", "ddd")]
        for d in live:
            await _announce(d, 4)
        await dead.announce(PeerRecord(run_id=RUN, peer_id="aaa", endpoint="127.0.0.1:1", round=4,
                                       heartbeat_at=dead.now() - silent_s), timeout_s=1)
        await dead.post_entry(MatchEntry(run_id=RUN, round=4, member=_member(dead, 0), posted_at=dead.now()),
                              keep_s=60, timeout_s=1)
        return list(await asyncio.gather(*(
            Matchmaker(d, min_peers=2, window_s=WINDOW_S, decision_timeout_s=3.0, stale_after_s=stale_after_s)
            .form_group(4, _member(d, i + 1)) for i, d in enumerate(live))))

    outs = asyncio.run(main())
    if stale_after_s is None:
        assert all(o.group is None and o.leader_id == "aaa" and "published no group" in o.reason for o in outs)
        return
    groups = {o.group for o in outs}
    assert len(groups) == 1 and outs[0].group is not None, [o.reason for o in outs]
    assert [m.peer_id for m in outs[0].group.members] == ["bbb", "ccc", "ddd"] and outs[0].leader_id == "bbb"


@pytest.mark.parametrize(("answers", "waits"), [(False, False), (True, True), (None, True)])
def test_a_missing_peer_that_no_process_answers_for_does_not_hold_the_window(answers: bool | None,
                                                                             waits: bool) -> None:
    """c is expected at round 5 and its record still beats (its heartbeat rule would wait for it), but it never
    posts. Once half the expected peers posted, a and b ask it whether it is there (`probe`): nobody answering
    (its process gone) it is not waited for; answering, or timing out (frozen, or slow), it is."""
    asked: list[str] = []

    async def probe(record: PeerRecord) -> bool | None:
        asked.append(record.peer_id)
        return answers

    async def main() -> tuple[list[MatchOutcome], float, str]:
        _, (a, b, c) = _swarm(3)
        for d in (a, b):
            await _announce(d, 5)

        async def beat() -> None:
            while True:
                await c.announce(PeerRecord(run_id=RUN, peer_id=c.peer_id, endpoint="127.0.0.1:1", round=5,
                                            heartbeat_at=c.now()), timeout_s=1)
                await asyncio.sleep(0.05)

        beats = asyncio.ensure_future(beat())
        await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            outs = await asyncio.gather(*(Matchmaker(d, min_peers=2, window_s=1.0, stale_after_s=30.0, overdue_s=0.3,
                                                     probe=probe).form_group(5, _member(d, i))
                                          for i, d in enumerate((a, b))))
        finally:
            beats.cancel()
        return list(outs), loop.time() - t0, c.peer_id

    outs, elapsed_s, missing = asyncio.run(main())
    assert len({o.group for o in outs}) == 1 and outs[0].group is not None and len(outs[0].group.members) == 2
    assert (elapsed_s >= 1.0) == waits, elapsed_s
    assert asked and set(asked) == {missing}  # only the missing peer is asked, once by each of a and b
    assert len(asked) == 2


@pytest.mark.parametrize(("announces_after_s", "waits"), [(0.1, False), (0.5, False), (None, True)])
def test_a_missing_peer_that_restarted_does_not_hold_the_window(announces_after_s: float | None, waits: bool) -> None:
    """c is expected at round 5 (its steps end before the close) and never posts. It answers the probe: alive. Read
    again, its record announces steps ending long after the close (it crashed and restarted from its checkpoint
    while the window was open, and trains the round again): it cannot post in time and is not waited for, also
    when it announces that only some beats after the probe (a restarted peer times a step first). One whose record
    still says it may post is waited for to the end of the window."""
    async def probe(record: PeerRecord) -> bool | None:
        return True

    async def main() -> tuple[list[MatchOutcome], float]:
        _, (a, b, c) = _swarm(3)
        for d in (a, b):
            await _announce(d, 5)
        first_ends_at = c.now() + 0.05
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def beat() -> None:  # it beats throughout: only its announced end of steps tells
            while True:
                late = announces_after_s is not None and loop.time() - t0 >= announces_after_s
                await c.announce(PeerRecord(run_id=RUN, peer_id=c.peer_id, endpoint="127.0.0.1:1", round=5,
                                            heartbeat_at=c.now(), round_ends_at=c.now() + 30.0 if late
                                            else first_ends_at), timeout_s=1)
                await asyncio.sleep(0.05)

        beats = asyncio.ensure_future(beat())
        await asyncio.sleep(0.01)
        try:
            outs = await asyncio.gather(*(Matchmaker(d, min_peers=2, window_s=1.0, stale_after_s=30.0, overdue_s=0.3,
                                                     probe=probe).form_group(5, _member(d, i))
                                          for i, d in enumerate((a, b))))
        finally:
            beats.cancel()
        return list(outs), loop.time() - t0

    outs, elapsed_s = asyncio.run(main())
    assert len({o.group for o in outs}) == 1 and outs[0].group is not None and len(outs[0].group.members) == 2
    assert (elapsed_s >= 1.0) == waits, elapsed_s

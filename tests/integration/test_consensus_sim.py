"""The round's decision under the deterministic simulation tester (swarmtrain/testing/sim): the production driver,
matchmaking, all-reduce, voters, proposers, heals and checkpoints on virtual time, against fault schedules.

Three scripted schedules reproduce wedges the decision had before it was consensus, and the tester is checked
to find them on those rules (`rules="legacy"`: the first asker gets a voter's one vote for good, nobody
learns an outcome, a heal needs two peers ahead, a voter leaving after voting counts in its round) and to
find none on the rules shipped. Then 200 random schedules (5-9 peers, ±8 s skew, crashes and restarts,
freezes, partitions, stale DHT reads, lost calls, graceful leaves) must
show no round with two states and every live peer committing soon after the faults stop; longer runs are
`benchmarks/consensus_sim.py`'s.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import re
from concurrent.futures import ProcessPoolExecutor

import pytest

from swarmtrain.testing.sim.run import Fault, Schedule, SimResult, run_schedule

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SUITE_SEEDS = range(50_000, 50_200)  # apart from the benchmark's seeds
SUITE_FAULTS_UNTIL_S = 40.0


def _lone_committer(rules: str) -> Schedule:
    """4 peers. Reducer p02 serves its mean of round 2 to the first member that fetches it and dies before the
    others fetch it: that member holds every mean and asks for the round; the two others, retrying their
    all-reduce without p02, are 2 of 4 and cannot. p02 restarts 20 s later. (Which member fetches first depends
    on the round's timing: the fault names none.)"""
    crash = Fault(at=0.0, kind="mean_crash", peer=2, to=-1, round=2, down_s=20.0)
    return Schedule(seed=0, peers=4, skews_s=(0.0,) * 4, faults=(crash,), faults_until_s=40.0, rules=rules)


def _whole_swarm_restart(rules: str) -> Schedule:
    """5 peers checkpointing every 3 rounds all crash at once and restart 3 s later, from checkpoints older than
    the rounds they voted in."""
    faults = tuple(Fault(at=CRASH_AT_S, kind="crash", peer=i, down_s=3.0) for i in range(5))
    return Schedule(seed=2, peers=5, skews_s=(0.0, 3.0, -3.0, 6.0, -6.0), faults=faults,
                    faults_until_s=CRASH_AT_S + 5.0, rules=rules, checkpoint_every=3)


CRASH_AT_S = 16.0  # round 10 committed by then, the newest checkpoint at round 9 (the premise is asserted)


def test_a_reducer_dying_while_the_members_push_costs_a_retry_not_the_round() -> None:
    """12 peers. Reducer p02 takes p00's push of round 3 and dies: the members whose pushes reached it before
    learn of its death only when they ask for its contributors, the others at once. Those used to retry at once
    and close the retry's windows before the first ones came (4 of 12 contributors: no majority, the round
    aborted on every member and was matched again 6.7 s later); now every member retries together and the
    round commits in the same matchmaking."""
    crash = Fault(at=0.0, kind="push_crash", peer=2, to=0, round=3, down_s=30.0)
    result = run_schedule(Schedule(seed=0, peers=12, skews_s=(0.0,) * 12, faults=(crash,), faults_until_s=30.0))
    assert result.ok, result.summary()
    assert result.notes and "p02 crashed right after serving p00 the push of round 3" in result.notes[0]
    round3 = [(p, ok, why) for _, p, r, ok, why in result.ledger.attempts if r == 3 and p != "p02"]
    assert len(round3) == 11 and all(ok and "p02" in why for _, ok, why in round3), round3



def test_two_reducers_dying_at_different_moments_of_the_push_cost_one_retry_for_everyone() -> None:
    """12 peers. Reducer p02 dies right after taking p00's push of round 3, p05 right after taking p09's. Each
    member used to retry without the reducers its own pushes found dead: some without p02, some without p05,
    some without both, three sessions, none with a majority, and round 3 aborted on every member. A member whose
    push found one dead now also counts the reducers that do not answer for their contributors: everyone
    retries without both, in one session, and commits round 3 in that matchmaking (the same split lost a round
    of a simulated 1,000-peer swarm)."""
    faults = (Fault(at=0.0, kind="push_crash", peer=2, to=0, round=3, down_s=30.0),
              Fault(at=0.0, kind="push_crash", peer=5, to=9, round=3, down_s=30.0))
    result = run_schedule(Schedule(seed=0, peers=12, skews_s=(0.0,) * 12, faults=faults, faults_until_s=30.0))
    assert result.ok and result.ledger is not None, result.summary()
    assert len(result.notes) == 2, result.notes
    round3 = [(p, ok, why) for _, p, r, ok, why in result.ledger.attempts if r == 3 and p not in ("p02", "p05")]
    assert len(round3) == 10 and all(ok and "['p02', 'p05']" in why for _, ok, why in round3), round3

def test_the_retry_around_a_dead_reducer_does_not_wait_for_it_as_a_member() -> None:
    """The same crash: p02 was a member too, so every window of the retry used to wait for its push to the
    end (0.5 s here), round 3 committing 1.11 s after the crash. The retry's windows now close once the members
    the first attempt's live reducers heard from pushed: at most what was left of the first attempt's window
    (< 0.5 s) and the retry's own few calls."""
    window_s = 0.5
    crash = Fault(at=0.0, kind="push_crash", peer=2, to=0, round=3, down_s=30.0)
    result = run_schedule(Schedule(seed=0, peers=12, skews_s=(0.0,) * 12, faults=(crash,), faults_until_s=30.0,
                                   config=(f"averaging.contribution_window_s={window_s}",)))
    assert result.ok and result.ledger is not None, result.summary()
    crashed_at = float(result.notes[0].rsplit("t=", 1)[1])
    committed_at = min(t for t, _, r, _, _ in result.ledger.commits if r == 3)
    assert committed_at - crashed_at < 1.5 * window_s, (crashed_at, committed_at)


def test_the_tester_finds_the_lone_committer_wedge_on_the_legacy_rules_and_none_on_the_shipped_ones() -> None:
    legacy = run_schedule(_lone_committer("legacy"))
    served = re.fullmatch(r"p02 crashed right after serving (p0[013]) its mean of round 2 at t=.*", legacy.notes[0])
    assert served is not None, legacy.notes
    assert not legacy.safety and legacy.liveness, legacy.summary()
    assert legacy.ledger is not None
    final = {p: max((r for _, q, r, _, _ in legacy.ledger.commits if q == p), default=-1) for p in ("p00", "p01",
                                                                                                      "p03")}
    lone = served.group(1)
    assert final == {p: 2 if p == lone else 1 for p in final}, final  # it committed round 2 alone; nobody again

    paxos = run_schedule(_lone_committer("paxos"))
    assert paxos.notes and re.fullmatch(r"p02 crashed right after serving p0[013] its mean of round 2 at t=.*",
                                        paxos.notes[0]), paxos.notes
    assert paxos.ok, paxos.summary()
    assert paxos.ledger is not None
    assert {p for _, p, r, _, _ in paxos.ledger.commits if r == 2} >= {"p00", "p01", "p03"}  # learned, not healed


def test_a_whole_swarm_restarting_from_older_checkpoints_learns_the_rounds_it_replays() -> None:
    paxos = run_schedule(_whole_swarm_restart("paxos"))
    assert paxos.ok, paxos.summary()
    assert paxos.ledger is not None
    commits = paxos.ledger.commits
    before = max(r for t, _, r, _, _ in commits if t < CRASH_AT_S)
    assert before >= paxos.rounds_at_faults_end  # the checkpoints were behind the rounds committed: a replay
    chosen = {r: v for t, _, r, v, _ in commits if t < CRASH_AT_S}
    replayed = [(p, r, v) for t, p, r, v, _ in commits if t > CRASH_AT_S and r <= before]
    assert replayed and all(chosen[r] == v for _, r, v in replayed), replayed  # learned, the same values

    legacy = run_schedule(_whole_swarm_restart("legacy"))
    assert not legacy.safety and legacy.liveness, legacy.summary()  # every replayed round's votes were spent


def _half_leave(rules: str) -> Schedule:
    """4 peers; two leave gracefully for good right after promising a ballot of round 3 (an attempt they will not
    finish): the other two must commit round 3 and go on."""
    faults = tuple(Fault(at=0.0, kind="leave", peer=i, round=3) for i in (2, 3))
    return Schedule(seed=0, peers=4, skews_s=(0.0,) * 4, faults=faults, faults_until_s=20.0, rules=rules)


def test_half_the_voters_leaving_after_an_aborted_attempt_do_not_hold_the_round() -> None:
    """Leavers used to count in the round they left in when they had voted in it, so half of them leaving that
    way left the rest a half, never a majority. A retirement now names the ballot the leaver promised, and
    counts for every ballot above it."""
    legacy = run_schedule(_half_leave("legacy"))
    assert len(legacy.notes) == 2 and all("left right after promising a ballot of round 3" in n
                                          for n in legacy.notes)
    assert not legacy.safety and legacy.liveness and legacy.rounds == 3, legacy.summary()

    paxos = run_schedule(_half_leave("paxos"))
    assert len(paxos.notes) == 2 and paxos.ok and paxos.rounds > 4, paxos.summary()
    assert paxos.ledger is not None
    # The leavers finish the attempt under way (a daemon leaves at the round's end) and hand over; the other
    # two commit round 3 and go on without them.
    assert {"p00", "p01"} <= {p for _, p, r, _, _ in paxos.ledger.commits if r == 3}
    assert max(r for _, p, r, _, _ in paxos.ledger.commits if p in ("p02", "p03")) <= 4
    assert max(r for _, p, r, _, _ in paxos.ledger.commits if p == "p00") > 5


@pytest.mark.parametrize("seed", [1190, 237, 1896, 1793])
def test_voters_leaving_a_round_undecided_do_not_hold_it(seed: int) -> None:
    """Schedules of the benchmark's range that wedged a round for good once leaves met other faults:

    * 1190: 8 peers; round 0 was committed by p00 and p01 alone, so they are round 1's only voters, and both
      leave during round 1 (and the DHT serves stale reads for 4 s): every voter of the round retired.
    * 237: 9 peers; round 1 has two voters, one of which (p05, frozen for 16 s before) voted in the round and
      left: it stayed counted in the round it had accepted in, and the other voter alone is no quorum.
    * 1896: 5 peers; p00, a voter of round 0 beside p01, accepted a value and left while the swarm was cut in
      two and p01 down; the value's material left with it.
    * 1793: 5 peers; p00 commits round 10 while the others are cut off from it, then leaves: the round's only
      certificate left with it, and round 10's other voter alone is no quorum.

    A retirement now names what the leaver accepted (the ballots above its promise carry it), the last live
    voters of a round vote on until the swarm is past it and a leaver ahead of everyone stays until a peer has
    learned its round (`RoundDriver.hand_over`), a departure record is retried, and a value that provably had
    no quorum whose material nobody holds is dropped."""
    result = run_schedule(Schedule.draw(seed, faults_until_s=SUITE_FAULTS_UNTIL_S))
    assert "leave" in {f.kind for f in result.schedule.faults}
    assert result.ok and result.rounds > result.rounds_at_faults_end, result.summary()


@pytest.mark.parametrize("seed", [4197, 7098])
def test_restarted_voters_learn_with_their_own_votes_and_a_leave_cut_short_is_announced(seed: int) -> None:
    """Two schedules of the benchmark's range that wedged before:

    * 4197: 7 peers; three voters of round 2 committed it, crashed and restarted from checkpoints of round 2,
      while the one peer ahead held round 3 by a download. Learning round 2 from its voters' grants, each left
      out its own: two grants of a base of four. A learner now counts its own vote like any voter's.
    * 7098: 5 peers; p00, one of round 1's two voters, was killed during its leave, after storing its
      retirement and before announcing it. Back as its next incarnation, the others still counted the retired
      one, which grants nothing: round 1 waited for it for good. A start now announces the retirements the
      vote book holds (and the tester restarts a peer killed in its leave, as any crashed peer)."""
    result = run_schedule(Schedule.draw(seed, faults_until_s=SUITE_FAULTS_UNTIL_S))
    assert result.ok and result.rounds > result.rounds_at_faults_end, result.summary()


@pytest.mark.parametrize("seed", [4164, 6242, 9709])
def test_a_round_whose_every_voter_retired_undecided_goes_on_with_the_successors_they_named(seed: int) -> None:
    """Schedules of the benchmark's range in which every voter of a round left before it was decided, the last
    one after its hand-over's bound ran out (4164: round 0's two genesis voters of 8 peers, lost calls and stale
    reads failing every attempt meanwhile; 6242: round 0's, with a partition and a crash; 9709: round 1's two
    voters, the second leaving at once on a stale record that showed the first still live). Nobody was left to
    form a quorum. A retirement now names the live peers at its round as successors, and once every voter
    retired having accepted nothing there, they decide it."""
    result = run_schedule(Schedule.draw(seed, faults_until_s=SUITE_FAULTS_UNTIL_S))
    assert "leave" in {f.kind for f in result.schedule.faults}
    assert result.ok and result.rounds > result.rounds_at_faults_end, result.summary()


def _run_legacy(seed: int) -> SimResult:
    result = run_schedule(dataclasses.replace(Schedule.draw(seed, faults_until_s=SUITE_FAULTS_UNTIL_S),
                                              rules="legacy"))
    result.ledger = None
    return result


def test_random_schedules_wedge_the_legacy_rules() -> None:
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(_run_legacy, SUITE_SEEDS[:8]))
    assert all(not r.safety for r in results)
    assert sum(bool(r.liveness) for r in results) >= 3, [r.summary() for r in results]


def _run(seed: int) -> SimResult:
    result = run_schedule(Schedule.draw(seed, faults_until_s=SUITE_FAULTS_UNTIL_S))
    result.ledger = None  # not sent back across the process boundary
    return result


def test_200_random_fault_schedules_keep_one_state_per_round_and_recover() -> None:
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(_run, SUITE_SEEDS, chunksize=10))
    failed = [r.summary() for r in results if not r.ok]
    assert not failed, failed
    kinds = {f.kind for r in results for f in r.schedule.faults}
    assert kinds == {"crash", "freeze", "partition", "stale", "leave"}
    assert sum(r.rounds for r in results) > 200 * 5  # the swarms did train, round after round


COMMITTEE_SEEDS = range(60_000, 60_040)


def _run_with_three_voters(seed: int) -> SimResult:
    schedule = Schedule.draw(seed, faults_until_s=SUITE_FAULTS_UNTIL_S)
    result = run_schedule(dataclasses.replace(schedule, config=("averaging.max_voters=3",)))
    result.ledger = None
    return result


def test_rounds_decided_by_three_voters_of_each_swarm_keep_one_state_and_recover() -> None:
    """Each commit names 3 of its 5-9 contributors as the next round's voters (averaging.max_voters): under the
    same random faults (crashes, freezes, partitions, stale reads, graceful leaves of voters), no round has two
    states and every live peer commits soon after the faults stop."""
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(_run_with_three_voters, COMMITTEE_SEEDS, chunksize=5))
    failed = [r.summary() for r in results if not r.ok]
    assert not failed, failed
    assert sum(r.rounds for r in results) > len(COMMITTEE_SEEDS) * 5
    assert any(f.kind == "leave" for r in results for f in r.schedule.faults)

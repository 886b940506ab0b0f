"""The all-reduce on 3-4 loopback peers under a deterministic FaultPlan: every member commits the same,
reference-exact mean, or every member aborts."""

from __future__ import annotations

import logging

import pytest
import torch
from allreduce_swarm import Swarm, deltas_for, reference_mean

from swarmtrain.averaging.reducer import shard_bounds
from swarmtrain.diloco.averager import AverageResult
from swarmtrain.testing import CrashPlan, FaultPlan

pytestmark = pytest.mark.integration

NAMES = ["a", "b", "c", "d"]
NUMEL = 5000


def _committed_same(results: dict[str, AverageResult], expected: torch.Tensor, contributors: list[str]) -> None:
    for name, r in results.items():
        assert r.committed, f"{name} aborted: {r.reason}"
        assert list(r.members) == contributors, name
        assert r.mean is not None and torch.equal(r.mean_tensor(), expected), (
            f"{name}'s mean differs from the reference")


def _equal_bounds(num_reducers: int) -> list[tuple[int, int]]:
    return shard_bounds(NUMEL, (0.0,) * num_reducers)


def test_commit_is_bit_identical_to_reference_with_client_and_uneven_shards(no_thread_leak: None) -> None:
    bandwidth = {"a": 1e9, "b": 3e9, "c": 2e9, "d": 1e9}
    with Swarm(NAMES, client_mode=["d"], bandwidth=bandwidth) as swarm:
        for round_index in range(2):
            deltas = deltas_for(NAMES, NUMEL, seed=round_index)
            results = swarm.average(round_index, deltas)
            bounds = shard_bounds(NUMEL, (1e9, 3e9, 2e9))
            assert bounds[1][1] - bounds[1][0] == 2500  # b reduces half: sized by bandwidth
            _committed_same(results, reference_mean(deltas, NAMES, bounds), NAMES)
            assert all(r.bytes_sent > 0 and r.bytes_received > 0 for r in results.values())
        # the client-mode peer never served anything: all its received bytes are means it pulled
        assert swarm.nodes["d"].endpoint == ""


@pytest.mark.parametrize("action", ["drop", "corrupt", "truncate"])
def test_a_bad_or_lost_shard_excludes_its_sender_everywhere(action: str, caplog: pytest.LogCaptureFixture) -> None:
    plan = FaultPlan().add(peer="b", round=0, call="push", target="c", action=action)  # type: ignore[arg-type]
    caplog.set_level(logging.INFO)
    with Swarm(NAMES, fault_hook=plan) as swarm:
        deltas = deltas_for(NAMES, NUMEL)
        results = swarm.average(0, deltas)
        contributors = ["a", "c", "d"]
        _committed_same(results, reference_mean(deltas, contributors, _equal_bounds(4)), contributors)
        assert all(r.failed == ("b",) for r in results.values())
        assert plan.hits and plan.hits[0][0].target == "c"
        if action != "drop":
            assert any("refused shard" in rec.message for rec in caplog.records)
        # the swarm goes on: the next round has every contribution again
        deltas = deltas_for(NAMES, NUMEL, seed=1)
        _committed_same(swarm.average(1, deltas), reference_mean(deltas, NAMES, _equal_bounds(4)), NAMES)


@pytest.mark.parametrize(("delay_s", "included"), [(0.02, True), (2.5, False)])
def test_a_delayed_shard_counts_only_inside_the_window(delay_s: float, included: bool) -> None:
    plan = FaultPlan().add(peer="a", round=0, call="push", target="d", action="delay", delay_s=delay_s)
    with Swarm(NAMES, fault_hook=plan) as swarm:
        deltas = deltas_for(NAMES, NUMEL)
        results = swarm.average(0, deltas)
        contributors = NAMES if included else ["b", "c", "d"]
        _committed_same(results, reference_mean(deltas, contributors, _equal_bounds(4)), contributors)


def test_a_reducer_dying_mid_round_is_replaced_by_a_retry_without_it() -> None:
    plan = CrashPlan().crash(peer="c", round=0, call="contributors")
    with Swarm(NAMES, fault_hook=plan) as swarm:
        plan.nodes = swarm.nodes
        deltas = deltas_for(NAMES, NUMEL)
        results = swarm.average(0, deltas)
        assert not results["c"].committed
        survivors = {n: r for n, r in results.items() if n != "c"}
        contributors = ["a", "b", "d"]
        _committed_same(survivors, reference_mean(deltas, contributors, _equal_bounds(3)), contributors)
        assert all("c" in r.failed for r in survivors.values())
        # the next round goes on among the survivors (c is gone from the group's point of view only
        # through its failures: it stays listed, is retried around, and never blocks a commit)
        deltas = deltas_for(contributors, NUMEL, seed=1)
        later = swarm.average(1, deltas)
        _committed_same(later, reference_mean(deltas, contributors, _equal_bounds(3)), contributors)


def test_a_reducer_dying_before_serving_anyone_costs_one_attempt() -> None:
    # c dies at the first request for its mean (its own member's included): nobody holds its shard's mean, and
    # c's own contribution to that shard went with it, so no stand-in can reduce it again: the others retry
    # without c (attempt 0 cannot complete, so nobody asked for its votes; the retry gets them).
    plan = CrashPlan().crash(peer="c", round=0, call="mean")
    with Swarm(NAMES, fault_hook=plan) as swarm:
        plan.nodes = swarm.nodes
        deltas = deltas_for(NAMES, NUMEL)
        results = swarm.average(0, deltas)
        assert plan.crashed and not results["c"].committed
        survivors = {n: r for n, r in results.items() if n != "c"}
        _committed_same(survivors, reference_mean(deltas, ["a", "b", "d"], _equal_bounds(3)), ["a", "b", "d"])


@pytest.mark.parametrize("served", [["a"], ["a", "b"]])
def test_a_reducer_dying_after_serving_some_members_costs_its_shard_not_the_attempt(served: list[str]) -> None:
    # c serves its mean to the members in `served` (the others ask it later) and dies: the others take c's
    # shard from a member that holds it, in the same attempt, and every member commits the one mean over all
    # four contributors (c pushed before it died).
    # (c dies when the first late member asks, 1 s after the others: by then c has served them and finished its
    # own pull, so nothing of c's is mid-computation when its node closes)
    plan = FaultPlan()
    late = [n for n in NAMES if n not in served and n != "c"]
    for n in late:
        plan.add(peer="c", round=0, call="mean", target=n, action="delay", delay_s=1.0)
    crash = CrashPlan(plan).crash(peer="c", round=0, call="mean_asked", target=late[0])
    with Swarm(NAMES, fault_hook=crash) as swarm:
        crash.nodes = swarm.nodes
        deltas = deltas_for(NAMES, NUMEL)
        results = swarm.average(0, deltas)
        assert crash.crashed, "c never crashed"
        survivors = {n: r for n, r in results.items() if n != "c"}
        _committed_same(survivors, reference_mean(deltas, NAMES, _equal_bounds(4)), NAMES)
        assert all("attempt" not in r.reason for r in survivors.values()), {n: r.reason for n, r in survivors.items()}


def test_losing_the_majority_aborts_on_every_member() -> None:
    plan = FaultPlan()
    for sender in ("b", "c"):
        plan.add(peer=sender, round=0, call="push", action="drop")
    with Swarm(NAMES, fault_hook=plan) as swarm:
        results = swarm.average(0, deltas_for(NAMES, NUMEL))
        for name, r in results.items():
            assert not r.committed and r.mean is None, name
            assert "delivered" in r.reason, r.reason


def test_a_leaving_reducer_drains_until_its_group_pulled_the_means() -> None:
    # a's reducer answers d's mean request late: a must not stop serving before d has it.
    plan = FaultPlan().add(peer="a", round=0, call="mean", target="d", action="delay", delay_s=2.0)
    with Swarm(NAMES, fault_hook=plan) as swarm:
        deltas = deltas_for(NAMES, NUMEL)
        futures = {n: swarm.pool.submit(swarm.averagers[n].average, 0, d) for n, d in deltas.items()}
        assert futures["a"].result(timeout=30).committed
        assert swarm.averagers["a"].drain(timeout_s=0.05) == ("d",)  # d is still waiting for a's shard
        assert swarm.averagers["a"].drain(timeout_s=20) == ()
        results = {n: f.result(timeout=30) for n, f in futures.items()}
        _committed_same(results, reference_mean(deltas, NAMES, _equal_bounds(4)), NAMES)


def _drawn_reducers(swarm: Swarm, names: list[str], size: int) -> list[str]:
    """The reducers a group of `names` on `swarm` draws for its first attempt, in group order."""
    from allreduce_swarm import RUN_ID

    from swarmtrain.round.committee import drawn
    from swarmtrain.round.group import Group, Member

    group = Group(RUN_ID, 0, tuple(Member(n, swarm.nodes[n].endpoint) for n in names))
    return [m.peer_id for m in drawn(group.members, size=size, seed=f"reducers\0{group.group_id}",
                                     name=lambda m: m.peer_id)]


def _ranked(swarm: Swarm, names: list[str]) -> list[str]:
    """Every member of the group of `names` in the order of its reducer rank."""
    import hashlib

    from allreduce_swarm import RUN_ID

    from swarmtrain.round.group import Group, Member

    group = Group(RUN_ID, 0, tuple(Member(n, swarm.nodes[n].endpoint) for n in names))
    return sorted(names, key=lambda n: hashlib.sha256(f"reducers\0{group.group_id}\0{n}".encode()).digest())


def test_a_large_group_reduces_through_a_bounded_draw_of_reducers_and_replaces_a_dead_one() -> None:
    """With more serving members than averaging.max_reducers, an attempt's shards go to that many, drawn by a rank
    every member computes from the group; a dead one is replaced by the next in rank at the retry, and the
    committed mean is still the reference's, bit for bit, over every contributor."""
    import dataclasses

    from allreduce_swarm import AVG

    names = ["a", "b", "c", "d", "e", "f"]
    avg = dataclasses.replace(AVG, max_reducers=2)
    with Swarm(names, avg=avg) as swarm:
        first = _drawn_reducers(swarm, names, 2)
        deltas = deltas_for(names, NUMEL)
        results = swarm.average(0, deltas)
        _committed_same(results, reference_mean(deltas, names, _equal_bounds(2)), names)
        sessions = {n: len(swarm.averagers[n].registry._sessions) for n in names}
        assert {n for n, k in sessions.items() if k} == set(first), sessions  # the drawn two alone reduced
    # one of the drawn reducers dies when asked for its contributors: the retry draws the next in rank
    plan = CrashPlan()
    with Swarm(names, avg=avg, fault_hook=plan) as swarm:
        victim = _drawn_reducers(swarm, names, 2)[0]
        plan.crash(peer=victim, round=0, call="contributors")
        plan.nodes = swarm.nodes
        deltas = deltas_for(names, NUMEL)
        results = swarm.average(0, deltas)
        assert plan.crashed and not results[victim].committed
        survivors = {n: r for n, r in results.items() if n != victim}
        contributors = [n for n in names if n != victim]
        _committed_same(survivors, reference_mean(deltas, contributors, _equal_bounds(2)), contributors)
        assert all(victim in r.failed for r in survivors.values())
        rank = [n for n in _ranked(swarm, names) if n != victim]  # the group's rank, the dead one left out
        reduced = {n for n in contributors if swarm.averagers[n].registry._sessions}
        assert reduced == set(rank[:2])  # the other drawn reducer, and the next in rank in the victim's place

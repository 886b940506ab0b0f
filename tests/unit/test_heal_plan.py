"""The heal decision (round/heal.py): a peer adopts only the (round, θ hash) a strict majority of the serving
workers ahead announce, or its group's after a hash mismatch; never one donor's word."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from swarmtrain.round import majority_state, plan_heal

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class View:
    peer_id: str
    round: int
    state_hash: str
    role: str = "worker"
    endpoint: str = "127.0.0.1:1"
    round_ends_at: float = 0.0


def _ids(plan) -> list[str]:  # type: ignore[no-untyped-def]
    return sorted(d.peer_id for d in plan.donors)


def test_nobody_ahead_means_nothing_to_do() -> None:
    assert plan_heal([View("a", 3, "h3"), View("me", 3, "h3")], own_round=3, self_id="me") is None
    assert plan_heal([], own_round=0, self_id="me") is None


def test_the_majority_state_ahead_is_adopted_and_a_liar_far_ahead_is_outvoted() -> None:
    peers = [View("a", 5, "h5"), View("b", 5, "h5"), View("c", 5, "h5"), View("liar", 10**6, "bad")]
    plan = plan_heal(peers, own_round=2, self_id="me")
    assert plan is not None and (plan.round, plan.state_hash) == (5, "h5") and _ids(plan) == ["a", "b", "c"]


def test_a_liar_announcing_the_swarms_round_with_its_own_theta_is_never_a_donor() -> None:
    peers = [View("a", 5, "h5"), View("b", 5, "h5"), View("liar", 5, "bad")]
    plan = plan_heal(peers, own_round=2, self_id="me")
    assert plan is not None and plan.state_hash == "h5" and _ids(plan) == ["a", "b"]


@pytest.mark.parametrize("peers", [
    [View("a", 5, "h5"), View("liar", 10**6, "bad")],  # one honest peer and one liar: nobody to believe
    [View("a", 5, "h5"), View("b", 6, "h6")],  # a moment of transition: the next check decides
    [View("a", 5, "x"), View("b", 5, "y"), View("c", 5, "z")],  # a split
])
def test_no_majority_ahead_means_no_heal_and_says_why(peers: list[View]) -> None:
    plan = plan_heal(peers, own_round=2, self_id="me")
    assert plan is not None and plan.donors == () and "strict majority" in plan.problem


def test_one_peer_far_ahead_of_everyone_is_believed_only_when_it_is_the_only_peer() -> None:
    honest = View("b", 0, "h0")
    liar = View("liar", 10**6, "bad")
    plan = plan_heal([honest, liar], own_round=0, self_id="me", min_support=2)  # a fresh swarm, and a liar
    assert plan is not None and plan.donors == () and "at least 2 of the 2 live peers" in plan.problem
    alone = plan_heal([View("b", 5, "h5")], own_round=3, self_id="me", min_support=2)  # a restart, 2-peer swarm
    assert alone is not None and [d.peer_id for d in alone.donors] == ["b"]
    pair = plan_heal([View("b", 5, "h5"), View("c", 5, "h5"), liar], own_round=0, self_id="me", min_support=2)
    assert pair is not None and pair.state_hash == "h5"


def test_after_a_hash_mismatch_the_groups_state_at_this_round_is_fetched_from_its_holders() -> None:
    peers = [View("a", 4, "good"), View("b", 4, "good"), View("me", 4, "mine"), View("c", 4, "other")]
    plan = plan_heal(peers, own_round=4, self_id="me", want_hash="good")
    assert plan is not None and (plan.round, plan.state_hash) == (4, "good") and _ids(plan) == ["a", "b"]
    newer = [*peers, View("d", 5, "h5"), View("e", 5, "h5")]  # a majority already moved on: follow it
    plan = plan_heal(newer, own_round=4, self_id="me", want_hash="good")
    assert plan is not None and (plan.round, plan.state_hash) == (5, "h5")


def test_trainers_client_mode_peers_and_hashless_records_are_no_donors() -> None:
    peers = [View("t", 5, "h5", role="trainer"), View("n", 5, "h5", endpoint=""), View("a", 5, "h5"),
             View("c", 5, "h5"), View("b", 5, "")]
    plan = plan_heal(peers, own_round=1, self_id="me")
    assert plan is not None and _ids(plan) == ["a", "c"]  # b counts among the peers ahead, vouches for nothing
    assert not plan_heal([View("a", 5, "h5"), View("b", 5, "")], own_round=1, self_id="me").donors  # type: ignore[union-attr]
    assert majority_state([View("b", 5, ""), View("c", 5, "")]) is None


def test_joiners_spread_over_donors() -> None:
    peers = [View(f"p{i}", 5, "h5") for i in range(8)]
    firsts = {plan.donors[0].peer_id for me in range(20)
              if (plan := plan_heal(peers, own_round=0, self_id=f"joiner{me}")) is not None}
    assert len(firsts) > 3

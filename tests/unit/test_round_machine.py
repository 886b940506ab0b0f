"""The round state machine (swarmtrain/round/machine.py) driven by hand, on a fake clock."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmtrain.round import (
    Average,
    Finish,
    Heal,
    Launch,
    Phase,
    RoundMachine,
    RoundMachineError,
    Settle,
    Train,
    Transition,
    Wait,
)

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def machine(*, rounds: int = 3, round_index: int = 0, overlap: bool = False,
            unsent: bool = False) -> tuple[RoundMachine, Clock, list[Transition]]:
    clock, log = Clock(), []
    m = RoundMachine(round_index=round_index, rounds=rounds, clock=clock, overlap=overlap, unsent=unsent,
                     on_transition=log.append)
    return m, clock, log


def phases(log: list[Transition]) -> list[str]:
    return [t.target.value for t in log]


def test_rounds_commit_in_order_and_the_heal_check_is_skipped_right_after_a_commit() -> None:
    m, _, log = machine(rounds=2)
    assert m.next() == Heal()
    m.healed(round_index=None)
    assert m.next() == Train(0)
    m.trained()
    assert m.next() == Average(0, 0)
    m.matched(group="g0")
    m.averaged(committed=True)
    assert m.round == 1
    assert m.next() == Train(1)  # nobody can be past a round this peer just committed
    m.trained()
    assert m.next() == Average(1, 0)
    m.averaged(committed=True)
    assert m.next() == Finish("done")
    assert phases(log) == ["training", "matching", "reducing", "committed", "training", "matching", "committed",
                           "done"]


def test_an_aborted_round_waits_out_its_fence_then_averages_the_same_delta_again() -> None:
    m, clock, log = machine()
    m.next()
    m.healed(round_index=None)
    m.next()
    m.trained()
    m.next()
    m.averaged(committed=False, reason="only 1 of 3 delivered", retry_at=clock.t + 7.5)
    assert m.next() == Wait(0, clock.t + 7.5)
    clock.t += 7.5
    m.waited()
    assert m.next() == Heal()  # the missed attempt may have committed without this peer
    m.healed(round_index=None)
    assert m.next() == Average(0, 1)  # not retrained
    aborted = [t for t in log if t.target is Phase.ABORTED]
    assert [(t.round, t.attempt, t.reason) for t in aborted] == [(0, 0, "only 1 of 3 delivered")]


def test_a_wait_cut_short_by_a_peer_ahead_and_a_heal_that_took_nothing_waits_the_fence_out_unwatched() -> None:
    """Two reads of a stale or partitioned DHT can disagree: one shows a peer past the round (the wait ends),
    the next nobody ahead (the heal takes nothing). Attempting again at once, back to back, is spinning."""
    m, clock, _ = machine()
    m.next()
    m.healed(round_index=None)
    m.next()
    m.trained()
    m.next()
    m.averaged(committed=False, reason="late", retry_at=clock.t + 5)
    assert m.next() == Wait(0, clock.t + 5)
    clock.t += 1
    m.waited()  # a peer looked past round 0
    assert m.next() == Heal()
    m.healed(round_index=None)  # no donor reached, or nobody ahead on the next read
    assert m.next() == Wait(0, clock.t + 4, watch=False)
    clock.t += 4
    m.waited()
    assert m.next() == Heal()
    m.healed(round_index=None)
    assert m.next() == Average(0, 1)  # the fence is over: the same Δ again


def test_an_abort_whose_fence_already_passed_goes_straight_to_the_heal_check() -> None:
    m, clock, _ = machine()
    m.next()
    m.healed(round_index=None)
    m.next()
    m.trained()
    m.next()
    m.averaged(committed=False, retry_at=clock.t - 1.0)
    assert m.next() == Heal()


def test_a_peer_left_out_for_its_theta_heals_to_the_groups_hash_or_waits_when_nobody_serves_it() -> None:
    m, clock, _ = machine()
    m.next()
    m.healed(round_index=None)
    m.next()
    m.trained()
    m.next()
    m.averaged(committed=False, heal_to_hash="ab" * 32, retry_at=clock.t + 3)
    assert m.next() == Heal(want_hash="ab" * 32)
    m.healed(round_index=None)
    assert m.next() == Wait(0, clock.t + 3)
    clock.t += 3
    m.waited()
    assert m.next() == Heal()
    m.healed(round_index=None)
    assert m.next() == Average(0, 1)
    m.averaged(committed=False, heal_to_hash="cd" * 32)
    assert m.next() == Heal(want_hash="cd" * 32)
    m.healed(round_index=0, source="donor")  # same round, the group's θ_global: its Δ is stale
    assert m.next() == Train(0)


def test_a_heal_past_a_trained_round_drops_its_delta() -> None:
    m, clock, log = machine(rounds=10)
    m.next()
    m.healed(round_index=None)
    m.next()
    m.trained()
    m.next()
    m.averaged(committed=False, retry_at=clock.t + 1)
    m.next()
    m.waited()
    m.next()
    m.healed(round_index=4, source="p2")
    assert (m.round, m.attempt) == (4, 0)
    assert m.next() == Train(4)
    assert log[-2].target is Phase.HEALING and "p2" in log[-2].reason


@pytest.mark.parametrize("where", ["delta", "allreduce"])
def test_a_local_fault_aborts_the_round_and_trains_it_again_after_a_heal_check(where: str) -> None:
    m, _, log = machine()
    m.next()
    m.healed(round_index=None)
    m.next()
    if where == "delta":
        m.trained(problem="Δ holds 3 NaN values")
    else:
        m.trained()
        m.next()
        m.failed(reason="CodecError: bad frame")
    assert log[-1].target is Phase.ABORTED
    assert m.next() == Heal()
    m.healed(round_index=None)
    assert m.next() == Train(0)


def test_a_stop_ends_the_loop_at_the_next_action_and_a_stopped_action_ends_it_at_once() -> None:
    m, _, _ = machine()
    m.next()
    m.healed(round_index=None)
    m.request_stop()
    assert m.next() == Finish("signal")
    m2, _, _ = machine()
    m2.next()
    m2.healed(round_index=None)
    m2.next()
    m2.stopped()  # inner steps interrupted
    assert m2.next() == Finish("signal")


def test_events_the_current_action_does_not_expect_are_refused() -> None:
    m, _, _ = machine()
    assert m.next() == Heal()
    with pytest.raises(RoundMachineError, match="Average"):
        m.averaged(committed=True)
    with pytest.raises(RoundMachineError, match="Train"):
        m.trained()


def test_a_transition_is_one_json_line_stamped_with_the_injected_clock() -> None:
    m, clock, log = machine()
    clock.t = 1234.5678
    m.next()
    m.healed(round_index=None)
    m.next()
    obj = json.loads(log[-1].line())
    assert obj == {"event": "transition", "round": 0, "attempt": 0, "source": "starting", "target": "training",
                   "reason": "", "at": 1234.568}


def test_overlap_launches_trains_while_averaging_and_sends_the_steps_trained_meanwhile() -> None:
    m, _, log = machine(rounds=2, overlap=True)
    assert m.next() == Heal(keep_progress_rounds=1)
    m.healed(round_index=None)
    assert m.next() == Train(0)
    m.trained()
    assert m.next() == Launch(0, 0)
    m.launched()
    assert m.next() == Settle(0, train_meanwhile=True)
    m.averaged(committed=True, trained_meanwhile=True)
    assert m.next() == Launch(1, 0)  # round 1's steps go out at once
    m.launched()
    assert m.next() == Settle(1, train_meanwhile=False)  # no round 2 to train
    m.averaged(committed=True)
    assert m.next() == Finish("done")
    assert "done" in phases(log)


def test_overlap_abort_keeps_the_steps_and_the_next_attempt_sends_them_without_retraining() -> None:
    m, clock, _ = machine(rounds=3, overlap=True)
    m.next()
    m.healed(round_index=None)
    m.next()
    m.trained()
    m.next()
    m.launched()
    m.next()
    m.averaged(committed=False, retry_at=clock.t + 2)
    assert m.next() == Wait(0, clock.t + 2)
    m.waited()
    assert m.next() == Heal(keep_progress_rounds=1)
    m.healed(round_index=1, kept_progress=True, source="p1")  # one round late: the steps are kept
    assert m.next() == Launch(1, 0)
    m.launched(problem="Δ holds Inf")
    assert m.next() == Heal(keep_progress_rounds=1)
    m.healed(round_index=None)
    assert m.next() == Train(1)


def test_overlap_stop_concludes_the_average_in_flight_first() -> None:
    m, _, _ = machine(rounds=3, overlap=True)
    m.next()
    m.healed(round_index=None)
    m.next()
    m.trained()
    m.next()
    m.launched()
    m.request_stop()
    assert m.next() == Settle(0, train_meanwhile=False)
    m.averaged(committed=True)
    assert m.next() == Finish("signal")


def test_a_resumed_overlap_peer_sends_what_it_had_trained() -> None:
    m, _, _ = machine(rounds=3, overlap=True, unsent=True)
    m.next()
    m.healed(round_index=None)
    assert m.next() == Launch(0, 0)


OUTCOMES = st.lists(st.integers(min_value=0, max_value=7), min_size=1, max_size=80)


@settings(max_examples=300, deadline=None)
@given(outcomes=OUTCOMES, overlap=st.booleans())
def test_random_outcomes_never_average_a_stale_delta_and_always_end(outcomes: list[int], overlap: bool) -> None:
    """Drive the machine with arbitrary outcomes: a Δ is only averaged for the round it was trained in
    (no heal in between), rounds never go back, and a stop ends the loop within two actions."""
    rounds = 4
    m, clock, _ = machine(rounds=rounds, overlap=overlap)
    trained_for: int | None = None  # the round whose steps θ_local holds (unsent), as the daemon sees it
    last_round = 0
    for i, o in enumerate(outcomes + [0] * 400):
        action = m.next()
        assert m.round >= last_round
        last_round = m.round
        if isinstance(action, Finish):
            assert action.reason == "signal" or m.round >= rounds
            return
        if i == len(outcomes) + 300:
            m.request_stop()
        if isinstance(action, Heal):
            jump = o % 3 == 2 or (action.want_hash and o % 2 == 1)
            if jump:
                target = m.round + (1 if not action.want_hash else 0)
                kept = (bool(action.keep_progress_rounds) and not action.want_hash and target - m.round <= 1
                        and trained_for is not None)
                trained_for = target if kept else None
                m.healed(round_index=target, source="d", kept_progress=kept)
            else:
                m.healed(round_index=None)
        elif isinstance(action, Train):
            assert trained_for != action.round  # never retrains steps it still holds
            if o == 7:
                m.trained(problem="nan")
                trained_for = None
            else:
                m.trained()
                trained_for = action.round
        elif isinstance(action, Average):
            assert trained_for == action.round, "averaged a Δ not trained for this round"
            if o == 6:
                m.failed(reason="bug")
                trained_for = None
                continue
            m.matched(group="g")
            committed = o % 2 == 0
            m.averaged(committed=committed, retry_at=clock.t + (o % 3), heal_to_hash="h" if o == 5 else "")
            if committed:
                trained_for = None
        elif isinstance(action, Launch):
            assert trained_for == action.round, "launched steps not trained for this round"
            if o == 7:
                m.launched(problem="inf")
                trained_for = None
            else:
                m.launched()
                trained_for = None
        elif isinstance(action, Settle):
            meanwhile = action.train_meanwhile and o % 3 != 0
            committed = o % 2 == 0
            sent_round = m.round
            if not committed:
                trained_for = sent_round  # the aborted Δ went back into θ_local
            elif meanwhile:
                trained_for = sent_round + 1
            m.averaged(committed=committed, retry_at=clock.t + (o % 3), heal_to_hash="h" if o == 5 else "",
                       trained_meanwhile=meanwhile)
        elif isinstance(action, Wait):
            assert action.until > clock.t
            clock.t = action.until
            m.waited()
    raise AssertionError("the machine did not finish")

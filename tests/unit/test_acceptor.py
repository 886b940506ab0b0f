"""A voter's side of a round's decision (swarmtrain/round/acceptor.py): promises, accepts, refusals, the bounded
window of rounds, retirement and the next incarnation, and its state as JSON."""

from __future__ import annotations

import json
from typing import Any

import pytest

from swarmtrain.round.acceptor import (
    MAX_ROUNDS_KEPT,
    Accepted,
    AcceptorState,
    Promised,
    Refused,
    RoundVote,
    VoterRetirement,
)
from swarmtrain.round.ballots import (
    ZERO_BALLOT,
    BallotError,
    MaterialLayout,
    ShardDigest,
    Value,
    Voter,
    carrying_ballot,
    session_ballot,
)

pytestmark = pytest.mark.unit

SCOPE = "model"
H = 10  # the horizon the tests answer under unless they say otherwise


def _value(round_index: int, session: str = "s", *, scope: str = SCOPE, result: str = "e" * 64) -> Value:
    layout = MaterialLayout(8, "fp32", False, (ShardDigest(0, 8, 32, "c" * 64),))
    return Value(scope, round_index, session, "0" * 64, ("a", "b"), (Voter("a", 0), Voter("b", 1)), layout, result)


def _state(**kw: Any) -> AcceptorState:
    return AcceptorState(scope=SCOPE, incarnation=kw.pop("incarnation", 3), **kw)


B1, B2, B3 = session_ballot(0, 0, "s"), session_ballot(0, 1, "s"), session_ballot(1, 0, "s")


# ---------------------------------------------------------------------------------------------- prepare

def test_a_first_promise_reports_nothing_accepted() -> None:
    st = _state()
    got = st.prepare(5, B1, horizon=H)
    assert got == Promised(B1, ZERO_BALLOT, None, changed=True)
    assert st.rounds[5].promised == B1


def test_promises_only_go_up() -> None:
    st = _state()
    assert isinstance(st.prepare(5, B2, horizon=H), Promised)
    lower = st.prepare(5, B1, horizon=H)
    assert isinstance(lower, Refused) and lower.kind == "promised" and lower.promised == B2
    assert st.rounds[5].promised == B2, "a refused prepare changes nothing"
    higher = st.prepare(5, B3, horizon=H)
    assert higher == Promised(B3, ZERO_BALLOT, None, changed=True)
    assert st.rounds[5].promised == B3
    # the same ballot again: promised already, nothing to store
    assert st.prepare(5, B3, horizon=H) == Promised(B3, ZERO_BALLOT, None, changed=False)
    # rounds are independent
    assert st.prepare(6, B1, horizon=H) == Promised(B1, ZERO_BALLOT, None, changed=True)


def test_a_promise_reports_the_value_accepted_last() -> None:
    st = _state()
    v1, v2 = _value(5, "s1"), _value(5, "s2")
    assert isinstance(st.accept(5, B1, v1, horizon=H), Accepted)
    assert st.prepare(5, B2, horizon=H) == Promised(B2, B1, v1, changed=True)
    assert isinstance(st.accept(5, B2, v2, horizon=H), Accepted)
    assert st.prepare(5, B3, horizon=H) == Promised(B3, B2, v2, changed=True)


# ---------------------------------------------------------------------------------------------- accept

def test_accept_without_a_promise_and_at_the_promised_ballot() -> None:
    st = _state()
    v = _value(5)
    got = st.accept(5, B1, v, horizon=H)
    assert got == Accepted(B1, v, changed=True)
    vote = st.rounds[5]
    assert (vote.promised, vote.accepted, vote.value, vote.signature) == (B1, B1, v, b"")
    st.prepare(6, B2, horizon=H)
    assert st.accept(6, B2, _value(6), horizon=H) == Accepted(B2, _value(6), changed=True)


def test_accept_is_refused_once_a_higher_ballot_was_promised() -> None:
    st = _state()
    v1, v2 = _value(5, "s1"), _value(5, "s2")
    st.accept(5, B1, v1, horizon=H)
    st.sign_accepted(5, b"sig1")
    st.prepare(5, B3, horizon=H)
    got = st.accept(5, B2, v2, horizon=H)
    assert isinstance(got, Refused) and got.kind == "promised" and got.promised == B3
    vote = st.rounds[5]
    assert (vote.promised, vote.accepted, vote.value, vote.signature) == (B3, B1, v1, b"sig1")
    # the promised ballot itself is accepted
    assert st.accept(5, B3, v2, horizon=H) == Accepted(B3, v2, changed=True)
    assert st.rounds[5].signature == b"", "a new grant needs its own signature"


def test_accepting_a_higher_ballot_raises_the_promise_too() -> None:
    st = _state()
    st.prepare(5, B1, horizon=H)
    st.accept(5, B3, _value(5), horizon=H)
    assert st.rounds[5].promised == B3
    got = st.prepare(5, B2, horizon=H)
    assert isinstance(got, Refused) and got.kind == "promised" and got.promised == B3


def test_one_ballot_never_names_two_values() -> None:
    st = _state()
    v1, v2 = _value(5, "s1"), _value(5, "s2")
    assert st.accept(5, B1, v1, horizon=H) == Accepted(B1, v1, changed=True)
    st.sign_accepted(5, b"sig")
    # the same value again: accepted, nothing changes (the stored signature stays)
    assert st.accept(5, B1, _value(5, "s1"), horizon=H) == Accepted(B1, v1, changed=False)
    assert st.rounds[5].signature == b"sig"
    got = st.accept(5, B1, v2, horizon=H)
    assert isinstance(got, Refused) and got.kind == "conflict"
    assert st.rounds[5].value == v1 and st.rounds[5].signature == b"sig"
    # values that differ only in their result digest are two values
    got = st.accept(5, B1, _value(5, "s1", result="d" * 64), horizon=H)
    assert isinstance(got, Refused) and got.kind == "conflict"
    # a carrying ballot (a ballot of its own) may carry another value
    carry = carrying_ballot(B1, session="s2", proposer="p")
    assert st.accept(5, carry, v2, horizon=H) == Accepted(carry, v2, changed=True)


def test_accept_refuses_a_value_of_another_scope_or_round() -> None:
    st = _state()
    got = st.accept(5, B1, _value(5, scope="stage1"), horizon=H)
    assert isinstance(got, Refused) and got.kind == "scope"
    got = st.accept(5, B1, _value(6), horizon=H)
    assert isinstance(got, Refused) and got.kind == "scope"
    assert st.rounds == {}, "a refused accept stores nothing"


# ---------------------------------------------------------------------------------------------- the window

def test_rounds_below_the_floor_and_above_the_horizon_are_refused() -> None:
    st = _state(floor=4)
    for r, kind in ((3, "forgotten"), (0, "forgotten"), (8, "ahead"), (100, "ahead")):
        got = st.prepare(r, B1, horizon=7)
        assert isinstance(got, Refused) and got.kind == kind, (r, got)
        got = st.accept(r, B1, _value(r), horizon=7)
        assert isinstance(got, Refused) and got.kind == kind, (r, got)
        refusal = st.refusal(r, horizon=7)
        assert refusal is not None and refusal.kind == kind
    assert st.rounds == {}, "nothing is kept of a refused round"
    for r in (4, 5, 7):  # the floor and the horizon themselves are answered
        assert st.refusal(r, horizon=7) is None
        assert isinstance(st.prepare(r, B1, horizon=7), Promised)
        assert isinstance(st.accept(r, B2, _value(r), horizon=7), Accepted)


def test_forget_before_raises_the_floor_and_drops_old_votes() -> None:
    st = _state()
    for r in range(2, 8):
        st.accept(r, B1, _value(r), horizon=H)
    st.retire(current_round=8)
    st.reincarnate()
    st.accept(8, B1, _value(8), horizon=H)
    assert st.forget_before(5) is True
    assert st.floor == 5
    assert sorted(st.rounds) == [8]
    assert sorted(st.past) == [5, 6, 7]
    assert st.accepted_in(4) is None and st.accepted_in(5) is not None
    got = st.prepare(4, B3, horizon=H)
    assert isinstance(got, Refused) and got.kind == "forgotten"
    assert st.forget_before(5) is False
    assert st.forget_before(3) is False and st.floor == 5, "the floor never goes down"
    assert st.forget_before(9) is True and st.rounds == {} and st.past == {}


# ---------------------------------------------------------------------------------------------- retirement

@pytest.mark.parametrize(("promised", "accepted", "current", "expected", "named", "froze"), [
    ((), (), 4, 4, False, False),        # nothing granted: from the current round
    ((2,), (), 4, 4, False, False),      # promised in an older round only
    ((4,), (), 4, 4, True, False),       # promised in the current round: from it, naming the promise
    ((), (4,), 4, 4, False, True),       # accepted in the current round: from it, naming what it accepted
    ((4, 7), (), 4, 7, True, False),     # promised ahead of the current round: from the newest, naming it
    ((7,), (3,), 0, 7, True, False),     # accepted in an older round: counted there still
    ((7,), (7,), 0, 7, True, True),      # promised and accepted in one round: both named
])
def test_retire_from_the_newest_round_voted_in_naming_the_vote_there(
        promised: tuple[int, ...], accepted: tuple[int, ...], current: int, expected: int, named: bool,
        froze: bool) -> None:
    st = _state()
    for r in promised:
        assert isinstance(st.prepare(r, B1, horizon=H), Promised)
    for r in accepted:
        assert isinstance(st.accept(r, B2, _value(r), horizon=H), Accepted)
    assert st.retire(current_round=current) == expected
    assert st.retired_from == expected
    # an accept of B2 promises it too: where it accepted, the promise named is B2
    assert st.retired_promise() == ((B2 if froze else B1) if named or froze else None)
    assert st.retired_accepted() == ((B2, _value(expected)) if froze else None)
    signed = st.sign_retirement(b"sig")
    assert (signed.accepted, signed.value) == ((B2, _value(expected)) if froze else (None, None))
    assert AcceptorState.from_json(st.to_json()).retirements == [signed]


def test_an_accept_counts_as_granted_and_a_zero_promise_does_not() -> None:
    st = _state()
    st.accept(6, B1, _value(6), horizon=H)
    assert st.prepare(9, ZERO_BALLOT, horizon=H) == Promised(ZERO_BALLOT, ZERO_BALLOT, None, changed=False)
    assert st.granted_rounds() == [6]
    assert st.retire(current_round=2) == 6


def test_a_retired_voter_refuses_every_round_from_its_retirement_on() -> None:
    st = _state()
    st.accept(6, B1, _value(6), horizon=H)
    st.accept(7, B1, _value(7), horizon=H)
    assert st.retire(current_round=5) == 7
    for r in (7, 8, 9, 10):  # its vote in round 7 is final: what it accepted there is named in the retirement
        for got in (st.prepare(r, B3, horizon=H), st.accept(r, B3, _value(r), horizon=H)):
            assert isinstance(got, Refused) and got.kind == "retired", (r, got)
    assert not any(r >= 8 for r in st.rounds) and st.rounds[7].value == _value(7)
    # the rounds before it are still answered (it may still be needed there)
    assert isinstance(st.prepare(6, B2, horizon=H), Promised)
    assert isinstance(st.accept(6, B2, _value(6), horizon=H), Accepted)
    # retiring twice keeps the first retirement
    assert st.retire(current_round=20) == 7
    # a round where it only promised is retired from, the promise final: no later promise there
    other = _state()
    other.prepare(7, B1, horizon=H)
    assert other.retire(current_round=5) == 7 and other.retired_promise() == B1
    got = other.prepare(7, B3, horizon=H)
    assert isinstance(got, Refused) and got.kind == "retired"


def test_sign_retirement_keeps_the_last_four() -> None:
    st = _state(incarnation=0)
    with pytest.raises(AssertionError):
        st.sign_retirement(b"x")
    for i in range(6):
        st.retire(current_round=10 * i)
        got = st.sign_retirement(f"sig{i}".encode())
        assert got == VoterRetirement(i, 10 * i, f"sig{i}".encode())
        st.reincarnate()
    assert st.retirements == [VoterRetirement(i, 10 * i, f"sig{i}".encode()) for i in range(2, 6)]


def test_reincarnate_starts_empty_and_keeps_the_retired_incarnations_votes_for_learners() -> None:
    st = _state(incarnation=3)
    v5, v6 = _value(5, "s5"), _value(6, "s6")
    st.accept(5, B3, v5, horizon=H)
    st.sign_accepted(5, b"sig5")
    st.accept(6, B2, v6, horizon=H)
    st.prepare(7, B3, horizon=H)  # promised only: it retires from round 7, naming B3
    assert st.retire(current_round=6) == 7 and st.retired_promise() == B3
    st.reincarnate()
    assert st.incarnation == 4
    assert st.rounds == {} and st.retired_from is None
    # the new incarnation promises anew in a round the old one had promised higher in
    assert st.prepare(7, B1, horizon=H) == Promised(B1, ZERO_BALLOT, None, changed=True)
    assert st.prepare(8, B1, horizon=H) == Promised(B1, ZERO_BALLOT, None, changed=True)  # not retired now
    # what the retired incarnation accepted is still reported, as its own
    got5 = st.accepted_in(5)
    assert got5 is not None and got5[0] == 3
    assert (got5[1].accepted, got5[1].value, got5[1].signature) == (B3, v5, b"sig5")
    got6 = st.accepted_in(6)
    assert got6 is not None and got6[0] == 3 and got6[1].value == v6
    assert st.accepted_in(7) is None, "it only promised there"
    assert st.accepted_in(9) is None
    # once the current incarnation accepts in a round, it is the newest
    v7 = _value(7, "s7")
    st.accept(7, B1, v7, horizon=H)
    got7 = st.accepted_in(7)
    assert got7 is not None and got7[0] == 4 and got7[1].value == v7


def test_accepted_in_keeps_an_older_incarnations_value_when_a_later_one_only_promised_in_that_round() -> None:
    st = _state(incarnation=3)
    v5 = _value(5, "s5")
    st.accept(5, B1, v5, horizon=H)
    st.sign_accepted(5, b"sig3")
    assert st.retire(current_round=5) == 5  # its accepted value named in the retirement
    st.reincarnate()  # incarnation 4, restarted at round 5: a prepare of round 5 still reaches it
    assert isinstance(st.prepare(5, B2, horizon=6), Promised)
    assert st.retire(current_round=5) == 5  # it only promised in round 5: from it, naming the promise
    st.reincarnate()  # incarnation 5
    got = st.accepted_in(5)
    # the newest incarnation that accepted a value in round 5 is incarnation 3
    assert got is not None and got[0] == 3 and got[1].value == v5 and got[1].signature == b"sig3"


def test_accepted_in_reports_the_current_incarnation() -> None:
    st = _state(incarnation=11)
    assert st.accepted_in(5) is None
    st.prepare(5, B1, horizon=H)
    assert st.accepted_in(5) is None
    st.accept(5, B1, _value(5), horizon=H)
    got = st.accepted_in(5)
    assert got is not None and got[0] == 11 and got[1] is st.rounds[5]


# ---------------------------------------------------------------------------------------------- JSON

def _busy_state() -> AcceptorState:
    st = _state(incarnation=2)
    st.accept(3, B1, _value(3, "a"), horizon=H)
    st.sign_accepted(3, b"\x01\x02")
    st.prepare(4, B2, horizon=H)
    st.retire(current_round=4)
    st.sign_retirement(b"retired")
    st.reincarnate()
    st.accept(5, B3, _value(5, "b"), horizon=H)
    st.sign_accepted(5, bytes(range(64)))
    st.prepare(6, carrying_ballot(B3, session="b", proposer="p"), horizon=H)
    st.forget_before(3)
    st.retire(current_round=7)
    return st


def test_json_round_trip() -> None:
    st = _busy_state()
    raw = json.loads(json.dumps(st.to_json()))
    assert raw["incarnation"] == 3 and raw["floor"] == 3 and raw["retired_from"] == 7
    assert sorted(raw["rounds"]) == ["5", "6"] and sorted(raw["past"]) == ["3"]  # round 4: only a promise
    # from round 4, where it promised B2 and accepted nothing
    assert raw["retirements"] == [[2, 4, b"retired".hex(), B2.to_json(), None, None]]
    # a book written before retirements named what they accepted still reads
    old = dict(raw, retirements=[[2, 4, b"retired".hex(), B2.to_json()]])
    assert AcceptorState.from_json(old).retirements == st.retirements
    for bad in ([2, 4, b"retired".hex(), None, B2.to_json(), None], [2, 4]):
        with pytest.raises(BallotError):
            AcceptorState.from_json(dict(raw, retirements=[bad]))
    back = AcceptorState.from_json(raw)
    assert back == st
    assert back.accepted_in(3) == (2, RoundVote(B1, B1, _value(3, "a"), b"\x01\x02"))
    assert AcceptorState.from_json(_state().to_json()) == _state()
    # the parsed state answers as the stored one did
    got = back.prepare(5, B2, horizon=H)
    assert isinstance(got, Refused) and got.promised == B3


def _raw(**changes: Any) -> dict[str, Any]:
    raw = _busy_state().to_json()
    raw.update(changes)
    return raw


_VOTE = RoundVote(B1, B1, _value(5), b"\x01").to_json()


@pytest.mark.parametrize("raw", [
    None, [], "state",
    _raw(scope=None), _raw(scope=3),
    _raw(incarnation=-1), _raw(incarnation="3"), _raw(incarnation=True), _raw(incarnation=None),
    _raw(floor=-1), _raw(floor=1.5), _raw(floor=None),
    _raw(retired_from=-1), _raw(retired_from="7"),
    _raw(rounds=[]), _raw(past=[]), _raw(rounds={"x": _VOTE}), _raw(rounds={"5": []}),
    _raw(rounds={"5": {**_VOTE, "promised": None}}), _raw(rounds={"5": {**_VOTE, "accepted": [0, 0]}}),
    _raw(rounds={"5": {**_VOTE, "signature": "zz"}}), _raw(rounds={"5": {**_VOTE, "signature": 5}}),
    _raw(rounds={"5": {**_VOTE, "value": {"scope": SCOPE}}}), _raw(rounds={"5": {**_VOTE, "value": 5}}),
    _raw(past={"5": [0]}), _raw(past={"5": 5}), _raw(past={"5": ["x", _VOTE]}), _raw(past={"5": [0, []]}),
    _raw(retirements=5), _raw(retirements=[[0, 1]]), _raw(retirements=[[0, 1, "zz"]]),
    _raw(retirements=[["a", 1, ""]]),
])
def test_from_json_refuses_malformed_input(raw: Any) -> None:
    with pytest.raises(BallotError):
        AcceptorState.from_json(raw)


def test_from_json_refuses_a_past_entry_that_is_an_object() -> None:
    for entry in ({}, {"incarnation": 0, "votes": _VOTE}):
        with pytest.raises(BallotError):
            AcceptorState.from_json(_raw(past={"5": entry}))


def test_from_json_refuses_oversized_input() -> None:
    many = {str(r): _VOTE for r in range(2 * MAX_ROUNDS_KEPT + 1)}
    with pytest.raises(BallotError, match="oversized"):
        AcceptorState.from_json(_raw(rounds=many, past={}))
    half = {str(r): [0, _VOTE] for r in range(MAX_ROUNDS_KEPT + 1)}
    with pytest.raises(BallotError, match="oversized"):
        AcceptorState.from_json(_raw(rounds={str(r): _VOTE for r in range(MAX_ROUNDS_KEPT)}, past=half))
    ok = AcceptorState.from_json(_raw(rounds={str(r): _VOTE for r in range(MAX_ROUNDS_KEPT)}, past={}))
    assert len(ok.rounds) == MAX_ROUNDS_KEPT

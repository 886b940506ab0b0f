"""The decision's vocabulary (swarmtrain/round/ballots.py): ballot order, the quorum rule and why two quorums
of a round always meet, Paxos' choice of the value to propose, the validation of values and voters, and the
statements voters sign (docs/protocol.md#the-rounds-decision)."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest

from swarmtrain.round.ballots import (
    MAX_ID_CHARS,
    MAX_SHARDS,
    MAX_VOTERS,
    ZERO_BALLOT,
    Ballot,
    BallotError,
    Genesis,
    MaterialLayout,
    ShardDigest,
    Value,
    Voter,
    carrying_ballot,
    grant_statement,
    is_quorum,
    quorum_base,
    quorum_size,
    retire_statement,
    session_ballot,
    value_to_propose,
    voters_from_json,
    voters_to_json,
)

pytestmark = pytest.mark.unit

D0, D1, D2, D3 = ("0" * 64), ("1" * 64), ("ab" * 32), ("f" * 64)


def _layout(numel: int = 10) -> MaterialLayout:
    return MaterialLayout(numel, "fp32", False, (ShardDigest(0, 4, 40, D1), ShardDigest(4, numel, 60, D2)))


def _value(**changes: Any) -> Value:
    fields: dict[str, Any] = {
        "scope": "model", "round": 3, "session": "sess", "base": D0, "contributors": ("a", "b", "c"),
        "next_voters": (Voter("a", 0), Voter("b", 7)), "layout": _layout(), "result": D3}
    fields.update(changes)
    return Value(**fields)


# ---------------------------------------------------------------------------------------------- ballots

def test_session_ballots_order_by_attempt_then_retry_then_session() -> None:
    expected = [
        ZERO_BALLOT,
        session_ballot(0, 0, "a"),
        session_ballot(0, 0, "b"),
        session_ballot(0, 1, "a"),
        session_ballot(0, 2, "a"),
        session_ballot(1, 0, "a"),
        session_ballot(1, 3, "z"),
        session_ballot(2, 0, "a"),
    ]
    shuffled = [expected[i] for i in (5, 2, 7, 0, 3, 6, 1, 4)]
    assert sorted(shuffled) == expected
    # a later attempt wins over any retry of an earlier one, a later retry over the same attempt's earlier ones
    assert session_ballot(1, 0, "a") > session_ballot(0, 99, "zzz")
    assert session_ballot(4, 2, "a") > session_ballot(4, 1, "zzz")
    assert session_ballot(0, 0, "s") == Ballot(0, 0, 0, "s", "")
    assert session_ballot(0, 0, "s") > ZERO_BALLOT


@pytest.mark.parametrize(("attempt", "retry", "session"), [(-1, 0, "s"), (0, -1, "s"), (0, 0, "")])
def test_session_ballot_refuses_negative_counters_and_an_empty_session(attempt: int, retry: int,
                                                                       session: str) -> None:
    with pytest.raises(BallotError, match="session ballot"):
        session_ballot(attempt, retry, session)


def test_a_carrying_ballot_is_above_the_ballot_it_carries_and_of_its_proposer() -> None:
    above = session_ballot(2, 1, "s1")
    got = carrying_ballot(above, session="s2", proposer="p")
    assert got == Ballot(2, 1, 1, "s2", "p")
    assert got > above
    # above every session ballot of the same attempt and retry, whatever the session
    assert got > session_ballot(2, 1, "zzzz")
    # below a later retry's session ballot: a new retry supersedes it
    assert got < session_ballot(2, 2, "a")
    # carried again: one bump higher
    again = carrying_ballot(got, session="s2", proposer="p")
    assert again == Ballot(2, 1, 2, "s2", "p") and again > got
    # from nothing promised: the lowest real counters, a ballot of its own
    assert carrying_ballot(ZERO_BALLOT, session="s", proposer="p") == Ballot(0, 0, 0, "s", "p")
    assert carrying_ballot(ZERO_BALLOT, session="s", proposer="p") > ZERO_BALLOT


def test_carrying_ballots_are_above_every_kind_of_ballot_they_carry() -> None:
    aboves = [ZERO_BALLOT, session_ballot(0, 0, "a"), session_ballot(3, 5, "zz"), Ballot(1, 0, 4, "q", "p9"),
              Ballot(0, 7, 1, "", "x")]
    for above in aboves:
        for proposer in ("p1", "p2", "zzz"):
            assert carrying_ballot(above, session="s", proposer=proposer) > above, (above, proposer)


def test_carrying_ballots_of_two_proposers_differ_so_one_ballot_never_names_two_values() -> None:
    above = session_ballot(1, 0, "s")
    mine = carrying_ballot(above, session="s", proposer="p1")
    theirs = carrying_ballot(above, session="s", proposer="p2")
    assert mine != theirs
    assert mine > above and theirs > above
    assert mine < theirs  # the proposer breaks the tie: still one total order
    # neither is any session ballot
    assert mine.proposer == "p1" and theirs.proposer == "p2"
    assert all(b != session_ballot(1, 0, "s") for b in (mine, theirs))


def test_carrying_ballot_needs_a_proposer() -> None:
    with pytest.raises(BallotError, match="proposer"):
        carrying_ballot(session_ballot(0, 0, "s"), session="s", proposer="")


def test_ballot_json_round_trip() -> None:
    for b in (ZERO_BALLOT, session_ballot(3, 2, "s"), Ballot(1, 2, 3, "sess", "prop")):
        raw = json.loads(json.dumps(b.to_json()))
        assert raw == [b.attempt, b.retry, b.bump, b.session, b.proposer]
        assert Ballot.from_json(raw) == b


@pytest.mark.parametrize("raw", [
    None, "ballot", {"attempt": 0}, [0, 0, 0, "s"], [0, 0, 0, "s", "", "x"],
    [True, 0, 0, "s", ""], [0, -2, 0, "s", ""], [0, 0, 1 << 40, "s", ""], [0.5, 0, 0, "s", ""],
    [0, 0, 0, 5, ""], [0, 0, 0, "s", None], [0, 0, 0, "s", "p" * (MAX_ID_CHARS + 1)],
])
def test_ballot_from_json_refuses_malformed_input(raw: Any) -> None:
    with pytest.raises(BallotError, match="ballot"):
        Ballot.from_json(raw)


# ---------------------------------------------------------------------------------------------- quorum

def _voters(n: int) -> tuple[Voter, ...]:
    return tuple(Voter(f"p{i}", i % 3) for i in range(n))


@pytest.mark.parametrize(("n", "need"), [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (6, 4), (7, 4)])
def test_quorum_size_is_more_than_half(n: int, need: int) -> None:
    voters = _voters(n)
    assert quorum_size(voters) == need
    assert is_quorum(voters[:need], voters)
    assert not is_quorum(voters[:need - 1], voters)


def test_quorum_without_retired_voters() -> None:
    v = _voters(5)
    retired = v[3:]
    assert quorum_base(v, retired) == frozenset(v[:3])
    assert quorum_size(v, retired) == 2
    assert is_quorum(v[:2], v, retired)
    assert not is_quorum(v[:1], v, retired)
    # a retired voter's grant does not count: two of the three left are needed
    assert not is_quorum((v[0], v[3], v[4]), v, retired)
    # a retirement of someone who is no voter changes nothing
    assert quorum_size(v, (Voter("stranger", 0),)) == 3
    assert not is_quorum(v[:2], v, (Voter("stranger", 0),))


def test_every_voter_retired_gives_no_quorum() -> None:
    v = _voters(4)
    assert quorum_base(v, v) == frozenset()
    assert quorum_size(v, v) == 0
    assert not is_quorum(v, v, v)
    assert not is_quorum((), v, v)
    assert not is_quorum((), (), ())


def test_a_quorum_counts_voters_with_their_incarnation_and_only_voters() -> None:
    v = (Voter("a", 0), Voter("b", 0), Voter("c", 0))
    assert not is_quorum((Voter("a", 1), Voter("b", 1), Voter("c", 1)), v)  # the next incarnations
    assert not is_quorum((Voter("a", 0), Voter("x", 0), Voter("y", 0)), v)  # non-voters
    assert is_quorum((Voter("a", 0), Voter("c", 0), Voter("x", 0)), v)
    # the same voter listed twice is counted once
    assert not is_quorum([Voter("a", 0), Voter("a", 0)], v)
    # a retirement counts for its incarnation only
    v4 = (*v, Voter("d", 0))
    assert quorum_size(v4, (Voter("a", 1),)) == 3
    assert not is_quorum((Voter("b", 0), Voter("c", 0)), v4, (Voter("a", 1),))
    assert quorum_size(v4, (Voter("a", 0),)) == 2
    assert is_quorum((Voter("b", 0), Voter("c", 0)), v4, (Voter("a", 0),))


def _subsets(items: tuple[Voter, ...]) -> Iterator[frozenset[Voter]]:
    for k in range(len(items) + 1):
        for combo in itertools.combinations(items, k):
            yield frozenset(combo)


def test_two_quorums_intersect_in_a_voter_that_did_not_retire_whatever_retirements_each_counter_knows() -> None:
    """The safety argument (docs/protocol.md): the retired voters R_all of a round grant nothing in it, and
    each counter knows some subset of R_all; every two sets of grants that each counter takes for a quorum
    share a voter that did not retire. Exhaustive over a 5-voter set."""
    voters = _voters(5)
    subsets = list(_subsets(voters))
    quorums: dict[frozenset[Voter], list[frozenset[Voter]]] = {
        known: [q for q in subsets if is_quorum(q, voters, known)] for known in subsets}
    checked = 0
    for retired_all in subsets:
        active = frozenset(voters) - retired_all
        known_sets = [k for k in subsets if k <= retired_all]
        for known1, known2 in itertools.product(known_sets, repeat=2):
            # what a counter can be shown: grants of voters that did not retire
            q1s = [q for q in quorums[known1] if q <= active]
            q2s = [q for q in quorums[known2] if q <= active]
            for q1, q2 in itertools.product(q1s, q2s):
                common = q1 & q2
                assert common, (retired_all, known1, known2, q1, q2)
                assert common <= active
                checked += 1
    # not vacuous: as many pairs were compared as counting by hand gives (a counter that knows k retirements
    # takes any set of more than (5 - k) / 2 grants among the 5 - |R_all| voters left)
    def n_quorums(active: int, known: int) -> int:
        return sum(math.comb(active, s) for s in range(active + 1) if 2 * s > 5 - known) if known < 5 else 0

    expected = sum(math.comb(5, r) * math.comb(r, k1) * math.comb(r, k2) * n_quorums(5 - r, k1) * n_quorums(5 - r, k2)
                   for r in range(6) for k1 in range(r + 1) for k2 in range(r + 1))
    assert checked == expected > 1000


def test_the_intersection_needs_retired_voters_to_grant_nothing() -> None:
    """The counter-example the rule rules out: were a retired voter's grant possible, two quorums counted
    with different known retirements could be disjoint."""
    a, b, c, d, e = _voters(5)
    voters = (a, b, c, d, e)
    q1, known1 = frozenset({c, d}), frozenset({a, b})
    q2 = frozenset({a, b, e})
    assert is_quorum(q1, voters, known1)
    assert is_quorum(q2, voters)
    assert not q1 & q2  # only because a and b granted after retiring


# ---------------------------------------------------------------------------------------------- value_to_propose

def test_value_to_propose_is_the_value_of_the_highest_accepted_ballot() -> None:
    own = _value(session="own")
    low, mid, high = _value(session="low"), _value(session="mid"), _value(session="high")
    reports: list[tuple[Ballot, Value | None]] = [
        (session_ballot(0, 0, "low"), low),
        (Ballot(1, 0, 1, "high", "p"), high),
        (session_ballot(1, 0, "mid"), mid),
        (ZERO_BALLOT, None),
        (session_ballot(5, 0, "none"), None),  # a higher ballot promised with nothing accepted: no value
    ]
    for perm in itertools.permutations(reports):
        assert value_to_propose(perm, own) is high
    assert value_to_propose(reports[:1] + reports[2:], own) is mid
    assert value_to_propose([reports[0]], own) is low


def test_value_to_propose_is_the_own_value_when_nothing_was_accepted() -> None:
    own = _value(session="own")
    assert value_to_propose([], own) is own
    assert value_to_propose([(ZERO_BALLOT, None), (session_ballot(3, 1, "x"), None)], own) is own


# ---------------------------------------------------------------------------------------------- values

def test_value_json_round_trip_and_value_id() -> None:
    v = _value()
    raw = json.loads(json.dumps(v.to_json()))
    assert raw["layout"] == {"numel": 10, "codec": "fp32", "gather": False,
                             "shards": [[0, 4, 40, D1], [4, 10, 60, D2]]}
    assert raw["next_voters"] == [["a", 0], ["b", 7]]
    back = Value.from_json(raw)
    assert back == v
    assert back.value_id == v.value_id
    expected = hashlib.sha256(b"swarmtrain/value\0" + json.dumps(
        raw, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()).hexdigest()
    assert v.value_id == expected
    assert len(v.value_id) == 64
    # the empty base (a first round's) is allowed
    assert Value.from_json({**raw, "base": ""}).base == ""


@pytest.mark.parametrize("change", [
    {"scope": "stage1"}, {"round": 4}, {"session": "other"}, {"base": D1}, {"contributors": ("a", "b")},
    {"next_voters": (Voter("a", 1), Voter("b", 7))}, {"next_voters": (Voter("b", 7), Voter("a", 0))},
    {"layout": MaterialLayout(10, "fp16", False, _layout().shards)},
    {"layout": MaterialLayout(10, "fp32", True, _layout().shards)},
    {"layout": MaterialLayout(10, "fp32", False, (ShardDigest(0, 4, 40, D1), ShardDigest(4, 10, 60, D3)))},
    {"result": D2},
])
def test_value_id_changes_with_every_field(change: dict[str, Any]) -> None:
    assert _value(**change).value_id != _value().value_id


def test_layout_size_and_validation() -> None:
    layout = _layout()
    assert layout.size_bytes == 100
    assert MaterialLayout.from_json(json.loads(json.dumps(layout.to_json()))) == layout
    with pytest.raises(BallotError, match="cover 8 of 10"):  # shards not covering numel
        MaterialLayout(10, "fp32", False, (ShardDigest(0, 4, 1, D1), ShardDigest(4, 8, 1, D1)))
    with pytest.raises(BallotError, match="cover 12 of 10"):
        MaterialLayout(10, "fp32", False, (ShardDigest(0, 12, 1, D1),))
    with pytest.raises(BallotError, match="does not follow"):  # a gap
        MaterialLayout(10, "fp32", False, (ShardDigest(0, 4, 1, D1), ShardDigest(5, 10, 1, D1)))
    with pytest.raises(BallotError, match="does not follow"):  # an overlap
        MaterialLayout(10, "fp32", False, (ShardDigest(0, 4, 1, D1), ShardDigest(3, 10, 1, D1)))
    with pytest.raises(BallotError, match="does not follow"):  # a backwards shard
        MaterialLayout(10, "fp32", False, (ShardDigest(0, 6, 1, D1), ShardDigest(6, 4, 1, D1),
                                           ShardDigest(4, 10, 1, D1)))
    with pytest.raises(BallotError, match="does not follow"):  # a negative size
        MaterialLayout(10, "fp32", False, (ShardDigest(0, 10, -1, D1),))
    with pytest.raises(BallotError, match="0 shards"):
        MaterialLayout(0, "fp32", False, ())
    too_many = tuple(ShardDigest(i, i + 1, 1, D1) for i in range(MAX_SHARDS + 1))
    with pytest.raises(BallotError):
        MaterialLayout(MAX_SHARDS + 1, "fp32", False, too_many)
    assert len(MaterialLayout(MAX_SHARDS, "fp32", False, too_many[:-1]).shards) == MAX_SHARDS


@pytest.mark.parametrize(("key", "bad"), [
    ("base", "0" * 63), ("base", "0" * 65), ("base", "A" * 64), ("base", "g" * 64), ("base", 5),
    ("result", ""), ("result", "F" * 64), ("result", "0" * 63), ("result", None),
    ("round", -1), ("round", True), ("round", "3"), ("scope", 3), ("scope", "s" * (MAX_ID_CHARS + 1)),
    ("session", ""), ("session", None), ("contributors", "abc"), ("contributors", ["a", ""]),
    ("contributors", ["a", 3]), ("next_voters", [["a", 0], ["a", 1]]), ("next_voters", [["a", 0], ["b", 7], ["a", 0]]),
    ("next_voters", None), ("next_voters", [["a", -1]]), ("layout", None), ("layout", []),
])
def test_value_from_json_refuses_malformed_fields(key: str, bad: Any) -> None:
    raw = _value().to_json()
    raw[key] = bad
    with pytest.raises(BallotError):
        Value.from_json(raw)


@pytest.mark.parametrize("layout", [
    {"numel": 10, "codec": "fp32", "gather": False, "shards": [[0, 4, 40, D1], [4, 10, 60, "xyz"]]},
    {"numel": 10, "codec": "fp32", "gather": False, "shards": [[0, 4, 40, D1], [4, 10, 60, D2.upper()]]},
    {"numel": 10, "codec": "fp32", "gather": False, "shards": [[0, 4, 40, D1], [4, 9, 60, D1]]},
    {"numel": 10, "codec": "fp32", "gather": False, "shards": [[0, 4, 40, D1]]},
    {"numel": 10, "codec": "fp32", "gather": False, "shards": [[0, 10, 40]]},
    {"numel": 10, "codec": "fp32", "gather": False, "shards": []},
    {"numel": 10, "codec": "fp32", "gather": "no", "shards": [[0, 10, 40, D1]]},
    {"numel": "10", "codec": "fp32", "gather": False, "shards": [[0, 10, 40, D1]]},
    {"numel": 10, "codec": 7, "gather": False, "shards": [[0, 10, 40, D1]]},
    {"numel": 10, "codec": "fp32", "gather": False},
    {"numel": 10, "codec": "fp32", "gather": False, "shards": [["x", 10, 40, D1]]},
    {"numel": 10, "codec": "fp32", "gather": False, "shards": [[0, 10, 40, D1]] * 2},
])
def test_value_from_json_refuses_a_malformed_layout(layout: dict[str, Any]) -> None:
    raw = _value().to_json()
    raw["layout"] = layout
    with pytest.raises(BallotError, match="material layout"):
        Value.from_json(raw)


def test_a_value_whose_voters_did_not_contribute_is_refused() -> None:
    """A commit names the next round's voters among its own contributors (round/committee.py): a value that names
    anyone else (a proposer making itself and its friends the voters) does not decode."""
    raw = _value(next_voters=(Voter("a", 0), Voter("mallory", 0))).to_json()
    with pytest.raises(BallotError, match="mallory"):
        Value.from_json(raw)
    assert Value.from_json(_value(next_voters=(Voter("c", 2),)).to_json()).next_voters == (Voter("c", 2),)


@pytest.mark.parametrize("missing", ["scope", "round", "session", "base", "contributors"])
def test_value_from_json_refuses_a_missing_field(missing: str) -> None:
    raw = _value().to_json()
    del raw[missing]
    with pytest.raises(BallotError, match="missing"):
        Value.from_json(raw)


def test_value_from_json_refuses_a_non_object() -> None:
    for raw in (None, [], "value", 3):
        with pytest.raises(BallotError, match="expected an object"):
            Value.from_json(raw)


# ---------------------------------------------------------------------------------------------- voters

def test_voters_json_round_trip_keeps_the_order() -> None:
    voters = (Voter("b", 7), Voter("a", 0), Voter("c", (1 << 63) - 1))
    raw = voters_to_json(voters)
    assert raw == [["b", 7], ["a", 0], ["c", (1 << 63) - 1]]
    assert voters_from_json(json.loads(json.dumps(raw))) == voters
    assert voters_from_json([]) == ()
    assert str(Voter("peer", 3)) == "peer#3"


@pytest.mark.parametrize("raw", [
    None, "a", {"a": 0}, [["a"]], [["a", 0, 1]], [("a", 0)], [[3, 0]], [["", 0]], [["p" * (MAX_ID_CHARS + 1), 0]],
    [["a", -1]], [["a", 1 << 63]], [["a", True]], [["a", "0"]], [["a", 0.0]], [["a", None]],
    [["a", 0], ["b", 1], ["a", 0]], [["a", 0], ["a", 1]],
    [[f"p{i}", 0] for i in range(MAX_VOTERS + 1)],
])
def test_voters_from_json_refuses_malformed_input(raw: Any) -> None:
    with pytest.raises(BallotError, match=r"^crew:"):
        voters_from_json(raw, what="crew")


def test_voters_from_json_takes_the_most_voters_and_the_longest_ids() -> None:
    many = [[f"p{i}", i] for i in range(MAX_VOTERS)]
    assert len(voters_from_json(many)) == MAX_VOTERS
    assert voters_from_json([["p" * MAX_ID_CHARS, 0]]) == (Voter("p" * MAX_ID_CHARS, 0),)


def test_genesis_json_round_trip_and_validation() -> None:
    g = Genesis(0, (Voter("a", 0), Voter("b", 1)))
    assert Genesis.from_json(json.loads(json.dumps(g.to_json()))) == g
    for raw in (None, {}, {"round": -1, "voters": []}, {"round": "0", "voters": []},
                {"round": 0, "voters": [["a", 0], ["a", 0]]}, {"round": 0}):
        with pytest.raises(BallotError, match="genesis"):
            Genesis.from_json(raw)


# ---------------------------------------------------------------------------------------------- statements

_GRANT: dict[str, Any] = {"run": "run/nonce", "scope": "model", "round_index": 3,
                          "ballot": Ballot(1, 2, 0, "s", ""), "value_id": "ab" * 32, "voter": Voter("p", 4)}


def test_grant_statement_bytes() -> None:
    assert grant_statement(**_GRANT) == (
        b'swarmtrain/grant\0["run/nonce","model",3,[1,2,0,"s",""],"' + b"ab" * 32 + b'","p",4]')
    assert retire_statement(run="run/nonce", scope="model", voter=Voter("p", 4), from_round=9) == (
        b'swarmtrain/retire\0["run/nonce","model","p",4,9,null,null,""]')
    assert retire_statement(run="run/nonce", scope="model", voter=Voter("p", 4), from_round=9,
                            promised=Ballot(1, 0, 0, "s", "")) == (
        b'swarmtrain/retire\0["run/nonce","model","p",4,9,[1,0,0,"s",""],null,""]')
    assert retire_statement(run="run/nonce", scope="model", voter=Voter("p", 4), from_round=9,
                            promised=Ballot(1, 0, 0, "s", ""), accepted=Ballot(1, 0, 0, "s", ""),
                            value_id="cd" * 32) == (
        b'swarmtrain/retire\0["run/nonce","model","p",4,9,[1,0,0,"s",""],[1,0,0,"s",""],"' + b"cd" * 32 + b'"]')


@pytest.mark.parametrize(("key", "other"), [
    ("run", "run/other"), ("run", "other/nonce"), ("scope", "stage1"), ("scope", ""), ("round_index", 4),
    ("ballot", Ballot(2, 2, 0, "s", "")), ("ballot", Ballot(1, 3, 0, "s", "")), ("ballot", Ballot(1, 2, 1, "s", "")),
    ("ballot", Ballot(1, 2, 0, "t", "")), ("ballot", Ballot(1, 2, 0, "s", "p")), ("value_id", "cd" * 32),
    ("voter", Voter("q", 4)), ("voter", Voter("p", 5)),
])
def test_grant_statement_differs_in_every_field(key: str, other: Any) -> None:
    assert grant_statement(**{**_GRANT, key: other}) != grant_statement(**_GRANT)


def test_statements_are_unambiguous() -> None:
    # fields cannot slide into each other
    a = grant_statement(**{**_GRANT, "run": "x", "scope": "y,z"})
    b = grant_statement(**{**_GRANT, "run": "x,y", "scope": "z"})
    assert a != b
    # a grant is never a retirement
    grants = {grant_statement(**{**_GRANT, "round_index": r}) for r in range(5)}
    retires = {retire_statement(run="run/nonce", scope="model", voter=Voter("p", 4), from_round=r) for r in range(5)}
    assert len(grants) == 5 and len(retires) == 5 and not grants & retires


@pytest.mark.parametrize("change", [
    {"run": "run/other"}, {"scope": "stage1"}, {"voter": Voter("q", 4)}, {"voter": Voter("p", 5)},
    {"from_round": 10},
])
def test_retire_statement_differs_in_every_field(change: dict[str, Any]) -> None:
    base: dict[str, Any] = {"run": "run/nonce", "scope": "model", "voter": Voter("p", 4), "from_round": 9}
    assert retire_statement(**{**base, **change}) != retire_statement(**base)

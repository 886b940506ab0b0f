"""Certificates (swarmtrain/round/certificate.py) of real Ed25519 grants: what checks, what is refused and why,
retirements lowering the quorum, the JSON form, and following a chain of rounds from a known state."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

import pytest

from swarmtrain.round.ballots import (
    Ballot,
    BallotError,
    MaterialLayout,
    ShardDigest,
    Value,
    Voter,
    grant_statement,
    retire_statement,
    session_ballot,
)
from swarmtrain.round.certificate import (
    Certificate,
    CertificateError,
    Retirement,
    SignedGrant,
    check_certificate,
    check_retirement,
    follow_chain,
    grants_by_voter,
    retired_reports,
    successors_of,
)
from swarmtrain.trust.identity import Ed25519Identity, registry_binding, verifier

pytestmark = pytest.mark.unit

RUN, SCOPE, ROUND = "run-1/nonce-1", "model", 5
IDS = {f"p{i}": Ed25519Identity.from_seed(f"p{i}", f"seed-{i}".encode()) for i in range(8)}
VERIFY = verifier(registry_binding({pid: ident.public_key for pid, ident in IDS.items()}))
V = (Voter("p0", 0), Voter("p1", 3), Voter("p2", 1), Voter("p3", 0), Voter("p4", 9))
BALLOT = session_ballot(2, 0, "sess")


def _digest(tag: str) -> str:
    return (tag.encode().hex() * 64)[:64]


def _value(round_index: int = ROUND, *, base: str = _digest("base"), result: str = _digest("result"),
           next_voters: Sequence[Voter] = V, scope: str = SCOPE, session: str = "sess") -> Value:
    layout = MaterialLayout(16, "fp32", False, (ShardDigest(0, 16, 64, _digest("shard")),))
    contributors = tuple(dict.fromkeys(["p0", "p1", *(v.peer_id for v in next_voters)]))  # voters contributed
    return Value(scope, round_index, session, base, contributors, tuple(next_voters), layout, result)


def _grant(voter: Voter, value: Value, *, ballot: Ballot = BALLOT, run: str = RUN, signer: str | None = None,
           scope: str | None = None, round_index: int | None = None) -> SignedGrant:
    ident = IDS[signer or voter.peer_id]
    message = grant_statement(run=run, scope=value.scope if scope is None else scope,
                              round_index=value.round if round_index is None else round_index, ballot=ballot,
                              value_id=value.value_id, voter=voter)
    return SignedGrant(voter, ident.public_key, ident.sign(message))


def _retirement(voter: Voter, from_round: int, *, run: str = RUN, scope: str = SCOPE) -> Retirement:
    ident = IDS[voter.peer_id]
    return Retirement(voter, from_round, ident.public_key,
                      ident.sign(retire_statement(run=run, scope=scope, voter=voter, from_round=from_round)))


def _cert(grants: Sequence[Voter] = V[:3], *, value: Value | None = None, retirements: Sequence[Retirement] = (),
          extra: Sequence[SignedGrant] = ()) -> Certificate:
    value = value or _value()
    return Certificate(RUN, BALLOT, value, tuple(_grant(v, value) for v in grants) + tuple(extra), tuple(retirements))


def _check(cert: Certificate, voters: Sequence[Voter] = V, **kw: Any) -> None:
    check_certificate(cert, run=kw.pop("run", RUN), voters=voters, verify=VERIFY, **kw)


def _flip(sig: bytes) -> bytes:
    return bytes([sig[0] ^ 1]) + sig[1:]


# ---------------------------------------------------------------------------------------------- checks

def test_a_quorum_of_real_grants_checks() -> None:
    _check(_cert(V[:3]))
    _check(_cert(V[2:]))
    _check(_cert(V), scope=SCOPE, round_index=ROUND)
    _check(_cert((V[4], V[0], V[2])))  # in any order


def test_too_few_grants_are_no_quorum() -> None:
    for grants in ((), V[:1], V[:2], (V[1], V[4])):
        with pytest.raises(CertificateError, match=rf"{len(grants)} grants of the 5 voters .*not a quorum"):
            _check(_cert(grants))
    with pytest.raises(CertificateError, match="no voters"):
        _check(_cert(V[:3]), voters=())


def test_a_forged_signature_is_refused_naming_its_voter() -> None:
    cert = _cert(V[:4])
    forged = SignedGrant(V[1], cert.grants[1].public_key, _flip(cert.grants[1].signature))
    bad = Certificate(RUN, BALLOT, cert.value, (cert.grants[0], forged, *cert.grants[2:]))
    with pytest.raises(CertificateError, match=r"grant of p1#3 does not verify"):
        _check(bad)  # three good grants are a quorum, but a forged one is refused, not skipped
    # another voter's key and signature, or a key that is not the voter's own
    value = cert.value
    by_p0 = _grant(V[1], value, signer="p0")
    with pytest.raises(CertificateError, match=r"grant of p1#3 does not verify"):
        _check(Certificate(RUN, BALLOT, value, (cert.grants[0], by_p0, cert.grants[2])))
    stranger = _grant(V[1], value, signer="p7")
    with pytest.raises(CertificateError, match=r"grant of p1#3 does not verify"):
        _check(Certificate(RUN, BALLOT, value, (cert.grants[0], stranger, cert.grants[2])))
    wrong_key = SignedGrant(V[1], IDS["p7"].public_key, cert.grants[1].signature)
    with pytest.raises(CertificateError, match=r"grant of p1#3 does not verify"):
        _check(Certificate(RUN, BALLOT, value, (cert.grants[0], wrong_key, cert.grants[2])))


def test_a_grant_of_a_non_voter_is_refused() -> None:
    value = _value()
    outsider = _grant(Voter("p7", 0), value)
    with pytest.raises(CertificateError, match=r"grant from p7#0, who is not a voter of round 5"):
        _check(_cert(V[:3], extra=(outsider,)))
    # the next incarnation of a voter is not the voter
    with pytest.raises(CertificateError, match=r"grant from p1#4, who is not a voter"):
        _check(_cert((V[0], Voter("p1", 4), V[2])))


def test_two_grants_of_one_voter_are_refused() -> None:
    value = _value()
    with pytest.raises(CertificateError, match=r"two grants from p1#3"):
        _check(_cert(V[:3], extra=(_grant(V[1], value),)))
    with pytest.raises(CertificateError, match=r"two grants from p0#0"):  # would make 2 look like 3
        _check(_cert((V[0], V[1], V[0])))


@pytest.mark.parametrize("what", ["value", "ballot", "run", "scope", "round"])
def test_grants_for_something_else_do_not_verify(what: str) -> None:
    value = _value()
    other = _value(result=_digest("other"))
    kw: dict[str, Any] = {
        "value": {}, "ballot": {"ballot": session_ballot(2, 1, "sess")}, "run": {"run": "run-1/nonce-2"},
        "scope": {"scope": "stage1"}, "round": {"round_index": ROUND + 1}}[what]
    grants = [_grant(V[0], value), _grant(V[1], other if what == "value" else value, **kw), _grant(V[2], value)]
    with pytest.raises(CertificateError, match=r"grant of p1#3 does not verify"):
        _check(Certificate(RUN, BALLOT, value, tuple(grants)))
    # every grant for the other thing: still nothing verifies
    all_other = tuple(_grant(v, other if what == "value" else value, **kw) for v in V)
    with pytest.raises(CertificateError, match="does not verify"):
        _check(Certificate(RUN, BALLOT, value, all_other))


def test_a_certificate_of_another_run_scope_or_round_is_refused() -> None:
    cert = _cert(V[:3])
    with pytest.raises(CertificateError, match="of run"):
        _check(cert, run="run-2/nonce")
    with pytest.raises(CertificateError, match="of scope 'model', not 'stage1'"):
        _check(cert, scope="stage1")
    with pytest.raises(CertificateError, match="of round 5, not 6"):
        _check(cert, round_index=6)
    # relabelled as another run: its grants were not signed for it
    relabelled = Certificate("run-2/nonce", BALLOT, cert.value, cert.grants)
    with pytest.raises(CertificateError, match="does not verify"):
        _check(relabelled, run="run-2/nonce")
    # another ballot claimed for the same grants
    with pytest.raises(CertificateError, match="does not verify"):
        _check(Certificate(RUN, session_ballot(3, 0, "sess"), cert.value, cert.grants))


# ---------------------------------------------------------------------------------------------- retirements

def test_signed_retirements_lower_the_quorum() -> None:
    two = V[:2]
    with pytest.raises(CertificateError, match="not a quorum"):
        _check(_cert(two))
    _check(_cert(two, retirements=(_retirement(V[3], ROUND), _retirement(V[4], 0))))  # 2 of the 3 left
    with pytest.raises(CertificateError, match="1 grants of the 3 voters"):
        _check(_cert(V[:1], retirements=(_retirement(V[3], ROUND), _retirement(V[4], 2))))
    # one retirement: 2 of 4 is not more than half
    with pytest.raises(CertificateError, match="2 grants of the 4 voters"):
        _check(_cert(two, retirements=(_retirement(V[4], ROUND),)))
    # every voter retired: no quorum at all
    with pytest.raises(CertificateError, match="0 grants of the 0 voters"):
        _check(_cert((), retirements=tuple(_retirement(v, 1) for v in V)))


def test_a_retirement_from_a_later_round_does_not_count() -> None:
    with pytest.raises(CertificateError, match=r"retirement of p4#9 \(from round 6, promised None\) does not count"):
        _check(_cert(V[:2], retirements=(_retirement(V[3], ROUND), _retirement(V[4], ROUND + 1))))


def test_a_retirement_naming_a_promise_counts_only_for_the_ballots_above_it() -> None:
    """A voter that promised a ballot of round r and then retired from r: a quorum of a ballot at or below that
    promise may hold its promise, so only the ballots above it are counted without it."""
    ballot = _cert(V[:2]).ballot
    below = Ballot(ballot.attempt - 1, 0, 0, "older", "") if ballot.attempt else None
    for promised, counts in ((Ballot(ballot.attempt + 1, 0, 0, "later", ""), False), (ballot, False),
                             (below, True), (None, True)):
        ident = IDS["p4"]
        r = Retirement(V[4], ROUND, ident.public_key, ident.sign(retire_statement(
            run=RUN, scope=SCOPE, voter=V[4], from_round=ROUND, promised=promised)), promised)
        assert r.counts_for(ROUND, ballot) is counts and r.counts_for(ROUND + 1, ballot)
        if counts:
            _check(_cert(V[:2], retirements=(_retirement(V[3], ROUND), r)))
        else:
            with pytest.raises(CertificateError, match="does not count"):
                _check(_cert(V[:2], retirements=(_retirement(V[3], ROUND), r)))


def test_an_unsigned_or_foreign_retirement_does_not_count() -> None:
    good = _retirement(V[3], ROUND)
    forged = Retirement(V[4], ROUND, IDS["p4"].public_key, _flip(_retirement(V[4], ROUND).signature))
    with pytest.raises(CertificateError, match=r"retirement of p4#9 does not verify"):
        _check(_cert(V[:2], retirements=(good, forged)))
    # signed for an earlier round than it claims: the statement differs
    moved = Retirement(V[4], 1, IDS["p4"].public_key, _retirement(V[4], ROUND).signature)
    with pytest.raises(CertificateError, match=r"retirement of p4#9 does not verify"):
        _check(_cert(V[:2], retirements=(good, moved)))
    for other in (_retirement(V[4], ROUND, run="run-1/nonce-2"), _retirement(V[4], ROUND, scope="stage1")):
        with pytest.raises(CertificateError, match=r"retirement of p4#9 does not verify"):
            _check(_cert(V[:2], retirements=(good, other)))
    signed_by_other = Retirement(V[4], ROUND, IDS["p3"].public_key, good.signature)
    with pytest.raises(CertificateError, match=r"retirement of p4#9 does not verify"):
        _check(_cert(V[:2], retirements=(good, signed_by_other)))
    with pytest.raises(CertificateError, match=r"retirement of p7#0, who is not a voter"):
        _check(_cert(V[:3], retirements=(_retirement(Voter("p7", 0), ROUND),)))
    check_retirement(good, run=RUN, scope=SCOPE, verify=VERIFY)
    with pytest.raises(CertificateError):
        check_retirement(good, run=RUN, scope="stage1", verify=VERIFY)


def _frozen(voter: Voter, value: Value, accepted: Ballot, *, promised: Ballot | None = None) -> Retirement:
    """`voter` retired from `value`'s round, where it had accepted `value` in `accepted` (and promised `promised`)."""
    ident, promised = IDS[voter.peer_id], promised or accepted
    return Retirement(voter, value.round, ident.public_key, ident.sign(retire_statement(
        run=RUN, scope=SCOPE, voter=voter, from_round=value.round, promised=promised, accepted=accepted,
        value_id=value.value_id)), promised, accepted, value)


def test_a_retirement_names_what_it_accepted_signed_and_the_ballots_above_it_carry_that() -> None:
    """A voter that accepted a value in round r and retired from r: the ballots above its promise count their
    quorum without it and weigh its accepted (ballot, value) as a promise's report (`retired_reports`); what it
    accepted is signed with the rest, so a changed value does not verify."""
    v, other = _value(), _value(session="other")
    low, high = Ballot(1, 0, 0, "a", ""), Ballot(5, 0, 0, "b", "")
    r = _frozen(V[4], v, low)
    check_retirement(r, run=RUN, scope=SCOPE, verify=VERIFY)
    assert Retirement.from_json(json.loads(json.dumps(r.to_json()))) == r
    assert retired_reports({V[4]: r}, ROUND, high) == [(low, v)]
    assert retired_reports({V[4]: r}, ROUND, low) == []  # at its own promise it is counted (it may accept)
    assert retired_reports({V[4]: r}, ROUND + 1, high) == []  # a later round: counted without, nothing to carry
    swapped = Retirement(r.voter, r.from_round, r.public_key, r.signature, r.promised, r.accepted, other)
    with pytest.raises(CertificateError, match="does not verify"):
        check_retirement(swapped, run=RUN, scope=SCOPE, verify=VERIFY)
    later = _value(ROUND + 1)
    moved = Retirement(r.voter, r.from_round, r.public_key, r.signature, r.promised, r.accepted, later)
    with pytest.raises(CertificateError, match="names a value of scope"):
        check_retirement(moved, run=RUN, scope=SCOPE, verify=VERIFY)
    raw = r.to_json()
    for bad in (raw[:6], [*raw[:6], None, raw[7]], [*raw[:6], raw[6], None], [*raw[:7], later.to_json()]):
        with pytest.raises(BallotError):
            Retirement.from_json(bad)


def test_a_retired_voter_cannot_also_grant() -> None:
    with pytest.raises(CertificateError, match=r"grant from p2#1, who retired"):
        _check(_cert(V[:3], retirements=(_retirement(V[2], ROUND), _retirement(V[4], ROUND))))


# ---------------------------------------------------------------------------------------------- JSON

def test_json_round_trip() -> None:
    cert = _cert(V[:2], retirements=(_retirement(V[3], 4), _retirement(V[4], ROUND)))
    raw = json.loads(json.dumps(cert.to_json()))
    assert raw["run"] == RUN and raw["ballot"] == [2, 0, 0, "sess", ""]
    assert raw["grants"][0][:2] == ["p0", 0] and raw["retirements"][0][:3] == ["p3", 0, 4]
    back = Certificate.from_json(raw)
    assert back == cert
    assert back.round == ROUND and back.scope == SCOPE
    _check(back)
    assert grants_by_voter(back.grants) == {V[0]: cert.grants[0], V[1]: cert.grants[1]}


def _raw_cert(**changes: Any) -> dict[str, Any]:
    raw = _cert(V[:3], retirements=(_retirement(V[4], 1),)).to_json()
    raw.update(changes)
    return raw


@pytest.mark.parametrize("raw", [
    None, [], _raw_cert(run=None), _raw_cert(run="r" * 513), _raw_cert(grants=None), _raw_cert(grants={}),
    _raw_cert(retirements=None), _raw_cert(ballot=[0, 0]), _raw_cert(value={}),
    _raw_cert(grants=[["p0", 0, "zz", "00"]]), _raw_cert(grants=[["p0", 0, "", "00"]]),
    _raw_cert(grants=[["p0", 0, "00" * 1025, "00"]]), _raw_cert(grants=[["p0", 0, "00", ""]]),
    _raw_cert(grants=[["p0", 0, "00"]]), _raw_cert(grants=[[0, 0, "00", "00"]]),
    _raw_cert(grants=[["p0", "0", "00", "00"]]), _raw_cert(grants=[["p0", 0, 5, "00"]]),
    _raw_cert(retirements=[["p4", 9, -1, "00", "00"]]), _raw_cert(retirements=[["p4", 9, 1, "00"]]),
    _raw_cert(retirements=[["p4", 9, 1, "00", "xx"]]), _raw_cert(retirements=[["p4", 9, "1", "00", "00"]]),
    _raw_cert(grants=[["p0", 0, "00", "00"]] * 4097),
])
def test_from_json_refuses_malformed_input(raw: Any) -> None:
    with pytest.raises(BallotError):
        Certificate.from_json(raw)


# ---------------------------------------------------------------------------------------------- chains

D5, D6, D7, D8 = _digest("d5"), _digest("d6"), _digest("d7"), _digest("d8")
V5 = (Voter("p0", 0), Voter("p1", 0), Voter("p2", 0))
V6 = (Voter("p1", 0), Voter("p2", 0), Voter("p3", 0), Voter("p4", 0))  # p0 left, p3 and p4 joined
V7 = (Voter("p2", 0), Voter("p3", 0), Voter("p4", 0), Voter("p5", 1), Voter("p6", 0))
V8 = (Voter("p3", 0), Voter("p5", 1))


def _link(round_index: int, base: str, result: str, signers: Sequence[Voter], next_voters: Sequence[Voter],
          *, scope: str = SCOPE) -> Certificate:
    value = _value(round_index, base=base, result=result, next_voters=next_voters, scope=scope,
                   session=f"s{round_index}")
    return Certificate(RUN, BALLOT, value, tuple(_grant(v, value) for v in signers))


def _chain() -> list[Certificate]:
    return [_link(5, D5, D6, V5[:2], V6), _link(6, D6, D7, V6[1:], V7), _link(7, D7, D8, V7[:3], V8)]


def _follow(certs: Sequence[Certificate], round_index: int = 5, digest: str = D5,
            voters: Sequence[Voter] = V5, **kw: Any) -> tuple[int, str, tuple[Voter, ...]] | None:
    return follow_chain(certs, run=kw.pop("run", RUN), scope=kw.pop("scope", SCOPE), round_index=round_index,
                        voters=voters, digest=digest, verify=VERIFY)


def test_follow_chain_reaches_the_newest_state_the_chain_vouches_for() -> None:
    certs = _chain()
    assert _follow(certs) == (8, D8, V8)
    shuffled = certs[:]
    random.Random(4).shuffle(shuffled)
    assert _follow(shuffled) == (8, D8, V8)
    assert _follow(certs[:1]) == (6, D6, V6)
    assert _follow(certs[:2]) == (7, D7, V7)
    # from a later state the peer holds
    assert _follow(certs, 6, D6, V6) == (8, D8, V8)
    assert _follow(certs, 7, D7, V7) == (8, D8, V8)
    # certificates of another scope are no links of this one
    others = [_link(5, D5, _digest("x"), V5, V6, scope="stage1")]
    assert _follow(others + certs) == (8, D8, V8)
    assert _follow(others) is None


def test_follow_chain_stops_at_a_link_with_another_base() -> None:
    c5, _, c7 = _chain()
    wrong_base = _link(6, _digest("elsewhere"), D7, V6[1:], V7)
    assert _follow([c5, wrong_base, c7]) == (6, D6, V6)


def test_follow_chain_stops_at_a_link_signed_by_other_voters() -> None:
    c5, _, c7 = _chain()
    by_old_voters = _link(6, D6, D7, V5, V7)  # round 5's voters, not the V6 round 5 named: p0 is no voter
    assert _follow([c5, by_old_voters, c7]) == (6, D6, V6)
    too_few = _link(6, D6, D7, V6[2:], V7)  # 2 of 4
    assert _follow([c5, too_few, c7]) == (6, D6, V6)
    # a forged grant breaks the link too
    good = _chain()[1]
    forged = Certificate(RUN, BALLOT, good.value, (SignedGrant(good.grants[0].voter, good.grants[0].public_key,
                                                               _flip(good.grants[0].signature)), *good.grants[1:]))
    assert _follow([c5, forged, c7]) == (6, D6, V6)


def test_follow_chain_stops_at_a_missing_link() -> None:
    c5, _, c7 = _chain()
    assert _follow([c5, c7]) == (6, D6, V6)


def test_follow_chain_is_none_when_the_first_link_does_not_start_at_the_given_state() -> None:
    certs = _chain()
    assert _follow(certs, digest=_digest("mine")) is None  # another state of round 5
    assert _follow(certs, voters=V6) is None  # other voters: p0's grant is no voter's
    assert _follow(certs, voters=(Voter("p0", 1), Voter("p1", 1), Voter("p2", 1))) is None  # other incarnations
    assert _follow(certs, 4, D5, V5) is None  # no certificate of round 4
    assert _follow(certs, voters=()) is None
    assert _follow(certs, run="run-2/nonce") is None
    assert _follow(certs, scope="stage1") is None
    assert _follow([]) is None


def test_nothing_chosen_below_counts_who_may_have_accepted_each_ballot() -> None:
    """A value of ballot b is chosen only if more than half of b's base accepted b; a voter whose final
    highest accepted ballot is known accepted nothing above it. Only a value that provably had no quorum may
    be dropped by a proposer."""
    from swarmtrain.round.ballots import ZERO_BALLOT
    from swarmtrain.round.certificate import nothing_chosen_below

    a, b, c = V[:3]
    b1, b2, b3, top = (Ballot(i, 0, 0, "s", "") for i in (1, 2, 3, 9))

    def retired(voter: Voter, promised: Ballot, accepted: Ballot | None) -> Retirement:
        return Retirement(voter, ROUND, b"k", b"s", promised, accepted, None if accepted is None else _value())

    def check(voters: Sequence[Voter], known: dict[Voter, Ballot], gone: Sequence[Retirement] = ()) -> bool:
        return nothing_chosen_below(top, ROUND, voters, {r.voter: r for r in gone}, known)

    # two voters, one left having accepted b1, the other accepted nothing: b1 had 1 of 2
    assert check((a, b), {a: b1, b: ZERO_BALLOT}, [retired(a, b1, b1)])
    # the other's last accept is unknown: it may have accepted b1 too
    assert not check((a, b), {a: b1}, [retired(a, b1, b1)])
    # three voters, two accepted b1: chosen, perhaps
    assert not check((a, b, c), {a: b1, b: b1, c: ZERO_BALLOT})
    # one accepted b1, one later b2 (it may have accepted b1 on the way): 2 of 3 may have accepted b1
    assert not check((a, b, c), {a: b1, b: b2, c: ZERO_BALLOT})
    assert check((a, b, c), {a: b1, b: ZERO_BALLOT, c: ZERO_BALLOT})
    # a voter retired with a promise of b3 is in the base of every ballot up to b3: with c unknown, b2 had
    # 2 (b, c) of 3 that may have accepted it
    assert not check((a, b, c), {a: ZERO_BALLOT, b: b2}, [retired(a, b3, None)])
    # nobody left to count: never provable
    assert not check((a,), {a: ZERO_BALLOT}, [retired(a, b1, None)])
    assert check((a, b, c), {a: ZERO_BALLOT, b: ZERO_BALLOT, c: ZERO_BALLOT})


def _succeeding(voter: Voter, from_round: int, successors: Sequence[Voter]) -> Retirement:
    ident = IDS[voter.peer_id]
    return Retirement(voter, from_round, ident.public_key, ident.sign(retire_statement(
        run=RUN, scope=SCOPE, voter=voter, from_round=from_round, successors=successors)),
        successors=tuple(successors))


def test_a_round_whose_every_voter_retired_having_accepted_nothing_goes_to_the_successors_they_named() -> None:
    """Every voter of a round retired from it (or before) and none accepted anything there: nothing was chosen
    and nothing can be, so the successors a retirement names decide the round; of several, those of the highest
    (from_round, voter), so every peer holding the same retirements takes the same ones. Signed with the rest."""
    voters, a, b = V[:2], (Voter("p5", 0), Voter("p6", 2), Voter("p7", 1)), (Voter("p6", 2),)
    early, last = _succeeding(V[0], ROUND - 1, b), _succeeding(V[1], ROUND, a)
    for r in (early, last):
        check_retirement(r, run=RUN, scope=SCOPE, verify=VERIFY)
        assert Retirement.from_json(json.loads(json.dumps(r.to_json()))) == r
    assert successors_of(voters, {V[0]: early, V[1]: last}, ROUND) == a  # the later round's
    tie = _succeeding(V[0], ROUND, b)
    assert successors_of(voters, {V[0]: tie, V[1]: last}, ROUND) == a  # (ROUND, p1) > (ROUND, p0)
    alone = _succeeding(V[1], ROUND, (Voter("p1", 4),))  # p1 saw nobody else at the round: its next incarnation
    assert successors_of(voters, {V[0]: early, V[1]: alone}, ROUND) == b  # others named go first
    assert successors_of(voters, {V[0]: _retirement(V[0], ROUND), V[1]: alone}, ROUND) == (Voter("p1", 4),)
    plain = _retirement(V[0], ROUND)
    assert successors_of(voters, {V[0]: plain, V[1]: last}, ROUND) == a  # one naming them is enough
    assert successors_of(voters, {V[0]: plain, V[1]: _retirement(V[1], ROUND)}, ROUND) == ()  # none named
    assert successors_of(voters, {V[1]: last}, ROUND) == ()  # a voter not known retired may still vote
    assert successors_of(voters, {V[0]: _succeeding(V[0], ROUND + 1, b), V[1]: last}, ROUND) == ()  # it voted
    accepted = _frozen(V[0], _value(), Ballot(1, 0, 0, "s", ""))
    assert successors_of(voters, {V[0]: accepted, V[1]: last}, ROUND) == ()  # something may have been chosen
    forged = Retirement(last.voter, last.from_round, last.public_key, last.signature, successors=b)
    with pytest.raises(CertificateError, match="does not verify"):
        check_retirement(forged, run=RUN, scope=SCOPE, verify=VERIFY)
    with pytest.raises(BallotError):
        Retirement.from_json([*last.to_json()[:8], [["p5", 0], ["p5", 1]]])  # a peer listed twice

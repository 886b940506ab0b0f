"""A round's certificate: the signed grants of a quorum of its voters for one (ballot, value), with the signed
retirements the quorum was counted without. Any peer that knows the round's voters checks it; pure (the
signature check is passed in: `Verify(peer_id, public_key, message, signature)`, trust/identity.py).

A certificate proves that its value was chosen: a quorum of V(r) ∖ R accepted it in one ballot, and by
Paxos' rule every later ballot of the round carries it. It is what a committer keeps and shows: a peer behind
learns the round from it (and the material, from any holder), and a joiner trusts a state only as far as
its certificate chain reaches back to voters it knows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from swarmtrain.round.ballots import (
    MAX_VOTERS,
    ZERO_BALLOT,
    Ballot,
    BallotError,
    Value,
    Voter,
    grant_statement,
    is_quorum,
    quorum_base,
    retire_statement,
    voters_from_json,
    voters_to_json,
)

__all__ = ["Certificate", "CertificateError", "Retirement", "SignedGrant", "Verify", "check_certificate",
           "check_retirement", "counting", "follow_chain", "nothing_chosen_below", "retired_reports",
           "successors_of"]

MAX_KEY_BYTES = 1024  # an RSA-2048 public key in DER is 294 bytes; ed25519 is 32
MAX_SIGNATURE_BYTES = 1024
MAX_CHAIN = 64  # certificates a chain is followed through (a peer keeps 16; a donor may send a few more)

Verify = Callable[[str, bytes, bytes, bytes], bool]
"""(peer_id, public_key, message, signature) -> whether `public_key` is `peer_id`'s and signed `message`."""


class CertificateError(ValueError):
    """A certificate does not prove what it claims; the message says which part fails."""


def _bytes_field(raw: Any, name: str, limit: int) -> bytes:
    if not isinstance(raw, str):
        raise BallotError(f"{name}: expected a hex string")
    try:
        out = bytes.fromhex(raw)
    except ValueError:
        raise BallotError(f"{name}: not hex") from None
    if not 0 < len(out) <= limit:
        raise BallotError(f"{name}: {len(out)} bytes (at most {limit})")
    return out


@dataclass(frozen=True)
class SignedGrant:
    """`voter` accepted the certificate's (ballot, value): its signature over `grant_statement`."""

    voter: Voter
    public_key: bytes
    signature: bytes

    def to_json(self) -> list[Any]:
        return [self.voter.peer_id, self.voter.incarnation, self.public_key.hex(), self.signature.hex()]

    @classmethod
    def from_json(cls, raw: Any) -> SignedGrant:
        if not isinstance(raw, list) or len(raw) != 4 or not isinstance(raw[0], str) or not isinstance(raw[1], int):
            raise BallotError(f"grant: malformed {raw!r:.80}")
        return cls(Voter(raw[0], raw[1]), _bytes_field(raw[2], "grant.public_key", MAX_KEY_BYTES),
                   _bytes_field(raw[3], "grant.signature", MAX_SIGNATURE_BYTES))


@dataclass(frozen=True)
class Retirement:
    """`voter` retired: it grants nothing more in any round >= `from_round`; in round `from_round` it had promised
    no ballot above `promised` (None: none at all) and had accepted `value` in ballot `accepted` last (None: no
    value); its signature over `retire_statement`.

    A voter retires from the newest round it voted in, naming its vote there: its retirement counts for the
    ballots above its promise (`counting`), not for those at or below, whose promise quorums may hold its
    promise; and the ballots it counts for carry what it accepted (`retired_reports`) as a promise of theirs
    would. A peer leaving after an aborted attempt, or after accepting a value, is thus not needed by the
    ballots that come after it."""

    voter: Voter
    from_round: int
    public_key: bytes
    signature: bytes
    promised: Ballot | None = None
    accepted: Ballot | None = None
    value: Value | None = None
    successors: tuple[Voter, ...] = ()  # named by a round's last voter (`successors_of`)

    def statement(self, *, run: str, scope: str) -> bytes:
        return retire_statement(run=run, scope=scope, voter=self.voter, from_round=self.from_round,
                                promised=self.promised, accepted=self.accepted,
                                value_id="" if self.value is None else self.value.value_id,
                                successors=self.successors)

    def counts_for(self, round_index: int, ballot: Ballot) -> bool:
        """Whether a quorum of `ballot` in round `round_index` is counted without this voter."""
        return self.from_round < round_index or (self.from_round == round_index
                                                 and (self.promised is None or self.promised < ballot))

    def to_json(self) -> list[Any]:
        fields = [self.voter.peer_id, self.voter.incarnation, self.from_round, self.public_key.hex(),
                  self.signature.hex(), None if self.promised is None else self.promised.to_json(),
                  None if self.accepted is None else self.accepted.to_json(),
                  None if self.value is None else self.value.to_json()]
        return [*fields, voters_to_json(self.successors)] if self.successors else fields

    @classmethod
    def from_json(cls, raw: Any) -> Retirement:
        """8 fields, or 9 with the successors it names."""
        if (not isinstance(raw, list) or len(raw) not in (8, 9) or not isinstance(raw[0], str)
                or not isinstance(raw[1], int)
                or isinstance(raw[1], bool) or not isinstance(raw[2], int) or isinstance(raw[2], bool) or raw[2] < 0):
            raise BallotError(f"retirement: malformed {raw!r:.80}")
        if (raw[6] is None) != (raw[7] is None):
            raise BallotError("retirement: an accepted ballot without its value, or the reverse")
        value = None if raw[7] is None else Value.from_json(raw[7])
        if value is not None and value.round != raw[2]:
            raise BallotError(f"retirement: its accepted value is of round {value.round}, not {raw[2]}")
        return cls(Voter(raw[0], raw[1]), raw[2], _bytes_field(raw[3], "retirement.public_key", MAX_KEY_BYTES),
                   _bytes_field(raw[4], "retirement.signature", MAX_SIGNATURE_BYTES),
                   None if raw[5] is None else Ballot.from_json(raw[5]),
                   None if raw[6] is None else Ballot.from_json(raw[6]), value,
                   voters_from_json(raw[8], what="retirement.successors") if len(raw) == 9 else ())


def successors_of(voters: Sequence[Voter], retired: Mapping[Voter, Retirement], round_index: int) -> tuple[Voter, ...]:
    """The voters of round `round_index` in place of `voters`, when every one of them retired from it or before
    and none had accepted anything there: the successors the retirements name (of several, those of the
    highest (from_round, voter), where a retirement naming other peers goes before one naming only its own next
    incarnation, which may never come back); () otherwise.

    Safe because under `voters` the round chose nothing (a value is chosen by a quorum's accepts, and every
    voter's last accept there is frozen in its retirement: none) and never will (a retired voter grants nothing
    there). Every peer that takes the successors holds a retirement of each of `voters`, the same ones, and so
    picks the same successors: one voter set decides the round from then on."""
    if not voters:
        return ()
    named: list[Retirement] = []
    for v in voters:
        r = retired.get(v)
        if r is None or r.voter != v or r.from_round > round_index:
            return ()
        if r.from_round == round_index and r.accepted is not None:
            return ()
        if r.successors:
            named.append(r)
    if not named:
        return ()
    return max(named, key=lambda r: (any(s.peer_id != r.voter.peer_id for s in r.successors), r.from_round,
                                     r.voter)).successors


def counting(retired: Mapping[Voter, Retirement], round_index: int, ballot: Ballot) -> dict[Voter, Retirement]:
    """The retirements a quorum of `ballot` in round `round_index` is counted without (`Retirement.counts_for`)."""
    return {v: r for v, r in retired.items() if r.counts_for(round_index, ballot)}


def retired_reports(retired: Mapping[Voter, Retirement], round_index: int,
                    ballot: Ballot) -> list[tuple[Ballot, Value]]:
    """What the voters that `ballot` counts without had accepted in round `round_index`: a proposer of `ballot`
    weighs these with its promises' reports (Paxos' rule), as if each had promised it with its frozen vote."""
    return [(r.accepted, r.value) for r in counting(retired, round_index, ballot).values()
            if r.from_round == round_index and r.accepted is not None and r.value is not None]


def nothing_chosen_below(ballot: Ballot, round_index: int, voters: Sequence[Voter],
                         retired: Mapping[Voter, Retirement], known: Mapping[Voter, Ballot]) -> bool:
    """Whether no value of round `round_index` can have been chosen in any ballot below `ballot`.

    `known` holds, for some voters, the highest ballot they will ever have accepted below `ballot` (ZERO_BALLOT:
    none): a promise of `ballot` reports it, a retirement freezes it. A voter's accepted ballots only grow, so
    one known at `a` accepted nothing above `a`; the rest may have accepted anything. A value chosen in ballot
    b needs more than half of b's base to have accepted b, checked for every b below `ballot`. True lets a
    proposer drop a reported value whose material nobody holds: it cannot have been chosen."""
    # Who may have accepted b, and b's base, change only at the ballots reported and at the promises that
    # retirements name: checking those, and `ballot` for the ballots above them all, checks every b.
    points = {a for a in known.values() if a != ZERO_BALLOT and a < ballot}
    points |= {r.promised for r in retired.values()
               if r.from_round == round_index and r.promised is not None and r.promised < ballot}
    for b in [*sorted(points), ballot]:
        base = quorum_base(voters, counting(retired, round_index, b))
        may_have = sum(u not in known or known[u] >= b for u in base)
        if not base or 2 * may_have > len(base):
            return False
    return True


def check_retirement(r: Retirement, *, run: str, scope: str, verify: Verify) -> None:
    if r.value is not None and (r.value.scope != scope or r.value.round != r.from_round):
        raise CertificateError(f"the retirement of {r.voter} names a value of scope {r.value.scope!r} round "
                               f"{r.value.round}, not of {scope!r} round {r.from_round}")
    if not verify(r.voter.peer_id, r.public_key, r.statement(run=run, scope=scope), r.signature):
        raise CertificateError(f"the retirement of {r.voter} does not verify (not its key, or a forged signature)")


@dataclass(frozen=True)
class Certificate:
    """Round `value.round` of `value.scope` chose `value`, in `ballot` (see the module docstring)."""

    run: str  # "<run id>/<run nonce>": a certificate of another run never verifies here
    ballot: Ballot
    value: Value
    grants: tuple[SignedGrant, ...]
    retirements: tuple[Retirement, ...] = ()

    @property
    def round(self) -> int:
        return self.value.round

    @property
    def scope(self) -> str:
        return self.value.scope

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "ballot": self.ballot.to_json(), "value": self.value.to_json(),
                "grants": [g.to_json() for g in self.grants], "retirements": [r.to_json() for r in self.retirements]}

    @classmethod
    def from_json(cls, raw: Any) -> Certificate:
        if not isinstance(raw, Mapping):
            raise BallotError("certificate: expected an object")
        grants, retirements = raw.get("grants"), raw.get("retirements", [])
        if not isinstance(grants, list) or len(grants) > MAX_VOTERS:
            raise BallotError("certificate.grants: malformed")
        if not isinstance(retirements, list) or len(retirements) > MAX_VOTERS:
            raise BallotError("certificate.retirements: malformed")
        run = raw.get("run")
        if not isinstance(run, str) or len(run) > 512:
            raise BallotError("certificate.run: malformed")
        return cls(run, Ballot.from_json(raw.get("ballot")), Value.from_json(raw.get("value")),
                   tuple(SignedGrant.from_json(g) for g in grants), tuple(Retirement.from_json(r) for r in retirements))


def check_certificate(cert: Certificate, *, run: str, voters: Sequence[Voter], verify: Verify,
                      scope: str | None = None, round_index: int | None = None) -> None:
    """Raise CertificateError unless `cert` proves its value chosen among `voters` (the round's V(r)).

    Checked: the run, scope and round asked for; every grant and retirement is from a distinct voter of V,
    signed with that voter's own key; every retirement counts for this round; the grants form a quorum of
    V less the retirements."""
    v = cert.value
    if cert.run != run:
        raise CertificateError(f"a certificate of run {cert.run!r}, not {run!r}")
    if scope is not None and v.scope != scope:
        raise CertificateError(f"a certificate of scope {v.scope!r}, not {scope!r}")
    if round_index is not None and v.round != round_index:
        raise CertificateError(f"a certificate of round {v.round}, not {round_index}")
    if not voters:
        raise CertificateError(f"round {v.round} has no voters to check a certificate against")
    eligible = set(voters)
    retired: set[Voter] = set()
    for r in cert.retirements:
        if r.voter not in eligible:
            raise CertificateError(f"retirement of {r.voter}, who is not a voter of round {v.round}")
        if not r.counts_for(v.round, cert.ballot):
            raise CertificateError(f"the retirement of {r.voter} (from round {r.from_round}, promised "
                                   f"{r.promised}) does not count for ballot {tuple(cert.ballot)} of round {v.round}")
        check_retirement(r, run=run, scope=v.scope, verify=verify)
        retired.add(r.voter)
    granted: set[Voter] = set()
    for g in cert.grants:
        if g.voter not in eligible:
            raise CertificateError(f"a grant from {g.voter}, who is not a voter of round {v.round}")
        if g.voter in retired:
            raise CertificateError(f"a grant from {g.voter}, who retired from round {v.round}")
        if g.voter in granted:
            raise CertificateError(f"two grants from {g.voter}")
        message = grant_statement(run=run, scope=v.scope, round_index=v.round, ballot=cert.ballot,
                                  value_id=v.value_id, voter=g.voter)
        if not verify(g.voter.peer_id, g.public_key, message, g.signature):
            raise CertificateError(f"the grant of {g.voter} does not verify (not its key, or a forged signature)")
        granted.add(g.voter)
    if not is_quorum(granted, voters, retired):
        base = quorum_base(voters, retired)
        raise CertificateError(f"{len(granted)} grants of the {len(base)} voters that did not retire: not a "
                               f"quorum (more than half)")


def grants_by_voter(grants: Sequence[SignedGrant]) -> Mapping[Voter, SignedGrant]:
    return {g.voter: g for g in grants}


def follow_chain(certs: Sequence[Certificate], *, run: str, scope: str, round_index: int, voters: Sequence[Voter],
                 digest: str, verify: Verify) -> tuple[int, str, tuple[Voter, ...]] | None:
    """From a state of round `round_index` with digest `digest` decided by `voters`: the newest (round, state
    digest, voters) that `certs` lead to, each certificate checked against the voters the previous one named
    and starting from the state its predecessor led to; None when they do not follow from this state.

    This is how a peer behind trusts one peer ahead: the chain starts at what it holds itself, and each link
    is a quorum of voters it derived, not anyone's word."""
    by_round: dict[int, list[Certificate]] = {}
    for c in certs[:MAX_CHAIN]:
        if c.scope == scope:
            by_round.setdefault(c.round, []).append(c)
    r, d, v = round_index, digest, tuple(voters)
    reached: tuple[int, str, tuple[Voter, ...]] | None = None
    while v:
        link = next((c for c in by_round.get(r, ()) if c.value.base == d and _checks(c, run, v, verify, scope, r)),
                    None)
        if link is None:  # a bad certificate beside a good one of its round does not break the chain
            break
        r, d, v = r + 1, link.value.result, link.value.next_voters
        reached = (r, d, v)
    return reached


def _checks(cert: Certificate, run: str, voters: Sequence[Voter], verify: Verify, scope: str, round_index: int) -> bool:
    try:
        check_certificate(cert, run=run, voters=voters, verify=verify, scope=scope, round_index=round_index)
    except CertificateError:
        return False
    return True

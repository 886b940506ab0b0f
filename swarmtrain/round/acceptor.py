"""A voter's side of a round's decision (Paxos' acceptor), pure: its state, how it answers a prepare and an
accept, how it retires, and its state as JSON for a crash-safe store (sync/votes.py writes it, with fsyncs,
before any answer that grants something leaves the peer).

Per round of its scope the voter keeps the highest ballot it promised and the (ballot, value) it accepted
last, with its signature of that grant. It promises a ballot higher than any it promised (and reports what
it accepted), accepts a (ballot, value) unless it promised a higher ballot, and never names two values in
one ballot. Rounds are bounded: below `floor` (forgotten once the voter's part is past them) and above
`horizon` (its part's round + 1: a future round can pile up nothing) it refuses.

Retiring (a graceful leave) ends the voter's current incarnation: it grants nothing more in any round from
`from_round` on, which is the newest round it granted anything in (at least its part's round), its vote
there final and named in the retirement (the ballot promised, the value accepted); the next incarnation
starts with no votes. The voter announces the signed retirement only once it is
stored, so a retirement someone counts is one the voter keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from swarmtrain.round.ballots import (
    ZERO_BALLOT,
    Ballot,
    BallotError,
    Value,
    Voter,
    voters_from_json,
    voters_to_json,
)

__all__ = ["Accepted", "AcceptorState", "Promised", "Refused", "RoundVote", "VoterRetirement"]

MAX_ROUNDS_KEPT = 64  # rounds a voter keeps votes of (the window is a few; this bounds a corrupt store)


@dataclass
class RoundVote:
    """One round's votes of one incarnation."""

    promised: Ballot = ZERO_BALLOT
    accepted: Ballot = ZERO_BALLOT
    value: Value | None = None
    signature: bytes = b""  # this voter's signature of its grant of (accepted, value)

    def to_json(self) -> dict[str, Any]:
        return {"promised": self.promised.to_json(), "accepted": self.accepted.to_json(),
                "value": None if self.value is None else self.value.to_json(), "signature": self.signature.hex()}

    @classmethod
    def from_json(cls, raw: Any) -> RoundVote:
        if not isinstance(raw, dict):
            raise BallotError("round vote: expected an object")
        value = raw.get("value")
        try:
            signature = bytes.fromhex(raw.get("signature", ""))
        except (TypeError, ValueError):
            raise BallotError("round vote: malformed signature") from None
        return cls(Ballot.from_json(raw.get("promised")), Ballot.from_json(raw.get("accepted")),
                   None if value is None else Value.from_json(value), signature)


@dataclass(frozen=True)
class VoterRetirement:
    """An earlier (or this) incarnation's retirement as this voter stored it: announced in its departure."""

    incarnation: int
    from_round: int
    signature: bytes
    promised: Ballot | None = None  # the ballot it had promised in `from_round`
    accepted: Ballot | None = None  # what it had accepted in `from_round` (`value`), if anything
    value: Value | None = None
    successors: tuple[Voter, ...] = ()  # named for `from_round`, as the round's last voter (certificate.py)


@dataclass(frozen=True)
class Promised:
    """A promise: nothing below `ballot` is accepted any more; `accepted`/`value` is what was accepted last."""

    ballot: Ballot
    accepted: Ballot
    value: Value | None
    changed: bool  # the state changed and must be stored before the answer leaves


@dataclass(frozen=True)
class Accepted:
    """The (ballot, value) is accepted; the caller signs the grant and stores the state before answering."""

    ballot: Ballot
    value: Value
    changed: bool


RefusalKind = Literal["promised", "retired", "forgotten", "ahead", "conflict", "scope"]


@dataclass(frozen=True)
class Refused:
    """Not granted: `kind` says why (`promised` carries the higher ballot promised)."""

    kind: RefusalKind
    reason: str
    promised: Ballot = ZERO_BALLOT


@dataclass
class AcceptorState:
    """One voter's votes in one scope (see the module docstring)."""

    scope: str
    incarnation: int
    floor: int = 0
    rounds: dict[int, RoundVote] = field(default_factory=dict)  # the current incarnation's
    # round -> (incarnation, votes) of retired ones
    past: dict[int, tuple[int, RoundVote]] = field(default_factory=dict)
    retirements: list[VoterRetirement] = field(default_factory=list)
    retired_from: int | None = None  # set while the current incarnation is retired and not yet replaced

    # ------------------------------------------------------------------ answers

    def refusal(self, round_index: int, *, horizon: int) -> Refused | None:
        """Why this voter answers nothing in `round_index` (retired, forgotten, ahead), None when it may."""
        if self.retired_from is not None and round_index >= self.retired_from:
            return Refused("retired", f"this voter retired from round {self.retired_from}")
        if round_index < self.floor:
            return Refused("forgotten", f"round {round_index} is forgotten here (this voter is past round "
                                        f"{self.floor - 1})")
        if round_index > horizon:
            return Refused("ahead", f"round {round_index} is ahead of this voter (at round {horizon - 1})")
        return None

    def prepare(self, round_index: int, ballot: Ballot, *, horizon: int) -> Promised | Refused:
        """A proposer asks for a promise of `ballot` in round `round_index`."""
        refused = self.refusal(round_index, horizon=horizon)
        if refused is not None:
            return refused
        vote = self.rounds.get(round_index)
        if vote is None:
            vote = self.rounds[round_index] = RoundVote()
        if ballot < vote.promised:
            return Refused("promised", f"promised {tuple(vote.promised)} in round {round_index}", vote.promised)
        changed = ballot > vote.promised
        vote.promised = ballot
        return Promised(ballot, vote.accepted, vote.value, changed)

    def accept(self, round_index: int, ballot: Ballot, value: Value, *, horizon: int) -> Accepted | Refused:
        """A proposer asks this voter to accept `value` in `ballot` of round `round_index`."""
        if value.round != round_index or value.scope != self.scope:
            return Refused("scope", f"a value of {value.scope!r} round {value.round} offered for "
                                    f"{self.scope!r} round {round_index}")
        refused = self.refusal(round_index, horizon=horizon)
        if refused is not None:
            return refused
        vote = self.rounds.get(round_index)
        if vote is None:
            vote = self.rounds[round_index] = RoundVote()
        if ballot < vote.promised:
            return Refused("promised", f"promised {tuple(vote.promised)} in round {round_index}", vote.promised)
        if vote.accepted == ballot and vote.value is not None:
            if vote.value.value_id != value.value_id:
                return Refused("conflict", f"ballot {tuple(ballot)} already carries another value here")
            return Accepted(ballot, value, changed=False)
        vote.promised = vote.accepted = ballot
        vote.value, vote.signature = value, b""
        return Accepted(ballot, value, changed=True)

    def sign_accepted(self, round_index: int, signature: bytes) -> None:
        """Record the signature of the grant just accepted in `round_index` (before the state is stored)."""
        self.rounds[round_index].signature = signature

    def accepted_in(self, round_index: int) -> tuple[int, RoundVote] | None:
        """(incarnation, votes) of the newest incarnation that accepted a value in `round_index`, if any."""
        vote = self.rounds.get(round_index)
        if vote is not None and vote.value is not None:
            return self.incarnation, vote
        past = self.past.get(round_index)
        if past is not None and past[1].value is not None:
            return past
        return None

    # ------------------------------------------------------------------ lifecycle

    def granted_rounds(self) -> list[int]:
        return sorted(r for r, v in self.rounds.items() if v.promised != ZERO_BALLOT)

    def retire(self, *, current_round: int) -> int:
        """End the current incarnation: it grants nothing from the returned round on. Sign it
        (`sign_retirement`) and store it; the next start (`reincarnate`) votes as the next incarnation.

        The round is the newest it promised or accepted anything in, at least `current_round`. Its vote there
        is final: the promise is named (`retired_promise`) and so is what it accepted (`retired_accepted`), so
        that the ballots above the promise count their quorum without it and carry what it accepted as if it
        had reported it in a promise (Paxos' phase 1 with its frozen answer)."""
        if self.retired_from is not None:
            return self.retired_from
        voted = [r for r, v in self.rounds.items() if v.value is not None or v.promised != ZERO_BALLOT]
        self.retired_from = max(current_round, max(voted, default=0))
        return self.retired_from

    def retired_promise(self) -> Ballot | None:
        """What the retired incarnation had promised in the round it retired from (None: nothing)."""
        assert self.retired_from is not None, "retired_promise() before retire()"
        vote = self.rounds.get(self.retired_from)
        return vote.promised if vote is not None and vote.promised != ZERO_BALLOT else None

    def retired_accepted(self) -> tuple[Ballot, Value] | None:
        """What the retired incarnation had accepted in the round it retired from (None: nothing)."""
        assert self.retired_from is not None, "retired_accepted() before retire()"
        vote = self.rounds.get(self.retired_from)
        return None if vote is None or vote.value is None else (vote.accepted, vote.value)

    def sign_retirement(self, signature: bytes, successors: tuple[Voter, ...] = ()) -> VoterRetirement:
        assert self.retired_from is not None, "sign_retirement() before retire()"
        accepted, value = self.retired_accepted() or (None, None)
        retirement = VoterRetirement(self.incarnation, self.retired_from, signature, self.retired_promise(),
                                     accepted, value, successors)
        self.retirements = [*self.retirements[-3:], retirement]
        return retirement

    def reincarnate(self) -> None:
        """The next incarnation: no votes of its own; the values the retired one accepted are kept for learners
        (a round where it only promised keeps an older incarnation's accepted value, if any)."""
        for r, vote in self.rounds.items():
            if vote.value is not None:
                self.past[r] = (self.incarnation, vote)
        self.rounds, self.retired_from = {}, None
        self.incarnation += 1

    def forget_before(self, round_index: int) -> bool:
        """Refuse rounds below `round_index` from now on and drop their votes; whether anything changed."""
        if round_index <= self.floor:
            return False
        self.floor = round_index
        self.rounds = {r: v for r, v in self.rounds.items() if r >= round_index}
        self.past = {r: v for r, v in self.past.items() if r >= round_index}
        return True

    # ------------------------------------------------------------------ storage

    def to_json(self) -> dict[str, Any]:
        return {"scope": self.scope, "incarnation": self.incarnation, "floor": self.floor,
                "retired_from": self.retired_from,
                "rounds": {str(r): v.to_json() for r, v in sorted(self.rounds.items())},
                "past": {str(r): [inc, v.to_json()] for r, (inc, v) in sorted(self.past.items())},
                "retirements": [[x.incarnation, x.from_round, x.signature.hex(),
                                 None if x.promised is None else x.promised.to_json(),
                                 None if x.accepted is None else x.accepted.to_json(),
                                 None if x.value is None else x.value.to_json(),
                                 *([voters_to_json(x.successors)] if x.successors else [])]
                                for x in self.retirements]}

    @classmethod
    def from_json(cls, raw: Any) -> AcceptorState:
        """Raise BallotError naming what is malformed (a voter must not vote from a store it cannot read)."""
        if not isinstance(raw, dict):
            raise BallotError("voter state: expected an object")
        scope, retired_from = raw.get("scope"), raw.get("retired_from")
        if not isinstance(scope, str):
            raise BallotError("voter state.scope: expected a string")
        incarnation, floor = _count(raw, "incarnation"), _count(raw, "floor")
        if retired_from is not None and (not isinstance(retired_from, int) or isinstance(retired_from, bool)
                                         or retired_from < 0):
            raise BallotError("voter state.retired_from: malformed")
        rounds, past = raw.get("rounds", {}), raw.get("past", {})
        if not isinstance(rounds, dict) or not isinstance(past, dict) or len(rounds) + len(past) > 2 * MAX_ROUNDS_KEPT:
            raise BallotError("voter state: malformed or oversized rounds")
        for r, v in past.items():
            if not isinstance(v, list) or len(v) != 2 or not isinstance(v[0], int) or isinstance(v[0], bool):
                raise BallotError(f"voter state.past[{r!r:.20}]: expected [incarnation, votes]")
        try:
            parsed_rounds = {int(r): RoundVote.from_json(v) for r, v in rounds.items()}
            parsed_past = {int(r): (v[0], RoundVote.from_json(v[1])) for r, v in past.items()}
            retirements = [_retirement_from_json(x) for x in raw.get("retirements", [])]
        except (TypeError, ValueError, IndexError, KeyError, AttributeError) as e:
            if isinstance(e, BallotError):
                raise
            raise BallotError(f"voter state: {type(e).__name__}: {e}") from None
        return cls(scope, incarnation, floor, parsed_rounds, parsed_past, retirements, retired_from)


def _count(raw: dict[str, Any], name: str) -> int:
    v = raw.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise BallotError(f"voter state.{name}: expected an int >= 0, got {v!r:.40}")
    return v


def _retirement_from_json(raw: Any) -> VoterRetirement:
    """[incarnation, from_round, signature, promised, accepted, value, successors] (a book written before
    retirements named what they accepted has the first four; successors are there only when named)."""
    if not isinstance(raw, list) or len(raw) not in (4, 6, 7):
        raise BallotError(f"voter state.retirements: malformed {raw!r:.60}")
    i, f, sig, p = raw[:4]
    a, v = raw[4:6] if len(raw) >= 6 else (None, None)
    if (a is None) != (v is None):
        raise BallotError("voter state.retirements: an accepted ballot without its value, or the reverse")
    successors = voters_from_json(raw[6], what="voter state.retirements.successors") if len(raw) == 7 else ()
    return VoterRetirement(int(i), int(f), bytes.fromhex(sig), None if p is None else Ballot.from_json(p),
                           None if a is None else Ballot.from_json(a), None if v is None else Value.from_json(v),
                           successors)

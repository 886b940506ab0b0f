"""The vocabulary of a round's decision: voters, ballots, the value a round chooses, the quorum rule and the
statements voters sign. Pure: no I/O, no clock, no cryptography (signatures are checked by a function the
caller passes in, round/certificate.py).

One round of one scope (the whole model, or one part of a pipelined model) is one single-decree Paxos
instance (docs/protocol.md#the-rounds-decision):

* **Voters** V(r) are fixed by the value chosen in round r − 1 (its `next_voters`: the contributors of that
  round less the client-mode peers, each with its incarnation), or for the first round of a scope by the
  coordinator's genesis. A voter is a (peer id, incarnation) pair: a peer that leaves gracefully retires
  its incarnation for good and comes back as the next one.
* **Ballots** are totally ordered. A session's members all propose the session's own value under the one
  ballot `session_ballot(attempt, retry, session)`; a proposer that must carry another value forward does
  it under a ballot of its own (`carrying_ballot`), so that one ballot never names two values.
* A **value** names one session's mean without holding it: the session, the state digest its members
  averaged from (`base`), the contributors, the next voter set, the digest of every shard of the mean (the
  *material*) and the digest of the state the outer step leads to (`result`). Whoever holds the state
  `base` and the material applies the same outer step and reaches `result`; a certificate of round r thus
  vouches for the state of round r + 1, which is what lets a peer behind check a state it downloads.
* The **quorum** of round r among voters V with retired voters R is any set of more than half of V ∖ R.
  Retired voters never grant anything in the rounds they retired from, so every two quorums of one round
  intersect whichever retirements each proposer knows of.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "ZERO_BALLOT", "Ballot", "BallotError", "Genesis", "MaterialLayout", "ShardDigest", "Value", "Voter",
    "carrying_ballot", "grant_statement", "is_quorum", "quorum_base", "quorum_size", "retire_statement",
    "session_ballot", "value_to_propose",
    "voters_from_json", "voters_to_json",
]

MAX_VOTERS = 4096  # a group holds at most this many members (discovery.records.MAX_GROUP_MEMBERS)
MAX_ID_CHARS = 128
MAX_SHARDS = 4096


class BallotError(ValueError):
    """A ballot, voter or value does not parse or breaks a bound; the message names the field."""


class Voter(NamedTuple):
    """One voter: a peer id and the incarnation of its acceptor state (bumped when it retires)."""

    peer_id: str
    incarnation: int

    def __str__(self) -> str:
        return f"{self.peer_id}#{self.incarnation}"


class Ballot(NamedTuple):
    """Ordered as a tuple: a later matchmaking attempt, then a later retry of the all-reduce, then a higher
    bump (a value carried forward), then the session and the proposer (unique ballots)."""

    attempt: int
    retry: int
    bump: int
    session: str
    proposer: str

    def to_json(self) -> list[Any]:
        return list(self)

    @classmethod
    def from_json(cls, raw: Any) -> Ballot:
        if not isinstance(raw, list) or len(raw) != 5:
            raise BallotError(f"ballot: expected a list of 5, got {raw!r:.80}")
        attempt, retry, bump, session, proposer = raw
        for name, v in (("attempt", attempt), ("retry", retry), ("bump", bump)):
            if not isinstance(v, int) or isinstance(v, bool) or not -1 <= v < 1 << 40:
                raise BallotError(f"ballot.{name}: expected an int >= -1, got {v!r:.40}")
        for name, s in (("session", session), ("proposer", proposer)):
            if not isinstance(s, str) or len(s) > MAX_ID_CHARS:
                raise BallotError(f"ballot.{name}: expected a string of at most {MAX_ID_CHARS} chars")
        return cls(attempt, retry, bump, session, proposer)


ZERO_BALLOT = Ballot(-1, -1, -1, "", "")  # below every real ballot: "none promised", "none accepted"


def session_ballot(attempt: int, retry: int, session: str) -> Ballot:
    """The ballot every member of a session proposes the session's own value under."""
    if attempt < 0 or retry < 0 or not session:
        raise BallotError(f"session ballot: attempt {attempt}, retry {retry}, session {session!r}")
    return Ballot(attempt, retry, 0, session, "")


def carrying_ballot(above: Ballot, *, session: str, proposer: str) -> Ballot:
    """A ballot of `proposer`'s own, higher than `above` (the highest promise it saw), for carrying a value
    another session may have had chosen forward."""
    if not proposer:
        raise BallotError("carrying ballot: a proposer id is needed")
    return Ballot(max(above.attempt, 0), max(above.retry, 0), above.bump + 1, session, proposer)


# ---------------------------------------------------------------------------------------------- voters

def voters_to_json(voters: Iterable[Voter]) -> list[list[Any]]:
    return [[v.peer_id, v.incarnation] for v in voters]


def voters_from_json(raw: Any, *, what: str = "voters") -> tuple[Voter, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_VOTERS:
        raise BallotError(f"{what}: expected a list of at most {MAX_VOTERS} voters")
    out: list[Voter] = []
    for item in raw:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                or not 0 < len(item[0]) <= MAX_ID_CHARS or not isinstance(item[1], int) or isinstance(item[1], bool)
                or not 0 <= item[1] < 1 << 63):
            raise BallotError(f"{what}: malformed voter {item!r:.80}")
        out.append(Voter(item[0], item[1]))
    if len({v.peer_id for v in out}) != len(out):
        raise BallotError(f"{what}: a peer is listed twice")
    return tuple(out)


def quorum_base(voters: Iterable[Voter], retired: Iterable[Voter] = ()) -> frozenset[Voter]:
    """The voters a quorum is counted among: V less the retired ones."""
    return frozenset(voters) - frozenset(retired)


def quorum_size(voters: Iterable[Voter], retired: Iterable[Voter] = ()) -> int:
    """How many grants a quorum needs (more than half of V ∖ R); 0 when nobody is left to vote."""
    base = quorum_base(voters, retired)
    return len(base) // 2 + 1 if base else 0


def is_quorum(granted: Iterable[Voter], voters: Iterable[Voter], retired: Iterable[Voter] = ()) -> bool:
    """Whether `granted` holds more than half of V ∖ R (never true when every voter retired)."""
    base = quorum_base(voters, retired)
    return bool(base) and 2 * len(frozenset(granted) & base) > len(base)


# ---------------------------------------------------------------------------------------------- values

@dataclass(frozen=True)
class ShardDigest:
    """One shard of a round's mean: values [lo, hi), `size_bytes` encoded bytes hashing to `digest`."""

    lo: int
    hi: int
    size_bytes: int
    digest: str


@dataclass(frozen=True)
class MaterialLayout:
    """How a value's material decodes: `numel` values in `shards`, each encoded by `codec`; with `gather`
    a shard's blob holds every contribution (a bundle, averaged by whoever applies it), else its mean."""

    numel: int
    codec: str
    gather: bool
    shards: tuple[ShardDigest, ...]

    def __post_init__(self) -> None:
        at = 0
        for s in self.shards:
            if s.lo != at or s.hi < s.lo or s.size_bytes < 0:
                raise BallotError(f"material layout: shard [{s.lo}, {s.hi}) does not follow value {at}")
            at = s.hi
        if at != self.numel or not 0 < len(self.shards) <= MAX_SHARDS:
            raise BallotError(f"material layout: {len(self.shards)} shards cover {at} of {self.numel} values")

    @property
    def size_bytes(self) -> int:
        return sum(s.size_bytes for s in self.shards)

    @functools.cached_property
    def key(self) -> str:
        """One key for the layout's material (the digest of its shard digests), taken once per layout: a round's
        store and voters look material up by it, and the layout names every shard."""
        h = hashlib.sha256(f"{self.numel}|{self.codec}|{int(self.gather)}|".encode())
        for s in self.shards:
            h.update(f"{s.lo}|{s.hi}|{s.size_bytes}|{s.digest};".encode())
        return h.hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {"numel": self.numel, "codec": self.codec, "gather": self.gather,
                "shards": [[s.lo, s.hi, s.size_bytes, s.digest] for s in self.shards]}

    @classmethod
    def from_json(cls, raw: Any) -> MaterialLayout:
        try:
            rows = raw["shards"]
            if not isinstance(rows, list) or len(rows) > MAX_SHARDS:
                raise BallotError(f"material layout: expected a list of at most {MAX_SHARDS} shards")
            shards = []
            for row in rows:
                if not isinstance(row, list) or len(row) != 4 or not all(_is_count(x) for x in row[:3]) \
                        or not isinstance(row[3], str) or not _is_hex(row[3], 64):
                    raise BallotError(f"material layout: malformed shard {row!r:.80}")
                shards.append(ShardDigest(*row))
            numel, codec, gather = raw["numel"], raw["codec"], raw["gather"]
            if not _is_count(numel) or not isinstance(codec, str) or not isinstance(gather, bool):
                raise BallotError("material layout: malformed numel, codec or gather")
            return cls(numel, codec, gather, tuple(shards))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, BallotError):
                raise
            raise BallotError(f"material layout: {type(e).__name__}: {e}") from None


@dataclass(frozen=True)
class Value:
    """What round `round` of `scope` may choose: session `session`'s mean (see the module docstring)."""

    scope: str
    round: int
    session: str
    base: str  # digest of the committed state the session's members averaged from
    contributors: tuple[str, ...]
    next_voters: tuple[Voter, ...]
    layout: MaterialLayout
    result: str  # digest of the committed state of round + 1 (the outer step applied to `base`)

    def to_json(self) -> dict[str, Any]:
        return {"scope": self.scope, "round": self.round, "session": self.session, "base": self.base,
                "contributors": list(self.contributors), "next_voters": voters_to_json(self.next_voters),
                "layout": self.layout.to_json(), "result": self.result}

    @classmethod
    def from_json(cls, raw: Any) -> Value:
        if not isinstance(raw, Mapping):
            raise BallotError("value: expected an object")
        try:
            scope, round_, session, base = raw["scope"], raw["round"], raw["session"], raw["base"]
            contributors = raw["contributors"]
        except KeyError as e:
            raise BallotError(f"value: missing {e}") from None
        if not isinstance(scope, str) or len(scope) > MAX_ID_CHARS:
            raise BallotError("value.scope: malformed")
        if not isinstance(round_, int) or isinstance(round_, bool) or round_ < 0:
            raise BallotError(f"value.round: expected an int >= 0, got {round_!r:.40}")
        if not isinstance(session, str) or not 0 < len(session) <= MAX_ID_CHARS:
            raise BallotError("value.session: malformed")
        if not isinstance(base, str) or not _is_hex(base, 64, empty=True):
            raise BallotError("value.base: expected a hex digest")
        result = raw.get("result")
        if not isinstance(result, str) or not _is_hex(result, 64):
            raise BallotError("value.result: expected a hex digest")
        if (not isinstance(contributors, list) or len(contributors) > MAX_VOTERS
                or not all(isinstance(c, str) and 0 < len(c) <= MAX_ID_CHARS for c in contributors)):
            raise BallotError("value.contributors: malformed")
        next_voters = voters_from_json(raw.get("next_voters"), what="value.next_voters")
        strangers = {v.peer_id for v in next_voters} - set(contributors)
        if strangers:  # a round's voters are drawn from the contributors of the commit that names them
            raise BallotError(f"value.next_voters: {sorted(strangers)[:3]} contributed nothing to the value")
        return cls(scope, round_, session, base, tuple(contributors), next_voters,
                   MaterialLayout.from_json(raw.get("layout")), result)

    def canonical(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    @functools.cached_property
    def value_id(self) -> str:
        """The value's identity: a sha256 of its canonical JSON (what voters sign). Taken once per value: the
        value is frozen, and a round's voters look it up for every ask and grant, its JSON growing with the
        contributors and shards it names."""
        return hashlib.sha256(b"swarmtrain/value\0" + self.canonical()).hexdigest()


def _is_count(x: Any) -> bool:
    """An int >= 0 (JSON's true is no count)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


_LOWER_HEX = re.compile("[0-9a-f]*")


def _is_hex(s: str, n: int, *, empty: bool = False) -> bool:
    if empty and s == "":
        return True
    return len(s) == n and _LOWER_HEX.fullmatch(s) is not None


# ---------------------------------------------------------------------------------------------- statements

def _statement(kind: str, fields: Sequence[Any]) -> bytes:
    return f"swarmtrain/{kind}\0".encode() + json.dumps(list(fields), separators=(",", ":")).encode()


def grant_statement(*, run: str, scope: str, round_index: int, ballot: Ballot, value_id: str, voter: Voter) -> bytes:
    """What a voter signs when it accepts `value_id` in `ballot` of round `round_index` (run = id/nonce)."""
    return _statement("grant", [run, scope, round_index, ballot.to_json(), value_id, voter.peer_id,
                                voter.incarnation])


def retire_statement(*, run: str, scope: str, voter: Voter, from_round: int, promised: Ballot | None = None,
                     accepted: Ballot | None = None, value_id: str = "", successors: Sequence[Voter] = ()) -> bytes:
    """What a voter signs when it retires its incarnation: it grants nothing more in rounds >= `from_round`; in
    round `from_round` it had promised nothing above `promised` (None: nothing at all) and had accepted
    `value_id` in ballot `accepted` last (None, "": nothing); `successors`: the voters it names for round
    `from_round` should every voter of the round have retired having accepted nothing there
    (certificate.py `successors_of`)."""
    fields = [run, scope, voter.peer_id, voter.incarnation, from_round,
              None if promised is None else promised.to_json(), None if accepted is None else accepted.to_json(),
              value_id]
    return _statement("retire", [*fields, voters_to_json(successors)] if successors else fields)


def value_to_propose(reports: Iterable[tuple[Ballot, Value | None]], own: Value) -> Value:
    """Paxos' rule: the value of the highest ballot a promising quorum reports accepted, else `own`."""
    best: tuple[Ballot, Value] | None = None
    for ballot, value in reports:
        if value is not None and (best is None or ballot > best[0]):
            best = (ballot, value)
    return own if best is None else best[1]


@dataclass(frozen=True)
class Genesis:
    """A scope's voters where no commit fixes them: round `round`'s voters, as the coordinator chose them once
    (round 0; or a round all of whose voters retired)."""

    round: int
    voters: tuple[Voter, ...]

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "voters": voters_to_json(self.voters)}

    @classmethod
    def from_json(cls, raw: Any) -> Genesis:
        if not isinstance(raw, Mapping) or not _is_count(raw.get("round")):
            raise BallotError("genesis: expected {round, voters}")
        return cls(raw["round"], voters_from_json(raw.get("voters"), what="genesis.voters"))

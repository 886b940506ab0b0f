"""The messages of a round's decision and the transport that carries them (gRPC in rpc/consensus_wire.py, a
simulated network in testing/), shared by the voter (voting.py) and the proposer (deciding.py).

Calls, all small but `material`: `prepare` (phase 1: promise a ballot, report what was accepted), `accept`
(phase 2: accept a (ballot, value), answered with the voter's signed grant), `learn` (what a peer knows of a
round: a certificate, or its own accepted (ballot, value) and grant), `material` (one shard's blob of a
value the peer holds) and `certificates` (the newest rounds' certificates it keeps, for a peer behind).
Every reply names the voter (peer id and incarnation) that gave it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from swarmtrain.round.ballots import ZERO_BALLOT, Ballot, MaterialLayout, Value, Voter
from swarmtrain.round.certificate import Certificate, Retirement, SignedGrant

__all__ = ["AcceptReply", "ConsensusTransport", "Contact", "LearnReply", "PrepareReply", "VoterSink"]


@dataclass(frozen=True)
class Contact:
    """Where to reach a peer's data plane."""

    peer_id: str
    endpoint: str


@dataclass(frozen=True)
class PrepareReply:
    voter: Voter
    granted: bool
    promised: Ballot = ZERO_BALLOT  # refused: the higher ballot promised
    accepted: Ballot = ZERO_BALLOT  # granted: what it accepted last in the round
    value: Value | None = None
    holds_material: bool = False  # it holds the material of `value`
    refusal: str = ""  # the kind (round/acceptor.py `RefusalKind`), "" when granted
    reason: str = ""
    retirement: Retirement | None = None  # refused as retired: its signed retirement


@dataclass(frozen=True)
class AcceptReply:
    voter: Voter
    granted: bool
    grant: SignedGrant | None = None
    promised: Ballot = ZERO_BALLOT
    refusal: str = ""
    reason: str = ""
    retirement: Retirement | None = None


@dataclass(frozen=True)
class LearnReply:
    """What a peer knows of a round: a certificate it holds, and (as a voter) what it accepted there."""

    certificate: Certificate | None = None
    voter: Voter | None = None
    accepted: Ballot = ZERO_BALLOT
    value: Value | None = None
    grant: SignedGrant | None = None
    holds_material: bool = False


class ConsensusTransport(Protocol):
    """The caller's side; every call raises the rpc layer's errors (unreachable, deadline, refused)."""

    async def prepare(self, to: Contact, *, scope: str, round_index: int, ballot: Ballot,
                      timeout_s: float) -> PrepareReply: ...

    async def accept(self, to: Contact, *, scope: str, round_index: int, ballot: Ballot, value: Value,
                     holders: Sequence[Contact], timeout_s: float) -> AcceptReply: ...

    async def learn(self, to: Contact, *, scope: str, round_index: int, timeout_s: float) -> LearnReply: ...

    async def material(self, to: Contact, *, scope: str, layout: MaterialLayout, shard: int,
                       timeout_s: float) -> bytes | bytearray | memoryview: ...

    async def certificates(self, to: Contact, *, scope: str, from_round: int,
                           timeout_s: float) -> tuple[Certificate, ...]:
        """The certificates `to` keeps of rounds >= `from_round`, oldest first."""
        ...


class VoterSink(Protocol):
    """The served side (voting.py); `caller` is the authenticated caller's peer id. Raise `Rejected` to refuse
    a malformed or out-of-bounds request."""

    async def prepare(self, *, scope: str, round_index: int, ballot: Ballot, caller: str) -> PrepareReply: ...

    async def accept(self, *, scope: str, round_index: int, ballot: Ballot, value: Value,
                     holders: Sequence[Contact], caller: str, deadline_s: float) -> AcceptReply: ...

    async def learn(self, *, scope: str, round_index: int, caller: str) -> LearnReply: ...

    async def material(self, *, scope: str, layout: MaterialLayout, shard: int,
                       caller: str) -> bytes | bytearray | memoryview: ...

    async def certificates_from(self, *, scope: str, from_round: int, caller: str) -> tuple[Certificate, ...]: ...

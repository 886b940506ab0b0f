"""The round decision's rules before it was consensus, as a voter the simulator can run in place of the real
one: a test of the tester (it must find the wedge those rules had).

The rules: a voter gives its one vote of a round to the first session that asks (`prepare`), records it on
disk and never releases it; it grants that session's value whatever it holds (no material needed); it tells
nobody what it voted for or what was chosen (no learning, no certificates served), so a peer whose session
lost can only heal from a state that two peers ahead announce; and a voter that leaves after voting in its
round (an attempt that aborted) leaves from the next round, counted in this one. A schedule in which one
member commits with the votes of peers whose own all-reduce then fails leaves those peers unable to commit
or heal; one in which half the voters leave after an aborted attempt leaves the rest unable to commit.
Nor did a reducer have stand-ins then (averaging/standin.py): `without_stand_ins` wraps a member's transport so
that nobody but a shard's own reducer serves it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from swarmtrain.averaging.transport import Fetched, Payload, ReduceTransport
from swarmtrain.averaging.voting import VoterService
from swarmtrain.round.ballots import Ballot, Value, Voter, grant_statement
from swarmtrain.round.certificate import Certificate, Retirement, SignedGrant
from swarmtrain.round.group import Member
from swarmtrain.round.messages import AcceptReply, Contact, LearnReply, PrepareReply
from swarmtrain.rpc.averaging_wire import PushHeader, SessionKey
from swarmtrain.rpc.errors import RpcRejected

__all__ = ["LegacyVoter", "without_stand_ins"]


class without_stand_ins:
    """A member's all-reduce transport as it was before stand-ins: only a shard's own reducer serves it."""

    def __init__(self, inner: ReduceTransport) -> None:
        self.inner = inner

    async def push(self, reducer: Member, header: PushHeader, payload: Payload, *, deadline: float) -> None:
        await self.inner.push(reducer, header, payload, deadline=deadline)

    async def contributors(self, reducer: Member, key: SessionKey, shard: int, *,
                           deadline: float) -> tuple[str, ...]:
        return await self.inner.contributors(reducer, key, shard, deadline=deadline)

    async def fetch(self, reducer: Member, key: SessionKey, shard: int, contributors: tuple[str, ...], *,
                    max_bytes: int, deadline: float) -> Fetched:
        if not contributors or key.reducers[shard] != reducer.peer_id:
            raise RpcRejected("FAILED_PRECONDITION", "no stand-ins by the legacy rules")
        return await self.inner.fetch(reducer, key, shard, contributors, max_bytes=max_bytes, deadline=deadline)


class LegacyVoter(VoterService):
    """A VoterService that votes by the legacy rules (see the module docstring); its votes in `path`."""

    def __init__(self, *, path: Path, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.path = path
        self.votes: dict[int, str] = {}  # round -> the session it voted for
        if path.is_file():
            self.votes = {int(r): s for r, s in json.loads(path.read_text()).items()}

    def _vote(self, round_index: int, session: str) -> bool:
        """Give the round's vote to `session` if it is still free; whether `session` holds it."""
        if round_index not in self.votes:
            self.votes[round_index] = session
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.votes))
        return self.votes[round_index] == session

    async def prepare(self, *, scope: str, round_index: int, ballot: Ballot, caller: str) -> PrepareReply:
        self._check_scope(scope)
        if not self._vote(round_index, ballot.session):
            return PrepareReply(self.voter, False, refusal="promised",
                                reason=f"voted for session {self.votes[round_index][:12]} in round {round_index}")
        return PrepareReply(self.voter, True, promised=ballot)

    async def accept(self, *, scope: str, round_index: int, ballot: Ballot, value: Value,
                     holders: Sequence[Contact], caller: str, deadline_s: float) -> AcceptReply:
        self._check_scope(scope)
        if not self._vote(round_index, value.session):
            return AcceptReply(self.voter, False, refusal="promised",
                               reason=f"voted for session {self.votes[round_index][:12]} in round {round_index}")
        message = grant_statement(run=self.run, scope=self.scope, round_index=round_index, ballot=ballot,
                                  value_id=value.value_id, voter=self.voter)
        return AcceptReply(self.voter, True, grant=SignedGrant(self.voter, self.identity.public_key,
                                                               self.identity.sign(message)))

    async def retire(self, *, current_round: int, successors: Sequence[Voter] = ()) -> Retirement:
        if current_round in self.votes:  # it voted in its round: it leaves from the next one
            current_round += 1
        return await super().retire(current_round=current_round)  # the legacy rules named no successors

    async def learn(self, *, scope: str, round_index: int, caller: str) -> LearnReply:
        self._check_scope(scope)
        return LearnReply()

    async def certificates_from(self, *, scope: str, from_round: int, caller: str) -> tuple[Certificate, ...]:
        self._check_scope(scope)
        return ()

"""The proposer's and the learner's side of a round's decision (single-decree Paxos among the round's voters).

A member whose session holds every mean proposes the session's value: phase 1 (`prepare`, started as soon
as the session is known, while the means are still coming) asks the voters to promise the session's ballot
and report what they accepted; with promises from a quorum, phase 2 (`propose`) asks every voter to accept
the value the promises impose (Paxos' rule: the value of the highest ballot reported, else its own), and a
quorum of signed grants is the round's certificate. A value other than its own is carried forward under a
ballot of the proposer's own, higher than any promise seen, once its material is fetched from a holder: one
ballot never names two values, so no two quorums of one round can choose two.

A member that could not propose (a mean missing, a quorum refused) *learns* instead: it asks the round's
voters and the peers ahead what they know, and a certificate (shown, or assembled from a quorum of grants of
one (ballot, value)) tells it the round's value, which it applies once it holds the material.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from swarmtrain.averaging.fetching import MaterialFetcher
from swarmtrain.averaging.material import Material, MaterialError, MaterialStore
from swarmtrain.round.ballots import (
    ZERO_BALLOT,
    Ballot,
    Value,
    Voter,
    carrying_ballot,
    grant_statement,
    is_quorum,
    quorum_base,
    value_to_propose,
)
from swarmtrain.round.certificate import (
    Certificate,
    CertificateError,
    Retirement,
    SignedGrant,
    Verify,
    check_certificate,
    check_retirement,
    counting,
    nothing_chosen_below,
    retired_reports,
)
from swarmtrain.round.messages import AcceptReply, ConsensusTransport, Contact, LearnReply, PrepareReply
from swarmtrain.rpc.errors import RpcError

__all__ = ["Chosen", "Decider", "Known", "NotChosen", "Outcome", "Prepared"]

log = logging.getLogger(__name__)

MAX_CARRIES = 3  # higher ballots tried to carry another value forward before giving up the attempt
T = TypeVar("T")


@dataclass(frozen=True)
class Chosen:
    """The round chose `certificate.value`, and this peer holds its material."""

    certificate: Certificate
    material: Material


@dataclass(frozen=True)
class Known:
    """The round chose `certificate.value`, but no holder served its material (yet)."""

    certificate: Certificate
    reason: str


@dataclass(frozen=True)
class NotChosen:
    """Nothing this peer can see was chosen (yet): the round is open."""

    reason: str


Outcome = Chosen | Known | NotChosen


@dataclass
class Prepared:
    """Phase 1 of one ballot: every voter's answer (or none), and the retirements learned on the way."""

    ballot: Ballot
    replies: dict[Voter, PrepareReply] = field(default_factory=dict)
    retired: dict[Voter, Retirement] = field(default_factory=dict)
    unanswered: list[str] = field(default_factory=list)

    def promised_by(self) -> set[Voter]:
        return {v for v, r in self.replies.items() if r.granted}

    def highest_promise(self) -> Ballot:
        return max((r.promised for r in self.replies.values()), default=self.ballot)


class Decider:
    """A peer's proposer and learner in one scope (see the module docstring)."""

    def __init__(self, *, transport: ConsensusTransport, run: str, scope: str, me: Contact, verify: Verify,
                 materials: MaterialStore, fetcher: MaterialFetcher) -> None:
        self.transport = transport
        self.run = run
        self.scope = scope
        self.me = me
        self.verify = verify
        self.materials = materials
        self.fetcher = fetcher

    # ------------------------------------------------------------------ phase 1

    async def prepare(self, *, round_index: int, ballot: Ballot, voters: Sequence[Voter],
                      contacts: Mapping[str, Contact], retired: Mapping[Voter, Retirement],
                      timeout_s: float) -> Prepared:
        prepared = Prepared(ballot, retired=dict(retired))
        targets = [v for v in voters if v not in counting(prepared.retired, round_index, ballot)]

        async def ask(v: Voter) -> PrepareReply:
            return await self.transport.prepare(contacts[v.peer_id], scope=self.scope, round_index=round_index,
                                                ballot=ballot, timeout_s=timeout_s)

        def enough(done: list[tuple[Voter, object]]) -> bool:
            promised = {v for v, r in done if isinstance(r, PrepareReply) and r.granted and r.voter == v}
            return is_quorum(promised, voters, counting(prepared.retired, round_index, ballot))

        for v, reply in await _each(targets, contacts, ask, timeout_s, enough=enough):
            if isinstance(reply, BaseException):
                prepared.unanswered.append(f"{v}: {type(reply).__name__}: {reply}"[:200])
            elif reply.voter != v:
                prepared.unanswered.append(f"{v}: answered as {reply.voter}")
            else:
                self._note_retirement(prepared.retired, v, reply.retirement, round_index)
                if v not in prepared.retired:
                    prepared.replies[v] = reply
        return prepared

    def _note_retirement(self, retired: dict[Voter, Retirement], v: Voter, r: Retirement | None,
                         round_index: int) -> None:
        if r is None or r.voter != v or r.from_round > round_index:
            return
        try:
            check_retirement(r, run=self.run, scope=self.scope, verify=self.verify)
        except CertificateError as e:
            log.warning("round %d: %s", round_index, e)
            return
        retired[v] = r

    # ------------------------------------------------------------------ phase 2

    async def propose(self, prepared: Prepared, *, value: Value, voters: Sequence[Voter],
                      contacts: Mapping[str, Contact], timeout_s: float) -> Outcome:
        """Phase 2 after `prepared` (of the session's ballot); carries another value forward when Paxos
        says so. `value`'s material must be in the store."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        r = value.round
        for tries_left in range(MAX_CARRIES, -1, -1):
            promised = prepared.promised_by()
            counted = counting(prepared.retired, r, prepared.ballot)
            if not is_quorum(promised, voters, counted):
                outbid = prepared.highest_promise()
                if tries_left and outbid > prepared.ballot:
                    prepared = await self._outbid(prepared, outbid, r, voters=voters, contacts=contacts,
                                                  timeout_s=max(0.0, deadline - loop.time()))
                    continue
                return NotChosen(_short(f"only {len(promised)} of {len(quorum_base(voters, counted))} "
                                        f"voters promised ballot {tuple(prepared.ballot)[:3]}", prepared.unanswered))
            grants = [prepared.replies[v] for v in promised]
            # The voters counted without report through their retirements what they had accepted (frozen).
            frozen = retired_reports(prepared.retired, r, prepared.ballot)
            chosen = value_to_propose([*((g.accepted, g.value) for g in grants), *frozen], own=value)
            if chosen.value_id != value.value_id:
                # Another session's value may have been chosen: this proposer carries it (fetching its material
                # from the voters that hold it, else its session's members), under a ballot of its own: the
                # session's names only its value.
                if not self.materials.holds(chosen.layout):
                    holders = [contacts[g.voter.peer_id] for g in grants if g.value is not None
                               and g.value.value_id == chosen.value_id and g.holds_material
                               and g.voter.peer_id in contacts]
                    holders += [contacts[c] for c in chosen.contributors
                                if c in contacts and c != self.me.peer_id and contacts[c] not in holders]
                    try:
                        await self.fetcher.complete(r, chosen.layout, holders,
                                                    timeout_s=max(0.0, deadline - loop.time()))
                    except MaterialError as e:
                        if not self._unchosen(prepared, voters, r):
                            return NotChosen(f"a value of session {chosen.session[:12]} may be chosen in round {r}, "
                                             f"and its material is not to be had: {e}")
                        # What every voter accepted is known and no ballot had a quorum: the reported value was
                        # never chosen, so this session's own may be.
                        log.info("round %d: session %s's value was accepted by too few voters to be chosen; "
                                 "proposing this session's", r, chosen.session[:12])
                        chosen = value
                if chosen is not value and prepared.ballot.proposer != self.me.peer_id:
                    ballot = carrying_ballot(prepared.highest_promise(), session=value.session,
                                             proposer=self.me.peer_id)
                    log.info("round %d: carrying session %s's value forward in ballot %s", r, chosen.session[:12],
                             tuple(ballot)[:3])
                    prepared = await self.prepare(round_index=r, ballot=ballot, voters=voters, contacts=contacts,
                                                  retired=prepared.retired, timeout_s=max(0.0, deadline - loop.time()))
                    continue
            outcome, outbid = await self._accept(prepared, chosen, voters=voters, contacts=contacts,
                                                 timeout_s=max(0.0, deadline - loop.time()))
            if not (isinstance(outcome, NotChosen) and outbid > prepared.ballot):
                return outcome
            if not tries_left:
                return NotChosen(f"round {r}: outbid again after {MAX_CARRIES} higher ballots; {outcome.reason}")
            prepared = await self._outbid(prepared, outbid, r, voters=voters, contacts=contacts,
                                          timeout_s=max(0.0, deadline - loop.time()))
        return NotChosen(f"round {r}: ballots kept being outbid")

    async def _outbid(self, prepared: Prepared, above: Ballot, r: int, *, voters: Sequence[Voter],
                      contacts: Mapping[str, Contact], timeout_s: float) -> Prepared:
        """Phase 1 again, above `above`: voters promised a higher ballot (another session's, which may never reach
        phase 2: a session that cannot complete its means still asked for promises as it formed) after this one's
        phase 1, or before it. Paxos' answer: a higher ballot. A session's ballot stays the session's (every member
        that was outbid by the same promise asks for the same one; it names the session's value only, and carrying
        another value still takes a ballot of the proposer's own); a proposer's stays its own."""
        mine = prepared.ballot
        ballot = Ballot(above.attempt, above.retry, above.bump + 1, mine.session, mine.proposer)
        log.info("round %d: voters promised ballot %s, above %s: asking again with %s", r, tuple(above)[:4],
                 tuple(mine)[:3], tuple(ballot)[:3])
        return await self.prepare(round_index=r, ballot=ballot, voters=voters, contacts=contacts,
                                  retired=prepared.retired, timeout_s=timeout_s)

    def _unchosen(self, prepared: Prepared, voters: Sequence[Voter], r: int) -> bool:
        """Whether no value of round `r` can have been chosen below `prepared`'s ballot: the promises' reports and
        the retirements' frozen votes (`nothing_chosen_below`)."""
        known = {v: reply.accepted for v, reply in prepared.replies.items() if reply.granted}
        for v, x in counting(prepared.retired, r, prepared.ballot).items():
            if x.from_round == r:
                known[v] = x.accepted if x.accepted is not None else ZERO_BALLOT
        return nothing_chosen_below(prepared.ballot, r, voters, prepared.retired, known)

    async def _accept(self, prepared: Prepared, value: Value, *, voters: Sequence[Voter],
                      contacts: Mapping[str, Contact], timeout_s: float) -> tuple[Outcome, Ballot]:
        """Phase 2, and the highest ballot a refusing voter had promised (`ZERO_BALLOT`: none)."""
        material = self.materials.get(value.layout)
        if material is None or not material.complete:
            return NotChosen("the proposed value's material is not held here"), ZERO_BALLOT
        ballot, retired = prepared.ballot, dict(prepared.retired)
        targets = [v for v in voters if v not in counting(retired, value.round, ballot)]
        holders = [self.me]

        async def ask(v: Voter) -> AcceptReply:
            return await self.transport.accept(contacts[v.peer_id], scope=self.scope, round_index=value.round,
                                               ballot=ballot, value=value, holders=holders, timeout_s=timeout_s)

        grants: dict[Voter, SignedGrant] = {}
        refused: list[str] = []
        outbid = ZERO_BALLOT

        def enough(done: list[tuple[Voter, object]]) -> bool:  # a quorum in: the stragglers are not waited for
            ok = {v for v, r in done if isinstance(r, AcceptReply) and r.granted and r.voter == v}
            return is_quorum(ok, voters, counting(retired, value.round, ballot))

        for v, reply in await _each(targets, contacts, ask, timeout_s, enough=enough):
            if isinstance(reply, BaseException):
                refused.append(f"{v}: {type(reply).__name__}")
                continue
            self._note_retirement(retired, v, reply.retirement, value.round)
            if reply.granted and reply.grant is not None and self._grant_ok(reply.grant, v, ballot, value):
                grants[v] = reply.grant
            elif not reply.granted:
                refused.append(f"{v}: {reply.refusal} ({reply.reason[:80]})")
                if reply.refusal == "promised":
                    outbid = max(outbid, reply.promised)
        counted = counting(retired, value.round, ballot)
        grants = {v: g for v, g in grants.items() if v not in counted}
        if not is_quorum(grants, voters, counted):
            return NotChosen(_short(f"only {len(grants)} of {len(quorum_base(voters, counted))} voters accepted",
                                    refused)), outbid
        cert = Certificate(self.run, ballot, value, tuple(grants[v] for v in sorted(grants)),
                           tuple(counted[v] for v in sorted(counted) if v in set(voters)))
        return Chosen(cert, material), outbid

    def _grant_ok(self, grant: SignedGrant, voter: Voter, ballot: Ballot, value: Value) -> bool:
        if grant.voter != voter:
            return False
        message = grant_statement(run=self.run, scope=self.scope, round_index=value.round, ballot=ballot,
                                  value_id=value.value_id, voter=voter)
        ok = self.verify(voter.peer_id, grant.public_key, message, grant.signature)
        if not ok:
            log.warning("round %d: a grant from %s that does not verify: ignored", value.round, voter)
        return ok

    # ------------------------------------------------------------------ learning

    async def learn(self, *, round_index: int, voters: Sequence[Voter], contacts: Mapping[str, Contact],
                    retired: Mapping[Voter, Retirement], timeout_s: float,
                    others: Sequence[Contact] = ()) -> Outcome:
        """What round `round_index` chose, from its voters and `others` (peers ahead), with the material."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        asked: dict[str, Contact] = {v.peer_id: contacts[v.peer_id] for v in voters if v.peer_id in contacts}
        if any(v.peer_id == self.me.peer_id for v in voters):
            # Its own vote counts towards a quorum of grants like any voter's: a restarted voter whose round
            # was decided by a quorum it belonged to learns it with the others' grants and its own.
            asked.setdefault(self.me.peer_id, self.me)
        asked.update({c.peer_id: c for c in others if c.peer_id != self.me.peer_id})
        replies: list[tuple[Contact, LearnReply]] = []

        async def ask(c: Contact) -> LearnReply:
            return await self.transport.learn(c, scope=self.scope, round_index=round_index, timeout_s=timeout_s)

        results = await asyncio.gather(*(_bounded(ask(c), timeout_s) for c in asked.values()), return_exceptions=True)
        for c, reply in zip(asked.values(), results, strict=True):
            if isinstance(reply, LearnReply):
                replies.append((c, reply))
            elif not isinstance(reply, RpcError | TimeoutError | ValueError):
                raise reply
        cert = self._certificate_of(round_index, voters, retired, replies)
        if cert is None:
            return NotChosen(f"no certificate of round {round_index} among {len(replies)} of {len(asked)} peers asked")
        held = self.materials.get(cert.value.layout)
        if held is not None and held.complete:
            return Chosen(cert, held)
        holders = [c for c, rep in replies if rep.holds_material and (
            (rep.value is not None and rep.value.value_id == cert.value.value_id)
            or (rep.certificate is not None and rep.certificate.value.value_id == cert.value.value_id))]
        holders += [contacts[g.voter.peer_id] for g in cert.grants if g.voter.peer_id in contacts]
        try:
            material = await self.fetcher.complete(round_index, cert.value.layout, _unique(holders),
                                                   timeout_s=max(0.0, deadline - loop.time()))
        except MaterialError as e:
            return Known(cert, f"round {round_index}'s value is known, its material not to be had: {e}")
        return Chosen(cert, material)

    def _certificate_of(self, round_index: int, voters: Sequence[Voter], retired: Mapping[Voter, Retirement],
                        replies: Sequence[tuple[Contact, LearnReply]]) -> Certificate | None:
        for _, rep in replies:  # a certificate someone holds
            if rep.certificate is None:
                continue
            try:
                check_certificate(rep.certificate, run=self.run, voters=voters, verify=self.verify, scope=self.scope,
                                  round_index=round_index)
                return rep.certificate
            except CertificateError as e:
                log.info("round %d: a certificate that does not check out: %s", round_index, e)
        by_choice: dict[tuple[Ballot, str], tuple[Value, dict[Voter, SignedGrant]]] = {}
        voter_set = set(voters)
        for _, rep in replies:  # or one assembled from the voters' own grants
            if rep.voter is None or rep.value is None or rep.grant is None or rep.voter not in voter_set:
                continue
            if rep.value.round != round_index or rep.value.scope != self.scope:
                continue
            if not self._grant_ok(rep.grant, rep.voter, rep.accepted, rep.value):
                continue
            entry = by_choice.setdefault((rep.accepted, rep.value.value_id), (rep.value, {}))
            entry[1][rep.voter] = rep.grant
        for (ballot, _), (value, grants) in by_choice.items():
            counted = counting(retired, round_index, ballot)
            if is_quorum(grants, voters, counted):
                return Certificate(self.run, ballot, value, tuple(grants[v] for v in sorted(grants)),
                                   tuple(counted[v] for v in sorted(counted) if v in voter_set))
        return None


async def _bounded(aw: Awaitable[T], timeout_s: float) -> T:
    return await asyncio.wait_for(aw, timeout=max(timeout_s, 1e-3))


async def _each(targets: Sequence[Voter], contacts: Mapping[str, Contact], ask: Callable[[Voter], Awaitable[T]],
                timeout_s: float, *, enough: Callable[[list[tuple[Voter, object]]], bool] | None = None,
                ) -> list[tuple[Voter, T | BaseException]]:
    """`ask(v)` of every voter at once, each bounded by `timeout_s`, until all answered or `enough(answers)`
    (the rest cancelled); a voter without a contact gets no call."""
    reachable = [v for v in targets if v.peer_id in contacts and contacts[v.peer_id].endpoint]
    results: list[tuple[Voter, T | BaseException]] = [(v, LookupError("no endpoint known")) for v in targets
                                                       if v not in reachable]
    tasks: dict[asyncio.Future[T], Voter] = {asyncio.ensure_future(_bounded(ask(v), timeout_s)): v
                                             for v in reachable}
    pending: set[asyncio.Future[T]] = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: tasks[t]):
                error = task.exception()
                if error is not None and not isinstance(error, RpcError | TimeoutError | ValueError | LookupError):
                    raise error  # a bug, not a network fault
                results.append((tasks[task], error if error is not None else task.result()))
            if enough is not None and enough(results):  # type: ignore[arg-type]
                break
    finally:
        for task in pending:
            task.cancel()
    return results


def _unique(contacts: Sequence[Contact]) -> list[Contact]:
    return list({c.peer_id: c for c in contacts}.values())


def _short(head: str, details: Sequence[str]) -> str:
    return head + (f" ({'; '.join(details[:4])}{'; …' if len(details) > 4 else ''})" if details else "")

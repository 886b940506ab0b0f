"""The proposer's phase 2 when the voters promised a higher ballot in between (averaging/deciding.py): another
session's, which asked for promises as it formed and never proposed (its means could not be completed). Paxos'
answer is a higher ballot; the proposer used to give the attempt up, and with it the round on every member of
its session (128 simulated peers: a round's decision stalled 40 s after a reducer died mid-round and two retry
sessions formed)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from swarmtrain.averaging.deciding import MAX_CARRIES, Chosen, Decider, NotChosen
from swarmtrain.averaging.fetching import MaterialFetcher
from swarmtrain.averaging.material import Material, MaterialStore, layout_of
from swarmtrain.averaging.voting import VoterService
from swarmtrain.round.ballots import Ballot, Value, Voter, session_ballot
from swarmtrain.round.messages import AcceptReply, Contact, PrepareReply
from swarmtrain.sync.votes import MemoryVoteStore
from swarmtrain.trust.identity import Ed25519Identity, verify_signature

pytestmark = pytest.mark.unit

RUN = "run/nonce"
ROUND = 4
BLOBS = [bytes([7, j]) * 16 for j in range(2)]


def _material() -> Material:
    m = Material(layout_of(BLOBS, [(0, 8), (8, 16)], numel=16, codec="fp32", gather=False))
    for j, b in enumerate(BLOBS):
        m.put(j, b)
    return m


def _fetcher(store: MaterialStore, me: str) -> MaterialFetcher:
    return MaterialFetcher(transport=None, store=store, scope="", self_id=me,  # type: ignore[arg-type]
                           check=lambda *_: None, max_bytes=1 << 20)


def _voter(name: str) -> VoterService:
    store = MaterialStore()
    store.put(ROUND, _material())  # it holds the value's material: no fetch in these tests
    return VoterService(scope="", run=RUN, identity=Ed25519Identity.from_seed(name, b"voter"),
                        store=MemoryVoteStore(incarnation=0), materials=store, fetcher=_fetcher(store, name),
                        round_now=lambda: ROUND, numel=16, codec="fp32", offload=False)


class Direct:
    """A ConsensusTransport that calls the voters in this process."""

    def __init__(self, voters: dict[str, VoterService]) -> None:
        self.voters = voters

    async def prepare(self, to: Contact, *, scope: str, round_index: int, ballot: Ballot,
                      timeout_s: float) -> PrepareReply:
        return await self.voters[to.peer_id].prepare(scope=scope, round_index=round_index, ballot=ballot,
                                                     caller="proposer")

    async def accept(self, to: Contact, *, scope: str, round_index: int, ballot: Ballot, value: Value,
                     holders: Sequence[Contact], timeout_s: float) -> AcceptReply:
        return await self.voters[to.peer_id].accept(scope=scope, round_index=round_index, ballot=ballot, value=value,
                                                    holders=holders, caller="proposer", deadline_s=timeout_s)


def _electorate(n: int) -> tuple[list[str], dict[str, VoterService], tuple[Voter, ...], dict[str, Contact],
                                  MaterialStore, Material]:
    """n voters holding the value's material, their contacts, and a proposer's store holding it too."""
    names = [f"v{i}" for i in range(n)]
    store = MaterialStore()
    material = _material()
    store.put(ROUND, material)
    return (names, {v: _voter(v) for v in names}, tuple(Voter(v, 0) for v in names),
            {v: Contact(v, f"10.0.0.{i}:7000") for i, v in enumerate(names)}, store, material)


def _verify(peer_id: str, public_key: bytes, message: bytes, signature: bytes) -> bool:
    return verify_signature(public_key, message, signature)


@pytest.mark.parametrize("promised_before_phase_1", [False, True])
def test_a_proposer_outbid_by_a_session_that_never_proposes_asks_again_above_it(
        promised_before_phase_1: bool) -> None:
    """Session "s" (the lower session id) prepares; session "t" of the same retry asks the voters for promises
    before "s" proposes (or before "s" prepares at all) and never proposes. "s" is chosen under a ballot above
    "t"'s, which names "s"'s own value (a session's ballot: every member of "s" outbid alike asks for the same)."""
    async def main() -> tuple[object, dict[str, VoterService]]:
        names, voters, electorate, contacts, store, material = _electorate(5)
        decider = Decider(transport=Direct(voters), run=RUN, scope="",  # type: ignore[arg-type]  # phases 1 and 2
                          me=Contact("m1", "10.0.1.1:7000"),
                          verify=_verify, materials=store, fetcher=_fetcher(store, "m1"))
        value = Value(scope="", round=ROUND, session="s", base="b" * 64, contributors=tuple(sorted([*names, "m1"])),
                      next_voters=electorate, layout=material.layout, result="e" * 64)
        other = session_ballot(0, 1, "t")
        assert other > session_ballot(0, 1, "s")

        async def t_prepares() -> None:
            for n in names:
                assert (await voters[n].prepare(scope="", round_index=ROUND, ballot=other, caller="t")).granted

        if promised_before_phase_1:
            await t_prepares()
        prepared = await decider.prepare(round_index=ROUND, ballot=session_ballot(0, 1, "s"), voters=electorate,
                                         contacts=contacts, retired={}, timeout_s=5.0)
        if not promised_before_phase_1:
            assert len(prepared.promised_by()) == 5
            await t_prepares()
        outcome = await decider.propose(prepared, value=value, voters=electorate, contacts=contacts, timeout_s=5.0)
        return outcome, voters

    outcome, voters = asyncio.run(main())
    assert isinstance(outcome, Chosen), outcome
    ballot = outcome.certificate.ballot
    assert ballot > session_ballot(0, 1, "t") and (ballot.session, ballot.proposer) == ("s", "")
    assert outcome.certificate.value.session == "s" and len(outcome.certificate.grants) >= 3
    for v in voters.values():
        vote = v.state.rounds[ROUND]
        assert vote.accepted == ballot and vote.value is not None and vote.value.session == "s"


def test_outbidding_is_bounded() -> None:
    """Voters that keep promising higher ballots (a session outbidding this one each time) end the attempt after
    MAX_CARRIES ballots, as carrying a value forward does."""
    async def main() -> object:
        names, voters, electorate, contacts, store, material = _electorate(3)
        transport = Direct(voters)
        asked: list[Ballot] = []
        prepare = transport.prepare

        async def prepare_then_outbid(to: Contact, *, scope: str, round_index: int, ballot: Ballot,
                                      timeout_s: float) -> PrepareReply:
            reply = await prepare(to, scope=scope, round_index=round_index, ballot=ballot, timeout_s=timeout_s)
            if to.peer_id == names[-1]:  # once all promised: "t" outbids the ballot just promised
                asked.append(ballot)
                above = Ballot(ballot.attempt, ballot.retry, ballot.bump + 1, "t", "")
                for n in names:
                    await voters[n].prepare(scope="", round_index=ROUND, ballot=above, caller="t")
            return reply

        transport.prepare = prepare_then_outbid  # type: ignore[method-assign]
        decider = Decider(transport=transport, run=RUN, scope="",  # type: ignore[arg-type]  # phases 1 and 2
                          me=Contact("m1", "10.0.1.1:7000"),
                          verify=_verify, materials=store, fetcher=_fetcher(store, "m1"))
        value = Value(scope="", round=ROUND, session="s", base="b" * 64, contributors=tuple(sorted([*names, "m1"])),
                      next_voters=electorate, layout=material.layout, result="e" * 64)
        prepared = await decider.prepare(round_index=ROUND, ballot=session_ballot(0, 1, "s"), voters=electorate,
                                         contacts=contacts, retired={}, timeout_s=5.0)
        outcome = await decider.propose(prepared, value=value, voters=electorate, contacts=contacts, timeout_s=5.0)
        assert len(asked) == MAX_CARRIES + 1, asked  # the first ballot and MAX_CARRIES higher ones
        return outcome

    outcome = asyncio.run(main())
    assert isinstance(outcome, NotChosen) and "outbid" in outcome.reason, outcome

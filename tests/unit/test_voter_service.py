"""A peer's voter (averaging/voting.py): what it answers around its part's round, and that retiring stops it
granting anything before the retirement is handed out to be announced (a peer that announced its departure
used to keep granting votes until its node closed, so two members counting voters differently could commit
one round twice)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from swarmtrain.averaging.fetching import MaterialFetcher
from swarmtrain.averaging.material import MaterialStore
from swarmtrain.averaging.voting import KEPT_ROUNDS, VoterService
from swarmtrain.round.ballots import Voter, retire_statement, session_ballot
from swarmtrain.round.certificate import check_retirement
from swarmtrain.sync.votes import FileVoteStore, MemoryVoteStore
from swarmtrain.trust.identity import Ed25519Identity, verify_signature

pytestmark = pytest.mark.unit

RUN = "run/nonce"


def _voter(store: MemoryVoteStore, round_now: list[int]) -> VoterService:
    identity = Ed25519Identity.from_seed("v", b"voter")
    materials = MaterialStore()
    fetcher = MaterialFetcher(transport=None, store=materials, scope="", self_id="v",  # type: ignore[arg-type]
                              check=lambda *_: None, max_bytes=1 << 20)
    return VoterService(scope="", run=RUN, identity=identity, store=store, materials=materials, fetcher=fetcher,
                        round_now=lambda: round_now[0], numel=16, codec="fp32", offload=False)


def test_a_voter_answers_only_rounds_near_its_part_and_forgets_those_far_behind() -> None:
    async def main() -> None:
        now = [5]
        voter = _voter(MemoryVoteStore(incarnation=0), now)
        ahead = await voter.prepare(scope="", round_index=7, ballot=session_ballot(0, 0, "s"), caller="x")
        assert not ahead.granted and ahead.refusal == "ahead"  # a future round piles up nothing
        ok = await voter.prepare(scope="", round_index=6, ballot=session_ballot(0, 0, "s"), caller="x")
        assert ok.granted
        await voter.advanced(5)
        late = await voter.prepare(scope="", round_index=5 - KEPT_ROUNDS - 1, ballot=session_ballot(0, 0, "s"),
                                   caller="x")
        assert not late.granted and late.refusal == "forgotten"
        still = await voter.prepare(scope="", round_index=5 - KEPT_ROUNDS, ballot=session_ballot(0, 0, "s"),
                                    caller="x")
        assert still.granted  # a learner one or two rounds late is still answered
        with pytest.raises(Exception, match="scope"):
            await voter.prepare(scope="stage0", round_index=5, ballot=session_ballot(0, 0, "s"), caller="x")

    asyncio.run(main())


def test_a_retired_voter_grants_nothing_and_its_retirement_is_stored_before_it_is_handed_out() -> None:
    async def main() -> None:
        now = [3]
        store = MemoryVoteStore(incarnation=0)
        voter = _voter(store, now)
        assert (await voter.prepare(scope="", round_index=3, ballot=session_ballot(0, 0, "s"), caller="x")).granted
        retirement = await voter.retire(current_round=3)
        # It promised in round 3 and accepted nothing there: it retires from round 3, naming the promise, so
        # that only ballots above it are counted without it (a quorum of that ballot may hold its promise).
        assert retirement.from_round == 3 and json.loads(store.saved[""])["retired_from"] == 3
        assert retirement.promised == session_ballot(0, 0, "s")
        assert verify_signature(retirement.public_key, retire_statement(
            run=RUN, scope="", voter=retirement.voter, from_round=3, promised=retirement.promised),
            retirement.signature)
        check_retirement(retirement, run=RUN, scope="", verify=lambda *_: True)
        assert retirement.counts_for(3, session_ballot(1, 0, "t")) and not retirement.counts_for(
            3, session_ballot(0, 0, "s"))
        refused = await voter.prepare(scope="", round_index=3, ballot=session_ballot(1, 0, "t"), caller="x")
        assert not refused.granted and refused.refusal == "retired" and refused.retirement == retirement
        now[0] = 4
        assert await voter.retire(current_round=9) == retirement  # again: the same, nothing new stored
        # The next start is a new incarnation that votes afresh; the retired one's promise is not its own.
        again = _voter(store, now)
        assert again.state.incarnation == 1 and again.voter.incarnation == 1
        assert (await again.prepare(scope="", round_index=4, ballot=session_ballot(1, 0, "t"), caller="x")).granted

    asyncio.run(main())


def test_the_successors_a_retirement_names_are_signed_stored_and_announced_again_after_a_restart() -> None:
    async def main() -> None:
        store = MemoryVoteStore(incarnation=0)
        voter = _voter(store, [3])
        successors = (Voter("a", 4), Voter("b", 0))
        retirement = await voter.retire(current_round=3, successors=successors)
        assert retirement.successors == successors
        assert verify_signature(retirement.public_key, retire_statement(
            run=RUN, scope="", voter=retirement.voter, from_round=3, successors=successors), retirement.signature)
        again = _voter(store, [3])  # the next start reads them back from its store
        assert again.retirements() == [retirement]

    asyncio.run(main())


def test_a_save_whose_caller_was_cancelled_still_lands_before_any_later_one(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A prepare cancelled while its vote was being fsynced (a caller's deadline) used to release the voter's
    lock with the write still running: the next write raced it for one temporary file (an error that crashed
    the peer), or an older state landed over a newer one. Writes now land one at a time, in order, and a
    retried prepare of the ballot just promised answers only once that promise is stored."""
    fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        time.sleep(0.05)
        fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)

    async def main() -> None:
        store = FileVoteStore(tmp_path / "votes")
        identity = Ed25519Identity.from_seed("v", b"voter")
        materials = MaterialStore()
        fetcher = MaterialFetcher(transport=None, store=materials, scope="", self_id="v",  # type: ignore[arg-type]
                                  check=lambda *_: None, max_bytes=1 << 20)
        voter = VoterService(scope="", run=RUN, identity=identity, store=store, materials=materials,
                             fetcher=fetcher, round_now=lambda: 0, numel=16, codec="fp32", offload=True)
        try:
            first = asyncio.ensure_future(voter.prepare(scope="", round_index=0, ballot=session_ballot(0, 0, "s1"),
                                                        caller="x"))
            await asyncio.sleep(0.01)
            first.cancel()  # mid-write
            retried = await voter.prepare(scope="", round_index=0, ballot=session_ballot(0, 0, "s1"), caller="x")
            assert retried.granted
            assert store.load("").rounds[0].promised == session_ballot(0, 0, "s1")  # stored before the answer
            newer = await voter.prepare(scope="", round_index=0, ballot=session_ballot(1, 0, "s2"), caller="y")
            assert newer.granted and store.load("").rounds[0].promised == session_ballot(1, 0, "s2")
        finally:
            voter.close()

    asyncio.run(main())

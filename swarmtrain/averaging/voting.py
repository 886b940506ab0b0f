"""A peer's voter in one scope: answers prepares and accepts (round/acceptor.py's rules), storing its votes
before any grant leaves it (sync/votes.py), signing its grants with its identity key, and serving what it
knows of a round (`learn`) and the material of the values it holds.

A voter accepts a value only while it holds that value's material, complete and checked, and (with a
checkpoint directory) stored: a member of the value's session waits, bounded, for its own all-reduce to
finish first; otherwise, or for the shards it still misses, it fetches them from the proposer and the
holders the proposer names. A chosen value is thus held by a quorum of voters, whoever crashes.

Bounds: it answers only rounds in [its floor, its part's round + 1], only values of its scope whose
material fits the part (at most its size, since a round may average one fragment of it; the run's codec),
and at most `MAX_CONCURRENT_ACCEPTS` accepts at once (each may fetch material); every wait ends by the
caller's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from swarmtrain.averaging.fetching import MaterialFetcher
from swarmtrain.averaging.material import Material, MaterialError, MaterialStore
from swarmtrain.round.acceptor import Accepted, AcceptorState, Refused, VoterRetirement
from swarmtrain.round.ballots import Ballot, MaterialLayout, Value, Voter, grant_statement, retire_statement
from swarmtrain.round.certificate import Certificate, Retirement, SignedGrant
from swarmtrain.round.messages import AcceptReply, Contact, LearnReply, PrepareReply
from swarmtrain.rpc.errors import Rejected
from swarmtrain.sync.votes import VoteStore
from swarmtrain.trust.identity import Identity

__all__ = ["CertificateBook", "VoterService"]

log = logging.getLogger(__name__)

MAX_CONCURRENT_ACCEPTS = 8
CheckResult = Callable[[Value, Material], Awaitable[str]]
"""Why a value's `result` is not what this peer's own outer step on its material gives ("" when it is, or when
this peer does not hold the value's base state and cannot tell)."""
KEPT_ROUNDS = 2  # rounds behind its part a voter still answers (learners one round late)
KEPT_MATERIAL_ROUNDS = 1  # rounds behind its part whose material a voter keeps (the round it just committed)
MAX_CERTIFICATES = 16


class CertificateBook:
    """The certificates this peer holds, newest rounds (what it shows learners and joiners)."""

    def __init__(self, *, keep: int = MAX_CERTIFICATES) -> None:
        self.keep = keep
        self._by_round: OrderedDict[int, Certificate] = OrderedDict()

    def add(self, cert: Certificate) -> None:
        self._by_round[cert.round] = cert
        self._by_round.move_to_end(cert.round)
        for r in sorted(self._by_round)[:-self.keep]:
            del self._by_round[r]

    def get(self, round_index: int) -> Certificate | None:
        return self._by_round.get(round_index)

    def chain(self, from_round: int) -> list[Certificate]:
        """The certificates of rounds >= `from_round`, oldest first (what a peer behind checks one by one)."""
        return [self._by_round[r] for r in sorted(self._by_round) if r >= from_round]

    def clear(self) -> None:
        self._by_round.clear()


class VoterService:
    """See the module docstring. Lives on the loop that serves the data plane."""

    def __init__(self, *, scope: str, run: str, identity: Identity, store: VoteStore, materials: MaterialStore,
                 fetcher: MaterialFetcher, round_now: Callable[[], int], numel: int, codec: str,
                 offload: bool = True, check_result: CheckResult | None = None) -> None:
        """`run` is "<run id>/<run nonce>"; `round_now()` the part's round (its committed θ_global's);
        `offload`: store votes in a worker thread (an fsync must not stall the loop; a simulation runs inline);
        `numel` 0: values of any size (a facade whose callers pick it)."""
        self.scope = scope
        self.run = run
        self.identity = identity
        self.store = store
        self.materials = materials
        self.fetcher = fetcher
        self.round_now = round_now
        self.numel = numel
        self.codec = codec
        self.offload = offload
        self.check_result = check_result
        self.state: AcceptorState = store.load(scope)
        if self.state.retired_from is not None:  # it left gracefully last time: it votes as its next incarnation
            self.state.reincarnate()
        # Stored before anything announces it: a contributor's incarnation is a voter of the next round, and
        # a restart must come back as that voter, not as a new one the round's voter set does not know.
        store.save(self.state)
        self.certificates = CertificateBook()
        self._lock = asyncio.Lock()
        # One writer thread: an fsync must not stall the loop, and writes must land in the order they were made.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"votes-{scope or 'model'}") \
            if offload else None
        self._last_save: asyncio.Future[None] | None = None
        self._accepting = asyncio.Semaphore(MAX_CONCURRENT_ACCEPTS)
        self._pulls: dict[str, asyncio.Event] = {}  # sessions this peer's own all-reduce is pulling

    @property
    def voter(self) -> Voter:
        return Voter(self.identity.peer_id, self.state.incarnation)

    def _submit(self) -> asyncio.Future[None]:
        """Queue a write of the voter's state as it is now (copied here, on the loop that alone changes it)."""
        snapshot = AcceptorState.from_json(self.state.to_json())
        if self._writer is None:
            self.store.save(snapshot)
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            self._last_save = done
        else:
            self._last_save = asyncio.get_running_loop().run_in_executor(self._writer, self.store.save, snapshot)
            self._last_save.add_done_callback(_log_failed_save)
        return self._last_save

    async def _save(self) -> None:
        """Store the voter's state as it is now; returns once it is durable. Writes run one at a time, in the
        order they were queued, each of a copy taken when it was queued: a write never puts an older state over
        a newer one. A caller cancelled meanwhile does not cancel its write."""
        await asyncio.shield(self._submit())

    async def _durable(self) -> None:
        """Until every state queued so far is stored: an answer that grants what an earlier, still running
        write records (a retried prepare of the ballot just promised) waits for it."""
        last = self._last_save
        if last is not None and not last.done():
            await asyncio.shield(last)

    def close(self) -> None:
        """Finish the queued writes and stop the writer thread."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)

    def _retirement(self) -> Retirement | None:
        if self.state.retired_from is None:
            return None
        mine = [x for x in self.state.retirements if x.incarnation == self.state.incarnation]
        if not mine:
            return None
        x = mine[-1]
        return self._announced(x)

    def _announced(self, x: VoterRetirement) -> Retirement:
        return Retirement(Voter(self.identity.peer_id, x.incarnation), x.from_round, self.identity.public_key,
                          x.signature, x.promised, x.accepted, x.value, x.successors)

    def _check_scope(self, scope: str) -> None:
        if scope != self.scope:
            raise Rejected(f"scope {scope!r} is not voted on here (this voter's scope is {self.scope!r})",
                           kind="not_found")

    # ------------------------------------------------------------------ the calls

    async def prepare(self, *, scope: str, round_index: int, ballot: Ballot, caller: str) -> PrepareReply:
        self._check_scope(scope)
        async with self._lock:
            answer = self.state.prepare(round_index, ballot, horizon=self.round_now() + 1)
            if isinstance(answer, Refused):
                return PrepareReply(self.voter, False, promised=answer.promised, refusal=answer.kind,
                                    reason=answer.reason, retirement=self._retirement())
            if answer.changed:
                await self._save()
            else:
                await self._durable()
            holds = answer.value is not None and self.materials.holds(answer.value.layout)
            return PrepareReply(self.voter, True, promised=answer.ballot, accepted=answer.accepted,
                                value=answer.value, holds_material=holds)

    def expect_pull(self, session: str) -> asyncio.Event:
        """This peer's all-reduce is pulling `session`'s means: an accept of that session waits for it."""
        event = self._pulls[session] = asyncio.Event()
        for s in list(self._pulls)[:-8]:
            self._pulls.pop(s).set()
        return event

    async def accept(self, *, scope: str, round_index: int, ballot: Ballot, value: Value,
                     holders: Sequence[Contact], caller: str, deadline_s: float) -> AcceptReply:
        """`deadline_s`: seconds the caller waits (the material fetch must end within it)."""
        self._check_scope(scope)
        layout = value.layout
        # A round averages the whole part or, with streaming fragments, one fragment of it: never more.
        if (self.numel and not 0 < layout.numel <= self.numel) or layout.codec != self.codec:
            raise Rejected(f"a value of {layout.numel} values in codec {layout.codec!r}; this part holds "
                           f"{self.numel} in {self.codec!r}")
        # Cheap refusals first: no fetch for a value this voter would refuse anyway.
        early = self.state.refusal(round_index, horizon=self.round_now() + 1)
        vote = self.state.rounds.get(round_index)
        if early is None and vote is not None and ballot < vote.promised:
            early = Refused("promised", f"promised {tuple(vote.promised)} in round {round_index}", vote.promised)
        if early is not None:
            return AcceptReply(self.voter, False, promised=early.promised, refusal=early.kind, reason=early.reason,
                               retirement=self._retirement())
        async with self._accepting:
            refusal = await self._hold_material(round_index, value, holders, deadline_s)
            if refusal:
                return AcceptReply(self.voter, False, refusal="material", reason=refusal)
            if self.check_result is not None:
                material = self.materials.get(layout)
                assert material is not None
                wrong = await self.check_result(value, material)
                if wrong:
                    log.warning("refused round %d's value of session %s from %s: %s", round_index,
                                value.session[:12], caller, wrong)
                    return AcceptReply(self.voter, False, refusal="result", reason=wrong)
            async with self._lock:
                answer = self.state.accept(round_index, ballot, value, horizon=self.round_now() + 1)
                if isinstance(answer, Refused):
                    return AcceptReply(self.voter, False, promised=answer.promised, refusal=answer.kind,
                                       reason=answer.reason, retirement=self._retirement())
                return AcceptReply(self.voter, True, grant=await self._granted(round_index, answer))

    async def _granted(self, round_index: int, answer: Accepted) -> SignedGrant:
        """Sign and store an accepted (ballot, value) (under the lock); the grant to send."""
        vote = self.state.rounds[round_index]
        if answer.changed or not vote.signature:
            message = grant_statement(run=self.run, scope=self.scope, round_index=round_index, ballot=answer.ballot,
                                      value_id=answer.value.value_id, voter=self.voter)
            self.state.sign_accepted(round_index, self.identity.sign(message))
            await self._save()
        else:
            await self._durable()
        return SignedGrant(self.voter, self.identity.public_key, vote.signature)

    async def _hold_material(self, round_index: int, value: Value, holders: Sequence[Contact],
                             deadline_s: float) -> str:
        """Make this voter hold `value`'s material (stored, if durable); "" when it does, else why not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        pull = self._pulls.get(value.session)
        if pull is not None and not self.materials.holds(value.layout):
            # its own all-reduce is pulling this session's means: use them rather than fetching them twice
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pull.wait(), timeout=max(0.0, deadline_s / 2))
        try:
            if not self.materials.holds(value.layout):
                await self.fetcher.complete(round_index, value.layout, holders,
                                            timeout_s=max(0.0, deadline - loop.time()))
            if self.materials.durable:
                if self.offload:
                    await asyncio.to_thread(self.materials.make_durable, round_index, value.layout)
                else:
                    self.materials.make_durable(round_index, value.layout)
        except MaterialError as e:
            return str(e)
        return ""

    async def learn(self, *, scope: str, round_index: int, caller: str) -> LearnReply:
        self._check_scope(scope)
        cert = self.certificates.get(round_index)
        found = self.state.accepted_in(round_index)
        if found is None:
            return LearnReply(certificate=cert)
        incarnation, vote = found
        voter = Voter(self.identity.peer_id, incarnation)
        assert vote.value is not None
        grant = SignedGrant(voter, self.identity.public_key, vote.signature) if vote.signature else None
        return LearnReply(certificate=cert, voter=voter, accepted=vote.accepted, value=vote.value, grant=grant,
                          holds_material=self.materials.holds(vote.value.layout))

    async def material(self, *, scope: str, layout: MaterialLayout, shard: int,
                       caller: str) -> bytes | bytearray | memoryview:
        self._check_scope(scope)
        if not 0 <= shard < len(layout.shards):
            raise Rejected(f"shard {shard} of a value of {len(layout.shards)} shards")
        blob = self.materials.blob(layout, shard)
        if blob is None:
            raise Rejected("this peer does not hold that value's material", kind="not_found")
        return blob

    async def certificates_from(self, *, scope: str, from_round: int, caller: str) -> tuple[Certificate, ...]:
        """The `certificates` call (named apart from the book it reads)."""
        self._check_scope(scope)
        return tuple(self.certificates.chain(from_round))

    # ------------------------------------------------------------------ the peer's own calls

    def pulled(self, session: str) -> None:
        """This peer's all-reduce of `session` ended (its material, if any, is in the store)."""
        event = self._pulls.pop(session, None)
        if event is not None:
            event.set()

    async def advanced(self, round_index: int, *, keep_from: int | None = None) -> None:
        """The part reached `round_index` (a commit, a heal): votes of rounds far behind go, and material of all
        but the round just committed (a learner one round late applies it; one further behind downloads the
        state instead: a round's material is as large as the model's encoded mean). `keep_from`: the oldest
        round the part could restart at (its oldest checkpoint): everything from it on is kept, so that a
        restart, of this peer or of the whole swarm, learns the rounds it replays."""
        floor = max(0, round_index - KEPT_ROUNDS)
        material_floor = max(0, round_index - KEPT_MATERIAL_ROUNDS)
        if keep_from is not None:
            floor, material_floor = min(floor, keep_from), min(material_floor, keep_from)
        async with self._lock:
            if self.state.forget_before(floor):
                await self._save()
        self.materials.forget_before(material_floor)

    async def retire(self, *, current_round: int, successors: Sequence[Voter] = ()) -> Retirement:
        """Leave for good: from the returned retirement's round on this incarnation grants nothing, and the next
        start votes as a new incarnation. Stored before it is returned (and announced). `successors`: the
        voters it names for that round, as its last voter (round/certificate.py `successors_of`)."""
        async with self._lock:
            retired = self._retirement()
            if retired is not None:
                return retired
            from_round = self.state.retire(current_round=current_round)
            promised, accepted = self.state.retired_promise(), self.state.retired_accepted()
            signature = self.identity.sign(retire_statement(
                run=self.run, scope=self.scope, voter=self.voter, from_round=from_round, promised=promised,
                accepted=None if accepted is None else accepted[0],
                value_id="" if accepted is None else accepted[1].value_id, successors=tuple(successors)))
            stored = self.state.sign_retirement(signature, tuple(successors))
            await self._save()
        return self._announced(stored)

    def retirements(self) -> list[Retirement]:
        """Every retirement this voter stored (its departure record announces them)."""
        return [self._announced(x) for x in self.state.retirements]


def _log_failed_save(fut: asyncio.Future[None]) -> None:
    """A write whose caller went away: its error is still said (the next write tries again)."""
    if not fut.cancelled() and fut.exception() is not None:
        log.error("could not store this voter's state: %s", fut.exception())

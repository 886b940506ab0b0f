"""The round driver: one part's outer rounds, the round machine's actions (round/machine.py) performed
against the part and its network plane. The one loop every part runs: a DiLoCo worker, a pipeline stage's
server, a pipeline's trainers for the embeddings and head, and the simulation tester's peers.

Each action:
* **heal**: read the live peers; learn every round the swarm committed past this part's that a certificate
  shows (with the material from any holder, applied here: bit for bit the swarm's commit); then, if still
  behind, adopt the state a strict majority of the peers ahead announce (round/heal.py), checked against its
  digest;
* **train**: the part's inner steps and Δ;
* **average**: matchmaking, then the all-reduce and the decision among the round's voters (averaging/
  rounds.py); a commit is applied, a round decided elsewhere learned;
* **wait**: until the attempt this peer missed can no longer commit, or the swarm passes the round.

The round's electorate: its voters (the committed state's, or the scope's genesis from the run record when
no commit fixes them), the retirements of those voters that their departure records prove, and where to
reach them (the group, and every record read: contacts.py). Every wait ends by a deadline on the event loop's
clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence

from swarmtrain.averaging.rounds import Electorate
from swarmtrain.config import RunConfig
from swarmtrain.diloco.averager import AverageResult
from swarmtrain.discovery import Discovery, DiscoveryError, PeerRecord
from swarmtrain.driver.contacts import ContactBook
from swarmtrain.driver.departures import announce_departure, announce_stored_retirements, departure_record
from swarmtrain.driver.downloads import Newer, StateDownloads
from swarmtrain.driver.part import CommittedState, Part, RoundPlane, Trained, contacts_of
from swarmtrain.driver.presence import Presence
from swarmtrain.round import Average, Finish, Heal, RoundMachine, Train, Wait
from swarmtrain.round.ballots import Genesis, Voter, quorum_base
from swarmtrain.round.certificate import (
    CertificateError,
    Retirement,
    Verify,
    check_retirement,
    follow_chain,
    successors_of,
)
from swarmtrain.round.group import Member
from swarmtrain.round.heal import donor_order, swarm_round_end
from swarmtrain.round.messages import Contact
from swarmtrain.telemetry import HealEvent

__all__ = ["Behind", "RoundDriver", "announce_departure", "announce_stored_retirements", "departure_record"]

log = logging.getLogger(__name__)

MAX_CHAIN_DONORS = 3  # peers ahead asked for their certificates in one heal check
MAX_SUCCESSIONS = 8  # voter sets of one round followed through their successors (each named by a retirement)
MAX_SUCCESSORS = 64  # voters a retirement names for its round (a quorum of them decides it)


class Behind(RuntimeError):
    """A part's `train` ended without a Δ: the part's other holders are past its round (it heals first)."""


class RoundDriver:
    """Drives `part` through its rounds over `plane` (see the module docstring).

    `member(trained)` is this peer's match entry for a round; `genesis()` reads the scope's genesis from the
    run record; `emit` gets heal lines; `changed()` runs after every change of the committed state (the
    role's heartbeat announces it at once)."""

    def __init__(self, *, part: Part, plane: RoundPlane, discovery: Discovery, cfg: RunConfig, role: str,
                 member: Callable[[Trained], Member], run: str, verify: Verify, presence: Presence,
                 genesis: Callable[[], Awaitable[Genesis | None]], emit: Callable[[HealEvent], None],
                 changed: Callable[[], None] = lambda: None, overlap: bool = False) -> None:
        self.part = part
        self.plane = plane
        self.discovery = discovery
        self.cfg = cfg
        self.role = role
        self.member = member
        self.run_name = run
        self.verify = verify
        self.presence = presence
        self.genesis = genesis
        self.emit = emit
        self.changed = changed
        self.overlap = overlap
        self.machine = self._new_machine()
        self.pending: Trained | None = None  # the round trained and not committed yet
        self.peers: tuple[PeerRecord, ...] = ()  # the scope's live records, as last read
        self.contacts = ContactBook()  # every endpoint read in the scope's records (a read can miss some)
        self._verified: dict[tuple[Voter, int], Retirement] = {}  # retirements checked once
        self.downloads = StateDownloads(part=part, plane=plane, cfg=cfg, role=role, self_id=discovery.peer_id,
                                        peers=lambda: self.peers, reread=self._reread_peers, adopted=self._adopted)

    def _new_machine(self) -> RoundMachine:
        return RoundMachine(round_index=self.part.round, rounds=self.cfg.diloco.rounds, clock=self.discovery.now,
                            overlap=self.overlap, on_transition=lambda t: log.info("%s: %s", self.peer_id, t.line()))

    def restart_machine(self) -> None:
        """The part's committed state was replaced from outside (a stage server took another stage): its rounds
        start afresh from its round (before `run`)."""
        self.machine, self.pending = self._new_machine(), None

    @property
    def peer_id(self) -> str:
        return self.discovery.peer_id

    @property
    def scope(self) -> str:
        return self.plane.scope

    def _loop_time(self) -> float:
        return asyncio.get_running_loop().time()

    # ------------------------------------------------------------------ the loop

    async def run(self, stop: asyncio.Event) -> str:
        """Until `diloco.rounds` rounds are committed ("done") or `stop` ("signal")."""
        clock = asyncio.ensure_future(self.settle_clock())
        try:
            return await self._rounds(stop)
        finally:
            clock.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await clock

    async def settle_clock(self) -> None:
        """Until this peer's clock agrees with the swarm's, read the live peers every heartbeat.

        Round boundaries read them too (heal checks, waits), but rounds can be minutes apart: a joiner whose
        clock is seconds off would halve its error once per round and miss windows meanwhile. Once settled,
        the boundary reads keep watch, and a read that finds the clock off again resumes this one."""
        while True:
            await asyncio.sleep(self.cfg.discovery.heartbeat_s)
            if not self.presence.settled:
                with contextlib.suppress(Exception):  # a failed read: the next heartbeat tries again
                    await self._read_clock()

    async def _read_clock(self) -> None:
        peers = await self.discovery.live_peers(timeout_s=self.cfg.rpc.call_timeout_s)
        self.presence.correct(self.discovery, peers)

    async def _rounds(self, stop: asyncio.Event) -> str:
        machine = self.machine
        while True:
            if stop.is_set():
                machine.request_stop()
            action = machine.next()
            if isinstance(action, Finish):
                if action.reason == "done":
                    await self.linger(stop)
                return action.reason
            if isinstance(action, Heal):
                await self.heal(action)
            elif isinstance(action, Train):
                await self._train(stop)
            elif isinstance(action, Average):
                await self._average()
            elif isinstance(action, Wait):
                await self.wait(action, stop)
            else:
                raise AssertionError(f"the round driver cannot perform {action!r}")

    async def wait(self, action: Wait, stop: asyncio.Event) -> None:
        """The machine's wait, reported to it."""
        if await self._await_swarm_past(action.round, until=action.until, stop=stop, watch=action.watch):
            self.machine.waited()
        else:
            self.machine.stopped()

    async def _train(self, stop: asyncio.Event) -> None:
        self.pending = None  # the last round's Δ, done with: never two in memory
        try:
            trained = await self.part.train(stop)
        except Behind as e:
            self.machine.trained(problem=str(e))  # nothing trained to keep: the top of the round heals
            return
        if trained is None:
            self.machine.stopped()
            return
        self.pending = trained
        problem = await self.part.delta_problem(trained)
        if problem:
            await self.part.resync(problem)
            self.pending = None
        self.machine.trained(problem=problem)

    async def _average(self) -> None:
        trained = self.pending
        assert trained is not None and trained.round == self.part.round, "averaging a round not trained"
        started = self._loop_time()
        try:
            result = await self.average(trained)
        except Exception as e:  # this peer's own side failed (a codec, a bug): the swarm goes on without it
            log.exception("round %d: the all-reduce failed on this peer", trained.round)
            reason = f"local error in the all-reduce: {type(e).__name__}: {e}"
            await self.part.resync(reason)
            self.pending = None
            self.machine.failed(reason=reason)
            return
        await self.part.report(trained, result, comm_s=self._loop_time() - started)
        self.machine.averaged(committed=result.committed, reason=result.reason, retry_at=result.retry_at,
                              heal_to_hash=result.heal_to_hash)
        if result.committed:
            self.pending = None  # Δ is in θ_global now; only an aborted round averages it again

    async def average(self, trained: Trained, *, apply: bool = True) -> AverageResult:
        """One attempt at `trained`'s round: matchmaking, the all-reduce and the decision; a commit applied
        (without `apply`, the caller applies it and then calls `committed`: an overlapped round lands between
        two inner steps)."""
        started = self._loop_time()
        # The round's electorate (its voters' retirements: a DHT read) is read while the group forms, not after.
        electing = asyncio.ensure_future(self.electorate(trained.round))
        try:
            outcome = await self.plane.match(trained.round, self.member(trained))
        except BaseException:
            electing.cancel()
            raise
        if outcome.group is None:
            electing.cancel()
            return AverageResult(trained.round, False, None, reason=f"no group: {outcome.reason}",
                                 retry_at=outcome.retry_at, heal_to_hash=outcome.heal_to_hash)
        self.machine.matched(group=f"attempt {outcome.group.attempt}, {len(outcome.group.members)} members, "
                                   f"group {outcome.group.group_id[:12]}")
        found = await electing
        electorate = Electorate(found.voters, found.retired, self.contacts.all())  # the contacts as of now
        result = await self.plane.average(outcome, trained.delta, base=self.part.digest, electorate=electorate,
                                          preview=self.part.preview)
        if result.committed:
            if apply:
                await self._apply(result, comm_s=self._loop_time() - started)
            return result
        if result.known is not None:  # decided elsewhere, its material not to be had here: heal by state transfer
            return dataclasses.replace(result, retry_at=0.0)
        return dataclasses.replace(result, retry_at=outcome.retry_at)

    async def _apply(self, result: AverageResult, *, comm_s: float = 0.0) -> None:
        pending = self.pending
        own = pending if pending is not None and pending.round == result.round and self.peer_id in result.members \
            else None
        await self.part.apply(result, own=own, comm_s=comm_s)
        await self.committed(result)

    async def committed(self, result: AverageResult) -> None:
        """After a commit was applied to the part: the voter moves on, the certificate is kept, it is announced."""
        if self.pending is not None and self.pending.round < self.part.round:
            self.pending = None
        await self.plane.advanced(self.part.round, keep_from=self.part.replay_from())
        if result.certificate is not None:
            await self.plane.keep_certificate(result.certificate)
        self.changed()

    # ------------------------------------------------------------------ the electorate

    async def electorate(self, round_index: int, *, extra: Sequence[PeerRecord] = ()) -> Electorate:
        """Round `round_index`'s voters, their proven retirements, and their contacts (see the module docstring).

        Where no commit fixed them, the scope's genesis decides: a swarm's first round waits (a matchmaking
        window at most) for the coordinator to fix it, rather than run an attempt nobody can decide."""
        voters = self.part.voters if round_index == self.part.round else ()
        retired = await self._retirements(voters, round_index) if voters else {}
        if not voters or not quorum_base(voters, retired):
            genesis = await self._genesis_within(self.cfg.averaging.matchmaking_timeout_s)
            if genesis is not None and genesis.round == round_index:
                voters = genesis.voters
                retired = await self._retirements(voters, round_index)
        for _ in range(MAX_SUCCESSIONS):  # every voter retired having accepted nothing: the successors they named
            successors = successors_of(voters, retired, round_index) if not quorum_base(voters, retired) else ()
            if not successors:
                break
            log.info("round %d: every voter retired and none accepted a value; its last voter named %d successors",
                     round_index, len(successors))
            voters, retired = successors, await self._retirements(successors, round_index)
        self.contacts.remember(contacts_of(extra).values())  # the live records were remembered as they were read
        return Electorate(tuple(voters), retired, self.contacts.all())

    async def _genesis_within(self, timeout_s: float) -> Genesis | None:
        deadline = self._loop_time() + timeout_s
        while True:
            genesis = await self.genesis()
            if genesis is not None or self._loop_time() >= deadline:
                return genesis
            await asyncio.sleep(min(self.cfg.discovery.heartbeat_s / 2, max(0.0, deadline - self._loop_time())))

    async def _retirements(self, voters: Sequence[Voter], round_index: int) -> dict[Voter, Retirement]:
        """The retirements of `voters` that count in `round_index`, from the departure records, each checked."""
        try:
            departures = await self.discovery.departures(timeout_s=self.cfg.rpc.call_timeout_s)
        except (DiscoveryError, TimeoutError) as e:  # counting every voter is always safe, just less live
            log.info("could not read departures (%s): counting every voter of round %d", e, round_index)
            return {}
        wanted, out = set(voters), {}
        for d in departures:
            for r in d.retirements.get(self.scope, ()):
                if r.voter not in wanted or r.from_round > round_index:
                    continue
                key = (r.voter, r.from_round)
                if key not in self._verified:
                    try:
                        check_retirement(r, run=self.run_name, scope=self.scope, verify=self.verify)
                    except CertificateError as e:
                        log.warning("ignored the retirement of %s: %s", r.voter, e)
                        continue
                    self._verified[key] = r
                out[r.voter] = self._verified[key]
        return out

    # ------------------------------------------------------------------ heals

    async def read_peers(self, *, why: str = "") -> tuple[PeerRecord, ...] | None:
        """The scope's live records (the clock estimate corrected by them); None when the read failed."""
        try:
            peers = await self.discovery.live_peers(timeout_s=self.cfg.rpc.call_timeout_s)
        except (DiscoveryError, TimeoutError) as e:
            log.warning("could not list live peers (%s)%s", e, why)
            return None
        self.presence.correct(self.discovery, peers)
        self.peers = tuple(p for p in peers if p.peer_id != self.peer_id)
        self.contacts.remember(contacts_of(self.peers).values())
        await self._rejoin_dht_if_isolated()
        return self.peers

    async def heal(self, action: Heal) -> bool:
        """The machine's heal check (reported to it); True when this part's committed state moved.

        Behind the swarm, the peer first learns the next round from its certificate (the material from a
        holder: a quarter of the state with int8); then it follows the certificate chain a peer ahead shows,
        from this part's own state and voters, to the newest state it vouches for, and downloads that from
        any peer announcing it; only when no chain reaches back to what it holds (a joiner, a peer whose
        state went astray, one behind for longer than peers keep certificates) does it take the state a
        strict majority of the peers ahead announce (round/heal.py)."""
        peers = await self.read_peers(why="; not healing this round")
        if peers is None:
            self.machine.healed(round_index=None)
            return False
        start_round = self.part.round
        ahead = self._ahead()
        source = await self._learn_next() if ahead else ""
        ahead = self._ahead()
        target = await self._chain_target(ahead) if ahead else None
        keep = action.keep_progress_rounds
        held: Newer | None = None
        if target is not None:
            adopted = await self.downloads.transfer(target[0], target[1], target[2], keep_progress_rounds=keep)
            if isinstance(adopted, Newer):
                held, adopted = adopted, ""
            source = adopted or source
        if self._ahead() or (action.want_hash and not source):
            source = await self.downloads.majority(want_hash="" if source else action.want_hash, keep=keep,
                                                   held=held) or source
        if self.part.round == start_round and not source:
            if self._ahead():  # behind, and no way to catch up yet: not another attempt at a past round at once
                await asyncio.sleep(self.cfg.discovery.heartbeat_s)
            self.machine.healed(round_index=None)
            return False
        self.part.joined(self.part.round, swarm_round_end(self.peers, self.part.round))
        self.machine.healed(round_index=self.part.round, source=source)
        return True

    async def _reread_peers(self) -> bool:
        return await self.read_peers(why="; not healing this round") is not None

    def _adopted(self, event: HealEvent) -> None:
        """A downloaded state was adopted: nothing trained before it is pending, and its heal line goes out."""
        self.pending = None
        self.changed()
        self.emit(event)

    def _ahead(self) -> list[PeerRecord]:
        return sorted((p for p in self.peers if p.round > self.part.round and p.endpoint and p.role == self.role),
                      key=lambda p: (-p.round, p.peer_id))

    async def _learn_next(self) -> str:
        """The round the swarm committed past this part's, learned from its certificate and applied (when its
        material can be had); "certificate", or "" when it was not."""
        electorate = await self.electorate(self.part.round)
        if not electorate.voters:
            return ""
        ahead = self._ahead()
        result = await self.plane.learn(self.part.round, electorate,
                                        others=[Contact(p.peer_id, p.endpoint) for p in ahead])
        if not result.committed:
            log.info("round %d: not learned from the %d peers ahead (%s)", self.part.round, len(ahead), result.reason)
            return ""
        before = self.part.round
        await self._apply(result)
        self.emit(HealEvent(from_round=before, to_round=self.part.round, source="certificate", hash=self.part.digest,
                            peer=self.peer_id, transfer_s=0.0))
        return "certificate"

    async def _chain_target(self, ahead: Sequence[PeerRecord]) -> tuple[int, str, list[PeerRecord]] | None:
        """The newest state a certificate chain of a peer ahead leads to from this part's own, with the peers
        that announce it (the donor of the chain first)."""
        electorate = await self.electorate(self.part.round)
        if not electorate.voters:
            return None
        for peer in ahead[:MAX_CHAIN_DONORS]:
            certs = await self.plane.certificates(Contact(peer.peer_id, peer.endpoint), from_round=self.part.round)
            reached = follow_chain(certs, run=self.run_name, scope=self.scope, round_index=self.part.round,
                                   voters=electorate.voters, digest=self.part.digest, verify=self.verify)
            if reached is None:
                continue
            round_index, digest, _ = reached
            donors = donor_order(self.peer_id, [p for p in ahead if (p.round, p.state_hash) == (round_index, digest)])
            if donors:
                return round_index, digest, list(donors)
        return None

    # ------------------------------------------------------------------ waits

    async def _await_swarm_past(self, round_index: int, *, until: float, stop: asyncio.Event,
                                watch: bool = True) -> bool:
        """After an attempt that did not commit here: until `until` (swarm clock) or, with `watch`, a live peer
        past the round; False on `stop`."""
        deadline = self._loop_time() + until - self.discovery.now()
        if watch:
            await self.watch(lambda peers: any(p.round > round_index for p in peers), deadline=deadline, stop=stop)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=max(0.0, deadline - self._loop_time()))
        return not stop.is_set()

    async def watch(self, done: Callable[[Sequence[PeerRecord]], bool], *, deadline: float,
                    stop: asyncio.Event) -> None:
        """Read the live peers every half heartbeat until `done(peers)`, `deadline` (loop clock) or `stop`."""
        while self._loop_time() < deadline and not stop.is_set():
            peers = await self.read_peers() or ()
            if done(peers):
                return
            delay = min(deadline, self._loop_time() + self.cfg.discovery.heartbeat_s / 2) - self._loop_time()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)

    async def linger(self, stop: asyncio.Event) -> None:
        """Run done: keep serving state while a live peer is still behind the last round (bounded)."""
        a = self.cfg.averaging
        deadline = self._loop_time() + 2 * (a.matchmaking_timeout_s + a.allreduce_timeout_s) \
            + 4 * self.cfg.discovery.heartbeat_s

        def nobody_behind(peers: Sequence[PeerRecord]) -> bool:
            behind = [p.peer_id for p in peers if p.role == self.role and p.round < self.cfg.diloco.rounds]
            if behind:
                log.info("run done; serving state until %s catch up", behind)
            return not behind

        await self.watch(nobody_behind, deadline=deadline, stop=stop)

    async def _rejoin_dht_if_isolated(self) -> None:
        """After two record TTLs without seeing another peer, dial the initial peers again (one log line)."""
        maddrs = self.cfg.discovery.initial_peers
        if not maddrs or not self.presence.rebootstrap_due():
            return
        try:
            answered = await self.discovery.rebootstrap(maddrs, timeout_s=self.cfg.rpc.call_timeout_s)
        except Exception as e:  # the next due time tries again
            log.warning("no other live peer seen for %.0f s; re-joining the DHT through %d initial peer(s) failed: "
                        "%s", self.presence.unseen_s(), len(maddrs), e)
            return
        log.warning("no other live peer seen for %.0f s: re-joined the DHT through its initial peers (%d of %d "
                    "answered)", self.presence.unseen_s(), answered, len(maddrs))

    # ------------------------------------------------------------------ leaving

    async def hand_over(self) -> bool:
        """Before retiring: when this peer's retirement would leave the round it is a voter of without a live
        quorum, vote on there until the swarm is past it.

        A retirement names the leaver's last vote, so the ballots after it count their quorum without the
        leaver and carry what it accepted: leaving at once loses nothing while more than half of the other
        voters of the round (V(r) less the retirements known, less this one) are live and some live peer is at
        its round. When the voters are not (every other voter left, or most are unseen), the round would have
        no quorum: the leaver contributes nothing more, so the next round's voters leave it out, and keeps
        voting (data plane and record up) until a live peer of the scope is past the round. When it is ahead
        of every live peer, it holds the only certificate of the round it committed last: it stays until one
        of them has learned it. Bounded by the swarm's announced end of the round's steps plus four attempt
        spans. Waiting only then keeps a leave short, and a process killed while it waits
        (a supervisor's stop timeout) as rare as it can be. True when handed over or not needed."""
        last = self.part.round
        if self.cfg.diloco.rounds and last >= self.cfg.diloco.rounds:
            return True  # the run's rounds are done: none left to decide
        me = Voter(self.peer_id, self.plane.incarnation)
        peers = [p for p in await self.read_peers(why=" before leaving") or () if p.peer_id != self.peer_id]
        electorate = await self.electorate(last)
        if me not in electorate.voters:
            return True
        if not any(p.role == self.role for p in peers):
            return True  # nobody left to decide the round: nothing to hand over
        retired = electorate.retired
        others = quorum_base(electorate.voters, [*retired, me])
        live = {p.peer_id for p in peers if p.role == self.role}
        # Ahead of every live peer, it holds the only certificate of its last round: they learn it from it.
        learn = not any(p.round >= last for p in peers if p.role == self.role)
        vote = not (others and 2 * sum(v.peer_id in live for v in others) > len(others))
        if not learn and not vote:
            return True
        a = self.cfg.averaging
        ends = [p.round_ends_at for p in peers if p.round == last and p.round_ends_at > 0]
        steps_left_s = max(0.0, max(ends, default=0.0) - self.discovery.now())
        deadline = self._loop_time() + steps_left_s + 4 * (a.matchmaking_timeout_s + a.allreduce_timeout_s) \
            + 4 * self.cfg.discovery.heartbeat_s
        log.info("%s: leaving; %d other voter(s) of round %d live, %s: staying until the swarm %s it",
                 self.peer_id, sum(v.peer_id in live for v in others), last,
                 "ahead of every live peer" if learn else "some peer at its round", "is past" if vote else "is at")
        passed = asyncio.Event()

        def past(records: Sequence[PeerRecord]) -> bool:
            rounds = [p.round for p in records if p.peer_id != self.peer_id and p.role == self.role]
            if any(r > last for r in rounds) or (not vote and any(r >= last for r in rounds)):
                passed.set()
            return passed.is_set()

        await self.watch(past, deadline=deadline, stop=asyncio.Event())
        if passed.is_set():
            return True
        log.warning("%s: the swarm did not pass round %d before the leave's deadline: retiring anyway",
                    self.peer_id, last)
        return False

    def _successors_at(self, round_index: int) -> tuple[Voter, ...]:
        """The voters a retiring voter names for its round: the live serving peers of its role at the round,
        holding its state (as last read); when there are none and its votes are kept on disk, its own next
        incarnation (what a restart from the same directory votes as): a peer alone in its swarm that leaves
        and comes back goes on from the round it left."""
        digest = self.part.digest
        found = tuple(Voter(p.peer_id, p.incarnation) for p in sorted(self.peers, key=lambda p: p.peer_id)
                      if p.role == self.role and p.round == round_index and p.state_hash == digest and p.endpoint
                      and not p.client_mode and p.peer_id != self.peer_id)[:MAX_SUCCESSORS]
        if not found and self.cfg.checkpoint.dir:
            return (Voter(self.peer_id, self.plane.incarnation + 1),)
        return found

    async def retire(self) -> list[Retirement]:
        """Leave the scope for good: this peer's voter retires (stored before it is returned), and every
        retirement it ever stored, for the departure record.

        The retirement names successors for its round: the live peers at the round holding this peer's state,
        as last read. The others take them only once every voter of the round retired having accepted nothing
        there (round/certificate.py `successors_of`), so naming them is safe whatever this peer's view of the
        other voters: a view that is stale (a record read after its peer left) would otherwise let the last
        voters of a round leave it with nobody to decide it."""
        return await self.plane.retire(self.part.round, successors=self._successors_at(self.part.round))


def committed_state(part: Part) -> CommittedState:
    with part.committed() as state:
        return state

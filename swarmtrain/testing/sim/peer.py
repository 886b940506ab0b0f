"""One simulated peer: the production round driver, matchmaking, all-reduce, voter, proposer and heal code,
wired to the simulated network and DHT and a SimPart, with its disk in a directory that outlives a crash."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from swarmtrain.averaging.aggregate import Aggregation
from swarmtrain.averaging.allreduce import AllReduce
from swarmtrain.averaging.deciding import Decider
from swarmtrain.averaging.fetching import MaterialFetcher
from swarmtrain.averaging.matchmaking import STALE_BEATS, Matchmaker, MatchOutcome, overdue_after_s
from swarmtrain.averaging.material import Material, MaterialStore, check_shard, sharded_mean
from swarmtrain.averaging.network import reachable
from swarmtrain.averaging.reducer import ReducerRegistry, max_encoded_bytes
from swarmtrain.averaging.rounds import Electorate, Preview, RoundAverager, result_of
from swarmtrain.averaging.transport import ReduceTransport
from swarmtrain.averaging.voting import VoterService
from swarmtrain.compress import get_codec
from swarmtrain.config import RunConfig
from swarmtrain.diloco.averager import AverageResult, Delta
from swarmtrain.diloco.flat import state_digest
from swarmtrain.discovery import DiscoveryError, Heartbeat, PeerRecord
from swarmtrain.driver.loop import (
    RoundDriver,
    announce_departure,
    announce_stored_retirements,
    departure_record,
)
from swarmtrain.driver.part import CommittedState, Trained
from swarmtrain.driver.presence import Presence
from swarmtrain.round.ballots import Genesis, Value, Voter
from swarmtrain.round.certificate import Certificate, Retirement
from swarmtrain.round.group import Member
from swarmtrain.round.messages import Contact
from swarmtrain.rpc.buffers import BufferPool
from swarmtrain.rpc.errors import RpcError
from swarmtrain.sync.votes import FileVoteStore
from swarmtrain.testing.sim.dht import SimDiscovery, SimRegistry
from swarmtrain.testing.sim.legacy import LegacyVoter, without_stand_ins
from swarmtrain.testing.sim.network import (
    SimConsensusTransport,
    SimNetwork,
    SimNode,
    SimReduceTransport,
    SimStates,
)
from swarmtrain.testing.sim.part import Ledger, SimPart
from swarmtrain.trust.identity import verifier

__all__ = ["SimPeer", "SimPlane"]

log = logging.getLogger(__name__)

class SimPlane:
    """The RoundPlane of a simulated peer (driver/part.py)."""

    def __init__(self, *, scope: str, endpoint: str, matchmaker: Matchmaker, averager: RoundAverager,
                 voter: VoterService, states: SimStates, cfg: RunConfig) -> None:
        self.scope = scope
        self.endpoint = endpoint
        self.matchmaker = matchmaker
        self.averager = averager
        self.voter = voter
        self.states = states
        self.cfg = cfg
        self._live: Callable[[], AbstractContextManager[CommittedState]] | None = None

    async def match(self, round_index: int, member: Member) -> MatchOutcome:
        return await self.matchmaker.form_group(round_index, member)

    async def average(self, outcome: MatchOutcome, delta: Delta, *, base: str, electorate: Electorate,
                      preview: Preview) -> AverageResult:
        assert outcome.group is not None
        deadline = asyncio.get_running_loop().time() + self.cfg.averaging.allreduce_timeout_s
        return await self.averager.average(outcome.group, delta, base=base, electorate=electorate, deadline=deadline,
                                           preview=preview)

    async def certificates(self, peer: Contact, *, from_round: int) -> tuple[Certificate, ...]:
        try:
            return await self.averager.decider.transport.certificates(peer, scope=self.scope, from_round=from_round,
                                                                      timeout_s=self.cfg.rpc.call_timeout_s)
        except (RpcError, TimeoutError):
            return ()

    async def learn(self, round_index: int, electorate: Electorate, *, others: Sequence[Contact]) -> AverageResult:
        outcome = await self.averager.learn(round_index, electorate, others=others,
                                            timeout_s=self.cfg.rpc.call_timeout_s * 2)
        return result_of(round_index, outcome, self.averager.codec)

    async def fetch_state(self, endpoints: Sequence[str]) -> tuple[CommittedState, tuple[str, ...]]:
        state = await self.states.fetch(endpoints[0], timeout_s=self.cfg.rpc.call_timeout_s * 2)
        if not bool(torch.isfinite(state.theta_global).all()):
            raise ValueError("a state holding NaN or Inf")
        digest = state_digest(state.round, state.theta_global, state.outer_momentum, state.voters)
        return CommittedState(state.round, state.theta_global, state.outer_momentum, state.voters, digest,
                              state.certificates), (endpoints[0],)

    @property
    def incarnation(self) -> int:
        return self.voter.state.incarnation

    async def advanced(self, round_index: int, *, keep_from: int | None = None) -> None:
        await self.voter.advanced(round_index, keep_from=keep_from)

    async def keep_certificate(self, cert: Certificate) -> None:
        self.voter.certificates.add(cert)

    async def retire(self, current_round: int, *, successors: Sequence[Voter] = ()) -> list[Retirement]:
        await self.voter.retire(current_round=current_round, successors=successors)
        return self.voter.retirements()

    def retirements(self) -> list[Retirement]:
        return self.voter.retirements()

    def serve_state(self, live: Callable[[], AbstractContextManager[CommittedState]]) -> None:
        self._live = live

    async def aclose(self) -> None:
        return None


class SimPeer:
    """A simulated peer with index `index`; `start()` (again after `crash()`) brings it up from its disk."""

    def __init__(self, *, index: int, cfg: RunConfig, net: SimNetwork, registry: SimRegistry, ledger: Ledger,
                 directory: Path, skew_s: float, seed: int, numel: int, train_s: float, checkpoint_every: int,
                 dht_latency_s: float, rules: str = "paxos") -> None:
        self.index = index
        self.peer_id = f"p{index:02d}"
        self.endpoint = f"10.0.{index // 250}.{index % 250 + 1}:7000"
        self.cfg = cfg
        self.net = net
        self.registry = registry
        self.ledger = ledger
        self.directory = directory
        self.skew_s = skew_s
        self.seed = seed
        self.numel = numel
        self.train_s = train_s
        self.checkpoint_every = checkpoint_every
        self.dht_latency_s = dht_latency_s
        self.rules = rules  # "paxos", or "legacy": the voting rules before the decision was consensus (legacy.py)
        self.alive = False
        self.left = False  # left gracefully: never restarted
        self.leaving: asyncio.Future[None] | None = None
        self.announcing: asyncio.Future[bool] | None = None  # an earlier run's retirements, announced at start
        self.starts = 0
        self.tasks: list[asyncio.Task[object]] = []
        self.driver: RoundDriver | None = None
        self.part: SimPart | None = None
        self.node: SimNode | None = None
        self.discovery: SimDiscovery | None = None
        self.actions = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bring the peer up from its disk (a first start or a restart after a crash)."""
        assert not self.alive
        self.starts += 1
        cfg, a = self.cfg, self.cfg.averaging
        run = f"{cfg.train.run_id}/{cfg.train.run_nonce}"
        discovery = SimDiscovery(self.registry, run_id=cfg.train.run_id, record_ttl_s=cfg.discovery.record_ttl_s,
                                 peer_id=self.peer_id, skew_s=self.skew_s, run_key=cfg.rpc.run_key,
                                 latency_s=self.dht_latency_s, thawed=self.net.thawed)
        codec = get_codec(cfg.compress.codec)
        part = SimPart(peer_id=self.peer_id, numel=self.numel, outer=cfg.outer, directory=self.directory,
                       seed=self.seed, train_s=self.train_s, ledger=self.ledger, checkpoint_every=self.checkpoint_every,
                       now=discovery.now)
        buffers = BufferPool(max_bytes=1 << 20)
        reducer = ReducerRegistry(peer_id=self.peer_id, run_id=cfg.train.run_id, codec=codec,
                                  window_s=a.contribution_window_s, open_wait_s=a.allreduce_timeout_s, buffers=buffers,
                                  aggregation=Aggregation(a.aggregator, a.trim, gather=a.gathers(codec.name)))
        transport: ReduceTransport = SimReduceTransport(self.net, peer_id=self.peer_id, local=reducer)
        if self.rules == "legacy":
            transport = without_stand_ins(transport)
        allreduce = AllReduce(transport, reducer, peer_id=self.peer_id, codec=codec, cfg=a, buffers=buffers)
        reducer.standins.fetch_contribution = allreduce.fetch_contribution
        materials = MaterialStore(spill_dir=self.directory, scope="")
        consensus = SimConsensusTransport(self.net, peer_id=self.peer_id)
        fetcher = MaterialFetcher(transport=consensus, store=materials, scope="", self_id=self.peer_id,
                                  check=lambda layout, j, blob: check_shard(codec, layout, j, blob),
                                  max_bytes=max_encoded_bytes(self.numel) * 4)
        async def check_result(value: Value, material: Material) -> str:
            if value.base != part.digest:
                return ""  # not at the value's base: it cannot tell
            mine = await part.preview(sharded_mean(material, codec), value.next_voters)
            return ("" if mine == value.result
                    else f"its outer step gives {mine[:12]}, the value names {value.result[:12]}")

        voter_kw = dict(scope="", run=run, identity=discovery.identity, check_result=check_result,
                        store=FileVoteStore(self.directory, rng=random.Random(f"{self.seed}|{self.peer_id}|"
                                                                              f"{self.starts}")),
                        materials=materials, fetcher=fetcher, round_now=lambda: part.round, numel=self.numel,
                        codec=codec.name, offload=False)
        voter = (LegacyVoter(path=self.directory / "legacy-votes.json", **voter_kw) if self.rules == "legacy"
                 else VoterService(**voter_kw))  # type: ignore[arg-type]
        for cert in part.certificates:  # resumed with the checkpoint: shown to learners as before the crash
            voter.certificates.add(cert)
        verify = verifier(discovery.key_binding)
        decider = Decider(transport=consensus, run=run, scope="", me=Contact(self.peer_id, self.endpoint),
                          verify=verify, materials=materials, fetcher=fetcher)
        averager = RoundAverager(allreduce=allreduce, voter=voter, decider=decider, materials=materials, codec=codec,
                                 scope="", decision_timeout_s=cfg.rpc.call_timeout_s * 2)
        matchmaker = Matchmaker(discovery, min_peers=a.min_peers, window_s=a.matchmaking_timeout_s,
                                commit_timeout_s=a.allreduce_timeout_s, poll_s=0.1,
                                stale_after_s=STALE_BEATS * cfg.discovery.heartbeat_s,
                                overdue_s=overdue_after_s(cfg.discovery.heartbeat_s),
                                clock_margin_s=cfg.discovery.heartbeat_s,
                                probe=None if self.rules == "legacy" else  # the rules before it, as stand-ins
                                lambda r: reachable(consensus, r, scope="", timeout_s=cfg.rpc.call_timeout_s))
        plane = SimPlane(scope="", endpoint=self.endpoint, matchmaker=matchmaker, averager=averager, voter=voter,
                         states=SimStates(self.net, peer_id=self.peer_id), cfg=cfg)
        node = SimNode(self.peer_id, self.endpoint, reducer=reducer, voter=voter, state=part.committed)
        self.net.add(node)
        loop = asyncio.get_running_loop()
        presence = Presence(cfg.discovery, run_id=cfg.train.run_id, clock=loop.time)

        def record() -> PeerRecord:
            return PeerRecord(run_id=cfg.train.run_id, peer_id=self.peer_id, endpoint=self.endpoint, role="worker",
                              round=part.round, state_hash=part.digest, clock_offset_s=presence.clock_offset_s,
                              round_ends_at=part.round_ends_at, incarnation=voter.state.incarnation)

        heartbeat = Heartbeat(discovery, current=record, heartbeat_s=cfg.discovery.heartbeat_s, now=discovery.now,
                              timeout_s=cfg.rpc.call_timeout_s)

        def member(trained: Trained) -> Member:
            self.actions += 1
            return Member(self.peer_id, self.endpoint, steps_per_s=trained.steps_per_s, state_hash=part.digest,
                          incarnation=voter.state.incarnation)

        genesis_seen: list[Genesis] = []

        async def genesis() -> Genesis | None:
            if not genesis_seen:
                with contextlib.suppress(Exception):
                    run_record = await discovery.fetch_run(coordinator_id="coordinator",
                                                           timeout_s=cfg.rpc.call_timeout_s)
                    if run_record is not None and "" in run_record.genesis:
                        genesis_seen.append(run_record.genesis[""])
            return genesis_seen[0] if genesis_seen else None

        async def beat() -> None:
            with contextlib.suppress(DiscoveryError, TimeoutError):  # the periodic beat retries
                await heartbeat.beat()

        def beat_soon() -> None:
            self._spawn(beat())

        driver = RoundDriver(part=part, plane=plane, discovery=discovery, cfg=cfg, role="worker", member=member,
                             run=run, verify=verify, presence=presence, genesis=genesis, emit=lambda e: None,
                             changed=beat_soon)
        self.driver, self.part, self.node, self.discovery = driver, part, node, discovery
        self.alive = True
        self.stop = asyncio.Event()
        self.rounds_ended = asyncio.Event()  # its driver's loop returned (stopped, done or failed)

        async def life() -> None:
            while True:  # a peer comes up once the DHT takes its record (a frozen one waits)
                try:
                    await heartbeat.beat()
                    break
                except (DiscoveryError, TimeoutError):
                    await asyncio.sleep(cfg.discovery.heartbeat_s)
            self._spawn(heartbeat.loop())
            self.announcing = asyncio.ensure_future(announce_stored_retirements(discovery, {"": plane.retirements()},
                                                                                 cfg=cfg))
            self.tasks.append(self.announcing)
            try:
                await driver.run(self.stop)
            finally:
                self.rounds_ended.set()

        self._spawn(life())

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.append(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[object]) -> None:
        if task in self.tasks:
            self.tasks.remove(task)
        if not task.cancelled() and task.exception() is not None:
            e = task.exception()
            self.net.bugs.append(f"{self.peer_id}: {type(e).__name__}: {e}")
            log.error("%s: task failed", self.peer_id, exc_info=e)

    async def leave(self) -> None:
        """Leave gracefully, as a SIGTERM does: stop the rounds, hand over if the round it is a voter of needs it
        (`RoundDriver.hand_over`), retire the voter (stored, then announced in a departure record, sealed like
        every record), stop; it does not come back."""
        if not self.alive or self.driver is None or self.discovery is None:
            return
        self.stop.set()
        if self.announcing is not None:
            self.announcing.cancel()  # its departure record below names those retirements too, and must be the last
        driver, discovery = self.driver, self.discovery
        with contextlib.suppress(Exception):  # best effort, as the daemon's leave is
            if self.rules != "legacy":  # a leave before the decision was consensus retired at once
                a = self.cfg.averaging  # the daemon leaves once its loop returned: the attempt in flight is done
                await asyncio.wait_for(self.rounds_ended.wait(), timeout=2 * (a.matchmaking_timeout_s
                                                                              + a.allreduce_timeout_s))
                await driver.hand_over()
            retirements = await driver.retire()
            record = departure_record(run_id=self.cfg.train.run_id, peer_id=self.peer_id,
                                      retirements={"": retirements}, now=discovery.now())
            with contextlib.suppress(DiscoveryError, TimeoutError):  # it expires anyway
                await discovery.withdraw(timeout_s=self.cfg.rpc.call_timeout_s)
            await announce_departure(discovery, record, cfg=self.cfg)
        # A peer killed before its leave was done did not leave: it is a crashed peer, restarted from its
        # directory like any other (its voter resumes; a supervisor restarts a process that died).
        self.left = self.alive
        self.crash()

    def crash(self) -> None:
        """Die at once: every task cancelled, nothing but the directory kept (with the checkpoints taken)."""
        if not self.alive:
            return
        self.alive = False
        if self.part is not None:
            self.part.flush()
        for task in list(self.tasks):
            task.cancel()
        self.tasks.clear()
        if self.node is not None:
            self.node.kill()
        if self.discovery is not None:
            self.discovery._closed = True
        self.driver = self.part = self.node = None

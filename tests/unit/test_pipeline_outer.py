"""A pipeline part's outer rounds (pipeline/outer.py) through the round driver, against a scripted plane: when
a round starts, what its commit does to θ_global and to θ_local with inner steps taken meanwhile, that an abort
changes nothing, that a holder behind its part heals to the state a majority of its holders announce (verified
by digest, momentum and voters included) and to nothing else, and that an idle holder joins the round its
part's other holders wait in. Matchmaking scopes: entries of one part never reach another."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from swarmtrain.averaging.matchmaking import MatchOutcome
from swarmtrain.config import RunConfig, load_config
from swarmtrain.diloco.averager import AverageResult
from swarmtrain.diloco.flat import state_digest
from swarmtrain.discovery import (
    InMemoryDiscovery,
    InMemoryRegistry,
    MatchEntry,
    PeerRecord,
    ScopedDiscovery,
    StageLoad,
)
from swarmtrain.driver.part import CommittedState
from swarmtrain.pipeline.outer import PartRounds
from swarmtrain.round.ballots import Ballot, Genesis, MaterialLayout, ShardDigest, Value, Voter
from swarmtrain.round.certificate import Certificate
from swarmtrain.round.group import Group, Member
from swarmtrain.telemetry import HealEvent, StageRoundEvent

pytestmark = pytest.mark.unit

CFG = load_config(overrides=["diloco.inner_steps=2", "outer.lr=0.5", "outer.momentum=0", "outer.nesterov=false",
                             "averaging.min_peers=2", "discovery.heartbeat_s=0.05",
                             "averaging.matchmaking_timeout_s=1"])
NEXT = (Voter("a", 0), Voter("b", 0))  # the voters the scripted commits name for the next round
_PORTS = itertools.count(2)


class ScriptedPlane:
    """A round plane whose attempts end with the results the test queues; its state transfer serves `donor`."""

    scope = "stage0"
    endpoint = "127.0.0.1:1"
    incarnation = 0

    def __init__(self) -> None:
        self.deltas: list[torch.Tensor] = []
        self.results: asyncio.Queue[tuple[bool, torch.Tensor | None, str]] = asyncio.Queue()
        self.donor: CommittedState | None = None
        self.bases: list[str] = []
        self.kept: list[Certificate] = []
        self.advanced_to: list[int] = []
        self.retired_at: int | None = None
        self.me = ""

    async def match(self, round_index: int, member: Member) -> MatchOutcome:
        self.me = member.peer_id
        return MatchOutcome(round_index, Group("r", round_index, (member,)))

    async def average(self, outcome: MatchOutcome, delta: torch.Tensor, *, base: str, **_: Any) -> AverageResult:
        self.deltas.append(delta.clone())
        self.bases.append(base)
        committed, mean, reason = await self.results.get()
        r = outcome.round
        if not committed:
            return AverageResult(r, False, None, reason=reason)
        assert mean is not None
        members = tuple(sorted((self.me, "other")))
        value = Value(scope=self.scope, round=r, session="s", base=base, contributors=members, next_voters=NEXT,
                      layout=MaterialLayout(mean.numel(), "none", False,
                                            (ShardDigest(0, mean.numel(), 4 * mean.numel(), "d"),)),
                      result="")
        cert = Certificate(run="r/n", ballot=Ballot(0, 0, 0, "s", "a"), value=value, grants=())
        return AverageResult(r, True, mean, members=members, certificate=cert)

    async def certificates(self, peer: object, *, from_round: int) -> tuple[Certificate, ...]:
        return ()

    async def learn(self, round_index: int, electorate: object, *, others: Sequence[object]) -> AverageResult:
        return AverageResult(round_index, False, None, reason="nothing to learn here")

    async def fetch_state(self, endpoints: Sequence[str]) -> tuple[CommittedState, tuple[str, ...]]:
        assert self.donor is not None
        return self.donor, tuple(endpoints)

    async def advanced(self, round_index: int, *, keep_from: int | None = None) -> None:
        self.advanced_to.append(round_index)

    async def keep_certificate(self, cert: Certificate) -> None:
        self.kept.append(cert)

    async def retire(self, current_round: int, *, successors: object = ()) -> list[object]:
        self.retired_at = current_round
        return []

    def serve_state(self, live: object) -> None:
        pass

    async def aclose(self) -> None:
        pass


def _setup(registry: InMemoryRegistry) -> tuple[InMemoryDiscovery, ScopedDiscovery]:
    d = InMemoryDiscovery(registry, run_id="r", record_ttl_s=60.0)
    return d, ScopedDiscovery(d, scope="stage0", member=lambda p: p.role == "stage_server" and p.stage == 0)


async def _other(registry: InMemoryRegistry, **fields: object) -> InMemoryDiscovery:
    """Another server of stage 0, announced with `fields`."""
    d = InMemoryDiscovery(registry, run_id="r", record_ttl_s=60.0)
    await d.announce(PeerRecord(run_id="r", peer_id=d.peer_id, endpoint=f"127.0.0.1:{next(_PORTS)}",
                                role="stage_server", server=StageLoad(stage=0), heartbeat_at=d.now(), **fields),  # type: ignore[arg-type]
                     timeout_s=1.0)
    return d


def _rounds(params: list[torch.Tensor], plane: ScriptedPlane, scoped: ScopedDiscovery, events: list[object], *,
            cfg: RunConfig = CFG, **kw: Any) -> PartRounds:
    async def genesis() -> Genesis:
        return Genesis(0, NEXT)

    return PartRounds(params, plane=plane, discovery=scoped, cfg=cfg, stage=0,  # type: ignore[arg-type]
                      moving=contextlib.nullcontext, emit=events.append, apply_now=True, role="stage_server",
                      run="r/n", verify=lambda *_: True, genesis=genesis, incarnation=lambda: 0, **kw)


async def _until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(5):
        while not check():
            await asyncio.sleep(0.01)


async def _waiting(rounds: PartRounds) -> None:
    """Until the driver waits for the round's Δ: it is taken at a step (the weights still) from then on."""
    await _until(lambda: rounds.part._want)


def test_a_commit_moves_theta_global_and_keeps_the_steps_taken_meanwhile() -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        _, scoped = _setup(registry)
        await _other(registry)
        p = torch.tensor([1.0, 2.0, 3.0, 4.0])
        plane, events = ScriptedPlane(), []
        rounds = _rounds([p], plane, scoped, events)
        await rounds.join()  # reads the other holder: not alone, round 0 everywhere, nothing to heal
        rounds.start()
        try:
            theta0, base = p.clone(), rounds.hash
            await _waiting(rounds)
            p.sub_(0.1)
            rounds.stepped()
            await asyncio.sleep(0.05)
            assert not plane.deltas  # 1 of 2 steps
            p.sub_(0.1)
            rounds.stepped()  # H = 2: Δ = θ_global − θ_local goes out
            await _until(lambda: bool(plane.deltas))
            torch.testing.assert_close(plane.deltas[0], torch.full((4,), 0.2))
            assert plane.bases == [base]  # averaged from the committed state's digest
            p.sub_(1.0)  # an inner step while the round averages
            rounds.stepped()
            mean = torch.full((4,), 0.4)
            await plane.results.put((True, mean, ""))
            await _until(lambda: rounds.round == 1)
            new_global = theta0 - 0.5 * mean
            torch.testing.assert_close(rounds.theta, new_global)
            torch.testing.assert_close(p, new_global - 1.0)  # θ_global_new plus the step taken meanwhile
            # The digest covers round, θ_global, the momentum (none here) and the voters the commit named.
            assert rounds.part.voters == NEXT and rounds.hash == state_digest(1, rounds.theta, None, NEXT)
            assert rounds.part.steps == 1  # the step after the Δ belongs to the next round
            assert plane.advanced_to == [1] and len(plane.kept) == 1
            await _until(lambda: bool(events))
            (event,) = events
            assert isinstance(event, StageRoundEvent) and event.committed and event.round == 0 and event.steps == 2
            assert event.hash == rounds.hash and event.members == tuple(sorted((plane.me, "other")))
        finally:
            await rounds.aclose()

    asyncio.run(main())


def test_an_aborted_round_changes_nothing_and_its_delta_is_averaged_again() -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        _, scoped = _setup(registry)
        await _other(registry)
        p = torch.zeros(3)
        plane, events = ScriptedPlane(), []
        rounds = _rounds([p], plane, scoped, events)
        await rounds.join()
        rounds.start()
        try:
            await _waiting(rounds)
            for _ in range(2):
                p.add_(1.0)
                rounds.stepped()
            await _until(lambda: bool(plane.deltas))
            await plane.results.put((False, None, "too few peers"))
            await _until(lambda: bool(events))
            assert rounds.round == 0 and torch.equal(p, torch.full((3,), 2.0))
            assert torch.equal(rounds.theta, torch.zeros(3))
            assert isinstance(events[0], StageRoundEvent) and not events[0].committed
            assert events[0].reason == "too few peers"
            # The next attempt averages the same Δ again: never retaken, the steps meanwhile stay in θ_local.
            await _until(lambda: len(plane.deltas) == 2)
            torch.testing.assert_close(plane.deltas[1], torch.full((3,), -2.0))
        finally:
            await rounds.aclose()

    asyncio.run(main())


def test_a_holder_alone_in_its_part_does_not_try() -> None:
    async def main() -> None:
        _, scoped = _setup(InMemoryRegistry())
        p = torch.zeros(2)
        plane = ScriptedPlane()
        rounds = _rounds([p], plane, scoped, [])
        await rounds.join()
        rounds.start()
        try:
            for _ in range(5):
                rounds.stepped()
            await asyncio.sleep(0.2)
            assert not plane.deltas
        finally:
            await rounds.aclose()

    asyncio.run(main())


def test_a_late_holder_joins_the_round_another_holder_announced_over() -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        d, scoped = _setup(registry)
        await _other(registry, round_ends_at=d.now() - 1.0)  # its steps of round 0 are over
        plane = ScriptedPlane()
        rounds = _rounds([torch.zeros(2)], plane, scoped, [])
        await rounds.join()
        rounds.start()
        try:
            await _waiting(rounds)  # it read the other's record first
            rounds.stepped()  # one step of two: starts anyway
            await _until(lambda: bool(plane.deltas))
        finally:
            await rounds.aclose()

    asyncio.run(main())


def test_a_round_in_flight_announces_when_its_steps_ended() -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        d, scoped = _setup(registry)
        await _other(registry)
        plane = ScriptedPlane()
        rounds = _rounds([torch.zeros(2)], plane, scoped, [])
        await rounds.join()
        rounds.start()
        try:
            await _waiting(rounds)
            rounds.stepped()
            before = d.now()
            rounds.stepped()  # H = 2: the round starts, and its window is open to the part's others
            ends = rounds.round_ends_at()
            assert before <= ends <= d.now() and not rounds.idle
        finally:
            await rounds.aclose()

    asyncio.run(main())


def test_an_idle_holder_joins_the_round_its_part_waits_in_and_leaves_it_at_theta_global() -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        d, scoped = _setup(registry)
        await _other(registry, round_ends_at=d.now() - 1.0)  # its steps of round 0 are over: it waits
        p = torch.tensor([1.0, 2.0])
        plane, events = ScriptedPlane(), []
        rounds = _rounds([p], plane, scoped, events, still=contextlib.nullcontext)
        await rounds.join()
        rounds.start()
        try:
            await _until(lambda: bool(plane.deltas))  # no step taken: it takes Δ itself, held still
            assert torch.equal(plane.deltas[0], torch.zeros(2))  # its weights as they are
            mean = torch.tensor([0.2, -0.4])
            await plane.results.put((True, mean, ""))
            await _until(lambda: rounds.round == 1)
            torch.testing.assert_close(p, torch.tensor([0.9, 2.2]))  # θ_global of round 1
            torch.testing.assert_close(rounds.theta, p)
            await _until(lambda: bool(events))
            assert isinstance(events[0], StageRoundEvent) and events[0].committed and events[0].steps == 0
        finally:
            await rounds.aclose()
            await rounds.aclose()  # again: nothing

    asyncio.run(main())


def test_a_holder_behind_its_part_heals_to_the_state_its_holders_announce_only() -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        _, scoped = _setup(registry)
        cfg = CFG.replace(outer={"momentum": 0.9})
        good, momentum, voters = torch.tensor([5.0, 6.0]), torch.tensor([0.5, 0.5]), (Voter("x", 1),)
        digest = state_digest(3, good, momentum, voters)
        for _ in range(2):
            await _other(registry, round=3, state_hash=digest)
        honest = CommittedState(3, good.clone(), momentum.clone(), voters, digest)
        # Each of θ, the momentum and the voters forged on its own: every one changes the digest, refused.
        for forged in (dataclasses.replace(honest, theta_global=torch.tensor([5.0, 7.0])),
                       dataclasses.replace(honest, outer_momentum=torch.tensor([9.0, 9.0])),
                       dataclasses.replace(honest, voters=(Voter("liar", 0),))):
            p, plane, events = torch.zeros(2), ScriptedPlane(), []
            rounds = _rounds([p], plane, scoped, events, cfg=cfg)
            plane.donor = dataclasses.replace(forged, digest=state_digest(3, forged.theta_global,
                                                                           forged.outer_momentum, forged.voters))
            await rounds.join()
            assert rounds.round == 0 and torch.equal(p, torch.zeros(2)) and not events
        p = torch.zeros(2)
        plane, events, healed = ScriptedPlane(), [], []
        rounds = _rounds([p], plane, scoped, events, cfg=cfg, on_heal=healed.append)
        plane.donor = honest
        await rounds.join()
        assert rounds.round == 3 and torch.equal(p, good) and torch.equal(rounds.theta, good) and healed == [3]
        buf = rounds.part.outer.momentum_buffer
        assert buf is not None and torch.equal(buf, momentum) and rounds.part.voters == voters
        assert rounds.hash == digest
        (event,) = events
        assert isinstance(event, HealEvent) and event.to_round == 3 and event.hash == digest

    asyncio.run(main())


def test_a_lone_holder_ahead_is_not_believed_against_the_others() -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        _, scoped = _setup(registry)
        liar = state_digest(5, torch.ones(2), None, ())
        await _other(registry, round=5, state_hash=liar)
        await _other(registry, round=4, state_hash=state_digest(4, torch.zeros(2), None, ()))
        await _other(registry, round=4, state_hash=state_digest(4, 2 * torch.ones(2), None, ()))
        plane, events = ScriptedPlane(), []
        rounds = _rounds([torch.zeros(2)], plane, scoped, events)
        plane.donor = CommittedState(5, torch.ones(2), None, (), liar)
        await rounds.join()  # three ahead, no state has a strict majority of them: no heal, whatever is served
        assert rounds.round == 0 and not events

    asyncio.run(main())


def test_stop_following_lets_the_round_in_flight_land_and_starts_no_other() -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        _, scoped = _setup(registry)
        await _other(registry)
        p = torch.zeros(2)
        plane = ScriptedPlane()
        rounds = _rounds([p], plane, scoped, [])
        await rounds.join()
        rounds.start()
        try:
            await _waiting(rounds)
            for _ in range(2):
                p.add_(1.0)
                rounds.stepped()
            await _until(lambda: bool(plane.deltas))
            rounds.stop_following()  # a server leaving its stage: the round it sent goes on
            await plane.results.put((True, torch.full((2,), -2.0), ""))
            await rounds.finish(timeout_s=5)
            assert rounds.round == 1 and rounds.idle
            for _ in range(4):
                rounds.stepped()
            await asyncio.sleep(0.1)
            assert len(plane.deltas) == 1  # no round after it
            await rounds.aclose(retire=True)
            assert plane.retired_at == 1
        finally:
            await rounds.aclose()

    asyncio.run(main())


def test_scopes_keep_their_matchmaking_apart() -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        d = InMemoryDiscovery(registry, run_id="r", record_ttl_s=60.0)
        stage0 = ScopedDiscovery(d, scope="stage0", member=lambda p: p.stage == 0)
        stage1 = ScopedDiscovery(d, scope="stage1", member=lambda p: p.stage == 1)
        entry = MatchEntry(run_id="r", round=0, member=Member(peer_id=d.peer_id, endpoint="127.0.0.1:1"),
                           posted_at=d.now())
        await stage0.post_entry(entry, keep_s=60, timeout_s=1)
        assert [e.member.peer_id for e in await stage0.round_entries(0, 0, timeout_s=1)] == [d.peer_id]
        assert await stage1.round_entries(0, 0, timeout_s=1) == ()
        assert await d.round_entries(0, 0, timeout_s=1) == ()  # nor the whole-model rounds
        await _other(registry)
        assert len(await stage0.live_peers(timeout_s=1)) == 1 and await stage1.live_peers(timeout_s=1) == ()
        with pytest.raises(ValueError, match="path segment"):
            ScopedDiscovery(d, scope="a/b", member=lambda p: True)

    asyncio.run(main())

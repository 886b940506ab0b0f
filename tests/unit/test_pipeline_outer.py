"""A pipeline part's outer rounds (pipeline/outer.py) against a scripted data plane: when a round starts,
what its commit does to θ_global and to θ_local with inner steps taken meanwhile, that an abort changes
nothing, that a holder behind its part heals to the state its holders announce (and to nothing else), and
that an idle holder joins the round its part's other holders wait in.
Matchmaking scopes: entries of one part never reach another."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

import pytest
import torch

from swarmtrain.averaging.group import Member
from swarmtrain.averaging.protocol import AverageResult
from swarmtrain.config import load_config
from swarmtrain.diloco.flat import flat_hash
from swarmtrain.discovery import InMemoryDiscovery, InMemoryRegistry, MatchEntry, PeerRecord, ScopedDiscovery
from swarmtrain.peer.services import LivePeerState, PeerState
from swarmtrain.pipeline.outer import PartRounds
from swarmtrain.telemetry import HealEvent, StageRoundEvent

pytestmark = pytest.mark.unit

CFG = load_config(overrides=["diloco.inner_steps=2", "outer.lr=0.5", "outer.momentum=0", "outer.nesterov=false",
                             "averaging.min_peers=2", "discovery.heartbeat_s=0.05"])


class ScriptedPlane:
    """A DataPlane whose rounds end with the result the test gives; its state transfer serves `donor`."""

    def __init__(self) -> None:
        self.deltas: list[torch.Tensor] = []
        self.results: asyncio.Queue[AverageResult] = asyncio.Queue()
        self.published: list[str] = []
        self.donor: PeerState | None = None
        self.live: LivePeerState | None = None

    @property
    def endpoint(self) -> str:
        return "127.0.0.1:1"

    async def average(self, round_index: int, delta: torch.Tensor, **_: object) -> AverageResult:
        self.deltas.append(delta.clone())
        return await self.results.get()

    def serve_state(self, live: LivePeerState) -> None:
        self.live = live

    def publish_state(self, state: PeerState) -> None:
        self.published.append(state.state_hash)

    async def fetch_state(self, endpoints: Sequence[str], *,
                          param_shapes: object = None) -> tuple[PeerState, tuple[str, ...]]:
        assert self.donor is not None
        return self.donor, tuple(endpoints)


def _setup(registry: InMemoryRegistry) -> tuple[InMemoryDiscovery, ScopedDiscovery]:
    d = InMemoryDiscovery(registry, run_id="r", record_ttl_s=60.0)
    return d, ScopedDiscovery(d, scope="stage0", member=lambda p: p.role == "stage_server" and p.stage == 0)


async def _other(registry: InMemoryRegistry, **fields: object) -> InMemoryDiscovery:
    """Another server of stage 0, announced with `fields`."""
    d = InMemoryDiscovery(registry, run_id="r", record_ttl_s=60.0)
    await d.announce(PeerRecord(run_id="r", peer_id=d.peer_id, endpoint="127.0.0.1:2", role="stage_server", stage=0,
                                heartbeat_at=d.now(), **fields), timeout_s=1.0)  # type: ignore[arg-type]
    return d


def _rounds(params: list[torch.Tensor], plane: ScriptedPlane, scoped: ScopedDiscovery,
            events: list[object], *, on_heal: Callable[[int], None] | None = None) -> PartRounds:
    return PartRounds(params, plane=plane, discovery=scoped, cfg=CFG, stage=0, still=contextlib.nullcontext,
                      emit=events.append, apply_now=True, on_heal=on_heal)


async def _until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(5):
        while not check():
            await asyncio.sleep(0.01)


def test_a_commit_moves_theta_global_and_keeps_the_steps_taken_meanwhile() -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        _, scoped = _setup(registry)
        await _other(registry)
        p = torch.tensor([1.0, 2.0, 3.0, 4.0])
        plane, events = ScriptedPlane(), []
        rounds = _rounds([p], plane, scoped, events)
        await rounds.join()  # reads the other holder: not alone, round 0 everywhere, nothing to heal
        theta0 = p.clone()
        p.sub_(0.1)
        rounds.stepped()
        assert not plane.deltas  # 1 of 2 steps
        p.sub_(0.1)
        rounds.stepped()  # H = 2: Δ = θ_global − θ_local goes out
        await _until(lambda: bool(plane.deltas))
        torch.testing.assert_close(plane.deltas[0], torch.full((4,), 0.2))
        p.sub_(1.0)  # an inner step while the round averages
        rounds.stepped()
        mean = torch.full((4,), 0.4)
        await plane.results.put(AverageResult(round=0, committed=True, mean=mean, members=("a", "b")))
        await _until(lambda: rounds.round == 1)
        new_global = theta0 - 0.5 * mean
        torch.testing.assert_close(rounds.theta, new_global)
        torch.testing.assert_close(p, new_global - 1.0)  # θ_global_new plus the step taken meanwhile
        assert rounds.hash == flat_hash(new_global) and plane.published[-1] == rounds.hash
        assert rounds.steps == 1  # the step after the snapshot belongs to the next round
        (event,) = events
        assert isinstance(event, StageRoundEvent) and event.committed and event.round == 0 and event.steps == 2
        assert event.hash == rounds.hash and event.members == ("a", "b")

    asyncio.run(main())


def test_an_aborted_round_changes_nothing_and_its_steps_go_into_the_next_delta() -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        _, scoped = _setup(registry)
        await _other(registry)
        p = torch.zeros(3)
        plane, events = ScriptedPlane(), []
        rounds = _rounds([p], plane, scoped, events)
        await rounds.join()
        for _ in range(2):
            p.add_(1.0)
            rounds.stepped()
        await _until(lambda: bool(plane.deltas))
        await plane.results.put(AverageResult(round=0, committed=False, mean=None, reason="too few peers"))
        await _until(lambda: bool(events))
        assert rounds.round == 0 and torch.equal(p, torch.full((3,), 2.0)) and torch.equal(rounds.theta, torch.zeros(3))
        assert rounds.steps == 2 and isinstance(events[0], StageRoundEvent) and not events[0].committed
        assert events[0].reason == "too few peers"
        p.add_(1.0)
        rounds.stepped()  # 3 steps now: the next Δ carries all of them
        await _until(lambda: len(plane.deltas) == 2)
        torch.testing.assert_close(plane.deltas[1], torch.full((3,), -3.0))

    asyncio.run(main())


def test_a_holder_alone_in_its_part_does_not_try() -> None:
    async def main() -> None:
        _, scoped = _setup(InMemoryRegistry())
        p = torch.zeros(2)
        plane = ScriptedPlane()
        rounds = _rounds([p], plane, scoped, [])
        await rounds.join()
        for _ in range(5):
            rounds.stepped()
        await asyncio.sleep(0.05)
        assert not plane.deltas

    asyncio.run(main())


def test_a_late_holder_joins_the_round_another_holder_announced_over() -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        d, scoped = _setup(registry)
        await _other(registry, round_ends_at=d.now() - 1.0)  # its steps of round 0 are over
        plane = ScriptedPlane()
        rounds = _rounds([torch.zeros(2)], plane, scoped, [])
        await rounds.join()
        rounds.stepped()  # one step of two: starts anyway
        await _until(lambda: bool(plane.deltas))

    asyncio.run(main())


def test_a_round_in_flight_announces_when_its_steps_ended() -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        d, scoped = _setup(registry)
        await _other(registry)
        rounds = _rounds([torch.zeros(2)], ScriptedPlane(), scoped, [])
        await rounds.join()
        rounds.stepped()
        before = d.now()
        rounds.stepped()  # H = 2: the round starts, and its window is open to the part's others
        ends = rounds.round_ends_at()
        assert before <= ends <= d.now()

    asyncio.run(main())


def test_an_idle_holder_joins_the_round_its_part_waits_in_and_leaves_it_at_theta_global() -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        d, scoped = _setup(registry)
        await _other(registry, round_ends_at=d.now() - 1.0)  # its steps of round 0 are over: it waits
        p = torch.tensor([1.0, 2.0])
        plane, events = ScriptedPlane(), []
        rounds = PartRounds([p], plane=plane, discovery=scoped, cfg=CFG, stage=0, still=contextlib.nullcontext,
                            emit=events.append, apply_now=True, hold=contextlib.nullcontext)
        await rounds.join()
        rounds.start()
        try:
            await _until(lambda: bool(plane.deltas))  # no step taken: the follower loop starts the round
            assert torch.equal(plane.deltas[0], torch.zeros(2))  # its weights as they are
            mean = torch.tensor([0.2, -0.4])
            await plane.results.put(AverageResult(round=0, committed=True, mean=mean, members=("a", "b")))
            await _until(lambda: rounds.round == 1)
            torch.testing.assert_close(p, torch.tensor([0.9, 2.2]))  # θ_global of round 1
            torch.testing.assert_close(rounds.theta, p)
            (event,) = events
            assert isinstance(event, StageRoundEvent) and event.committed and event.steps == 0
        finally:
            await rounds.aclose()
            await rounds.aclose()  # again: nothing

    asyncio.run(main())


def test_a_holder_behind_its_part_heals_to_the_announced_state_only() -> None:
    async def main() -> None:
        registry = InMemoryRegistry()
        _, scoped = _setup(registry)
        good = torch.tensor([5.0, 6.0])
        momentum = torch.tensor([0.5, 0.5])
        await _other(registry, round=3, state_hash=flat_hash(good))
        p = torch.zeros(2)
        plane, events, healed = ScriptedPlane(), [], []
        rounds = PartRounds([p], plane=plane, discovery=scoped, cfg=CFG.replace(outer={"momentum": 0.9}), stage=0,
                            still=contextlib.nullcontext, emit=events.append, apply_now=True, on_heal=healed.append)
        plane.donor = PeerState(round=3, theta_global=torch.tensor([5.0, 7.0]), outer_momentum=momentum)
        await rounds.join()  # serves another θ than the hash announced: refused
        assert rounds.round == 0 and torch.equal(p, torch.zeros(2)) and not events
        plane.donor = PeerState(round=3, theta_global=good.clone(), outer_momentum=momentum)
        await rounds.join()
        assert rounds.round == 3 and torch.equal(p, good) and torch.equal(rounds.theta, good) and healed == [3]
        assert rounds.outer.momentum_buffer is not None and torch.equal(rounds.outer.momentum_buffer, momentum)
        (event,) = events
        assert isinstance(event, HealEvent) and event.to_round == 3 and event.hash == flat_hash(good)

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

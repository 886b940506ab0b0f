"""A heal by the majority's state whose plan the swarm overtook (driver/loop.py `heal`, driver/downloads.py): the live
peers read when the heal began still announce round 1, but the donors, asked, already serve round 2. The peer
reads the roster again and adopts the round-2 state it downloaded once; it does not download the state from
every donor of the old plan to refuse each. A donor whose newer round the roster does not bear out is refused."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from swarmtrain.config import RunConfig
from swarmtrain.driver.loop import RoundDriver
from swarmtrain.driver.part import CommittedState
from swarmtrain.round import Heal

pytestmark = pytest.mark.unit

NUMEL = 4


@dataclass(frozen=True)
class Record:
    peer_id: str
    round: int
    state_hash: str
    endpoint: str
    role: str = "worker"
    round_ends_at: float = 0.0
    heartbeat_at: float = 0.0


def _state(round_index: int, digest: str) -> CommittedState:
    return CommittedState(round=round_index, theta_global=torch.full((NUMEL,), float(round_index)),
                          outer_momentum=None, digest=digest)


class Swarm:
    """The records the DHT returns (the next list on each read) and the states the donors serve."""

    def __init__(self, reads: list[list[Record]], serves: dict[str, CommittedState]) -> None:
        self.reads, self.serves = reads, serves
        self.downloads: list[str] = []
        self.peer_id = "me"

    # discovery
    def now(self) -> float:
        return 0.0

    async def live_peers(self, *, timeout_s: float) -> Sequence[Record]:
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]

    # plane
    scope = ""

    async def fetch_state(self, endpoints: Sequence[str]) -> tuple[CommittedState, tuple[str, ...]]:
        (endpoint,) = endpoints
        self.downloads.append(endpoint)
        return self.serves[endpoint], (endpoint,)

    async def certificates(self, contact: Any, *, from_round: int) -> list[Any]:
        return []

    async def advanced(self, round_index: int, *, keep_from: int) -> None:
        pass

    async def keep_certificate(self, cert: Any) -> None:
        pass


class Part:
    def __init__(self) -> None:
        self.round, self.voters, self.digest = 0, (), "h0"
        self.adopted: list[CommittedState] = []

    async def adopt(self, state: CommittedState, *, keep_progress: bool) -> None:
        self.adopted.append(state)
        self.round, self.digest = state.round, state.digest

    def replay_from(self) -> int:
        return self.round

    def joined(self, round_index: int, ends_at: float | None) -> None:
        pass


class Presence:
    def correct(self, discovery: Any, peers: Any) -> None:
        pass

    def rebootstrap_due(self) -> bool:
        return False


def _driver(swarm: Swarm, part: Part) -> RoundDriver:
    # no voters and no genesis: nothing to learn from certificates, so the heal takes the majority's state (a short
    # matchmaking window: the time the electorate waits for a genesis)
    cfg = RunConfig().replace(rpc={"state_donors": 1}, averaging={"min_peers": 2, "matchmaking_timeout_s": 0.01})

    async def no_genesis() -> None:
        return None

    return RoundDriver(part=part, plane=swarm, discovery=swarm, cfg=cfg, role="worker",  # type: ignore[arg-type]
                       member=lambda t: None, run="run", verify=lambda *a: None,  # type: ignore[arg-type,return-value]
                       presence=Presence(), genesis=no_genesis, emit=lambda e: None)  # type: ignore[arg-type]


def _heal(swarm: Swarm, part: Part) -> bool:
    async def main() -> bool:
        driver = _driver(swarm, part)
        action = driver.machine.next()
        assert isinstance(action, Heal)
        return await driver.heal(action)
    return asyncio.run(main())


def _records(names: str, round_index: int, digest: str) -> list[Record]:
    return [Record(n, round_index, digest, f"10.0.0.{i}:7000") for i, n in enumerate(names)]


def test_a_plan_the_swarm_overtook_is_made_again_and_the_newer_state_in_hand_adopted() -> None:
    stale, fresh = _records("abcde", 1, "h1"), _records("abcde", 2, "h2")
    swarm = Swarm(reads=[stale, fresh], serves={r.endpoint: _state(2, "h2") for r in fresh})
    part = Part()
    assert _heal(swarm, part)
    assert [(s.round, s.digest) for s in part.adopted] == [(2, "h2")]
    assert len(swarm.downloads) == 1, swarm.downloads  # one download, not one per donor of round 1


def test_a_donor_claiming_a_round_the_roster_does_not_bear_out_is_refused() -> None:
    records = _records("abcde", 1, "h1")
    serves = {r.endpoint: _state(1, "h1") for r in records}
    honest = Swarm(reads=[records], serves=serves)
    assert _heal(honest, Part())
    liar = honest.downloads[0]  # the donor this peer asks first: it lies, serving a round no record announces
    serves[liar] = _state(9, "forged")
    swarm, part = Swarm(reads=[records], serves=serves), Part()
    assert _heal(swarm, part)
    assert [(s.round, s.digest) for s in part.adopted] == [(1, "h1")]
    assert swarm.downloads[0] == liar and swarm.downloads.count(liar) == 1 and len(swarm.downloads) == 2

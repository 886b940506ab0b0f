"""When a gossip peer copies a live peer (driver/gossip.py `_catch_up`): behind its roster's median round (a
joiner at round 0; another peer by more than LAG_ROUNDS), from a peer at the median, nearest first, only a
state with the digest the donor announces; one record claiming a far round pulls nobody."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from swarmtrain.config import RunConfig
from swarmtrain.discovery import PeerRecord
from swarmtrain.driver.gossip import LAG_ROUNDS, GossipDriver, not_waited_for
from swarmtrain.driver.part import CommittedState
from swarmtrain.telemetry import HealEvent

pytestmark = pytest.mark.unit


class _Part:
    def __init__(self, round_index: int) -> None:
        self.worker = SimpleNamespace(round=round_index, outer=SimpleNamespace(momentum_buffer=torch.zeros(2)))
        self.adopted: list[CommittedState] = []

    async def adopt(self, state: CommittedState, *, keep_progress: bool = False) -> None:
        self.adopted.append(state)
        self.worker.round = state.round


def _record(name: str, round_index: int, digest: str = "") -> PeerRecord:
    return PeerRecord(run_id="r", peer_id=name, endpoint=f"{name}:1", round=round_index,
                      state_hash=digest or _hex(name))


def _hex(name: str) -> str:
    return name.encode().hex().ljust(64, "0")


def _catch_up(own: int, roster: Sequence[PeerRecord], *, served: dict[str, str] | None = None
              ) -> tuple[_Part, list[str], list[object]]:
    part, asked, events = _Part(own), [], []
    records = {p.endpoint: p for p in roster}

    async def fetch_state(endpoints: Sequence[str]) -> tuple[CommittedState, Any]:
        (endpoint,) = endpoints
        asked.append(records[endpoint].peer_id)
        donor = records[endpoint]
        digest = (served or {}).get(donor.peer_id, donor.state_hash)
        return CommittedState(round=donor.round, theta_global=torch.zeros(2), outer_momentum=torch.zeros(2),
                              digest=digest), endpoints

    driver = GossipDriver(part=part, cfg=RunConfig().replace(averaging={"mode": "gossip"}), codec=None,  # type: ignore[arg-type]
                          node=SimpleNamespace(), mailbox=None, discovery=SimpleNamespace(peer_id="me"),  # type: ignore[arg-type]
                          fetch_state=fetch_state, emit=events.append, changed=lambda: None)
    asyncio.run(driver._catch_up(roster))
    return part, asked, events


def test_a_joiner_copies_a_peer_at_the_median_round() -> None:
    part, asked, events = _catch_up(0, [_record("a", 3), _record("b", 4), _record("c", 9)])
    assert asked == ["b"] and part.worker.round == 4  # median 4: b, not the freshest (c)
    assert isinstance(events[0], HealEvent) and (events[0].from_round, events[0].to_round) == (0, 4)


def test_a_peer_a_few_rounds_behind_trains_on() -> None:
    part, asked, _ = _catch_up(10, [_record("a", 10 + LAG_ROUNDS), _record("b", 10 + LAG_ROUNDS)])
    assert asked == [] and part.worker.round == 10
    part, asked, _ = _catch_up(0, [_record("a", 0), _record("b", 0)])
    assert asked == []


def test_a_peer_stopped_for_a_while_copies_a_peer() -> None:
    part, asked, events = _catch_up(10, [_record("a", 20), _record("b", 21), _record("c", 22)])
    assert asked == ["b"] and part.worker.round == 21
    assert (events[0].from_round, events[0].to_round) == (10, 21)


def test_a_state_without_its_announced_digest_is_refused_and_the_next_donor_tried() -> None:
    part, asked, _ = _catch_up(0, [_record("a", 5), _record("b", 5)], served={"a": "f" * 64})
    assert asked == ["a", "b"] and part.adopted[-1].digest == _hex("b")


def test_one_record_claiming_a_far_round_pulls_nobody() -> None:
    part, asked, _ = _catch_up(5, [_record("a", 5), _record("b", 6), _record("liar", 10_000)])
    assert asked == [] and part.worker.round == 5


def test_partners_too_far_in_rounds_or_silent_since_they_failed_are_not_waited_for() -> None:
    def rec(name: str, round_index: int, beat: float) -> PeerRecord:
        return PeerRecord(run_id="r", peer_id=name, endpoint=f"{name}:1", round=round_index, heartbeat_at=beat)

    records = {"near": rec("near", 9, 5.0), "behind": rec("behind", 10 - LAG_ROUNDS - 1, 5.0),
               "ahead": rec("ahead", 10 + LAG_ROUNDS + 1, 5.0), "frozen": rec("frozen", 10, 5.0),
               "back": rec("back", 10, 7.0)}
    silent = {"frozen": 5.0, "back": 6.0}  # both failed once; only "back" has beaten since
    got = not_waited_for(list(records), records, round_index=10, silent=silent)
    assert set(got) == {"behind", "ahead", "frozen"}
    assert "too far" in got["behind"] and "not beaten" in got["frozen"]

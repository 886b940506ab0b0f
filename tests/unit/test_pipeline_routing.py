"""pipeline/cut.py and pipeline/routing.py, with a fake clock and seeded draws."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from swarmtrain.config import PipelineConfig
from swarmtrain.pipeline.cut import stage_blocks, stage_of_block
from swarmtrain.pipeline.routing import Router, Server

pytestmark = pytest.mark.unit

CFG = PipelineConfig(stages=2, call_timeout_s=10.0, deadline_factor=4.0, min_deadline_s=0.5, avoid_s=10.0)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_stages_cover_the_blocks_in_order_as_evenly_as_they_go() -> None:
    assert stage_blocks(12, 1) == [range(0, 12)]
    assert stage_blocks(12, 3) == [range(0, 4), range(4, 8), range(8, 12)]
    assert stage_blocks(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert [stage_of_block(b, 7, 3) for b in range(7)] == [0, 0, 0, 1, 1, 2, 2]
    for bad in ((4, 5), (4, 0)):
        with pytest.raises(ValueError, match="stages"):
            stage_blocks(*bad)


def _router(*latencies: float) -> tuple[Router, list[Server], Clock]:
    clock = Clock()
    router = Router(CFG, clock=clock, rng=random.Random(0))
    servers = [Server(f"p{i}", f"h:{i}", 0) for i in range(len(latencies))]
    router.update(servers)
    for s, lat in zip(servers, latencies, strict=True):
        for _ in range(8):
            router.started(s)
            router.answered(s, lat)
    return router, servers, clock


def test_servers_are_drawn_in_proportion_to_their_speed() -> None:
    router, servers, _ = _router(0.1, 0.3)
    counts = Counter(router.choose(0) for _ in range(4000))
    share = counts[servers[0]] / 4000
    assert share == pytest.approx(0.75, abs=0.03)  # 1/0.1 : 1/0.3 = 3 : 1


def test_calls_in_flight_and_reported_queues_lower_a_servers_share() -> None:
    router, servers, _ = _router(0.1, 0.1)
    for _ in range(3):
        router.started(servers[0])
    assert router.expected_s(servers[0]) == pytest.approx(0.4) and router.expected_s(servers[1]) == pytest.approx(0.1)
    router.answered(servers[1], 0.1, queue=7)
    assert router.expected_s(servers[1]) == pytest.approx(0.8)


def test_a_failed_server_is_avoided_then_tried_again_and_cleared_by_an_answer() -> None:
    router, servers, clock = _router(0.1, 0.1)
    router.failed(servers[0])
    assert all(router.choose(0) == servers[1] for _ in range(200))
    assert router.choose(0, exclude={servers[1]}) == servers[0]  # the only one left: tried anyway
    clock.t = 10.5
    assert {router.choose(0) for _ in range(200)} == set(servers)
    router.failed(servers[0])
    router.failed(servers[0])  # the third failure: avoided 40 s
    clock.t += 39.0
    assert router.avoided(servers[0])
    router.answered(servers[0], 0.1)
    assert not router.avoided(servers[0])


def test_deadlines_follow_each_servers_p95_within_bounds() -> None:
    router, servers, _ = _router(0.2, 5.0)
    assert router.deadline_s(servers[0]) == pytest.approx(0.8)  # 4 × p95
    assert router.deadline_s(servers[1]) == CFG.call_timeout_s  # capped
    fresh = Server("new", "h:9", 0)
    router.update([*servers, fresh])
    assert router.deadline_s(fresh) == CFG.call_timeout_s  # no history yet
    assert router.deadline_s(servers[0]) == pytest.approx(0.8)  # history kept across updates
    fast, _, _ = _router(0.01)
    assert fast.deadline_s(fast.servers(0)[0]) == CFG.min_deadline_s


def test_a_stage_without_servers_has_no_choice_and_unknown_servers_are_forgotten() -> None:
    router, servers, _ = _router(0.1)
    assert router.choose(1) is None and router.choose(0, exclude=set(servers)) is None
    router.update([])
    assert router.servers(0) == [] and router.choose(0) is None
    router.failed(servers[0])  # a late failure of a forgotten server is ignored


def test_a_server_no_longer_listed_can_still_be_called() -> None:
    """A backward goes to the server that ran the forward, even after its record left the list (it moved to
    another stage, or took a lost one): its health is kept afresh, and it is never chosen again."""
    router, servers, _ = _router(0.1, 0.1)
    router.update(servers[1:])
    gone = servers[0]
    router.started(gone)
    assert router.deadline_s(gone) == CFG.call_timeout_s
    router.answered(gone, 0.2)
    router.started(gone)
    router.failed(gone)
    assert all(router.choose(0) == servers[1] for _ in range(20))

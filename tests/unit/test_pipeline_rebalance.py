"""The rebalancing rule on fabricated records: margin, saturation, cooldown, observation time, one mover per
period by a stable order, never emptying a stage, per-block speeds; and its config fields."""

from __future__ import annotations

import pytest

from swarmtrain.config import ConfigError, load_config
from swarmtrain.discovery import PeerRecord, StageLoad
from swarmtrain.pipeline.decisions import server_loads
from swarmtrain.pipeline.rebalance import Rebalancer, RebalanceRule, ServerLoad, plan_move

pytestmark = pytest.mark.unit

RULE = RebalanceRule(margin=0.25, cooldown_s=30.0, observe_s=10.0)
NOW = 1000.0


def load(peer: str, stage: int, *, service_s: float = 0.1, busy: float = 0.5, since: float = 0.0) -> ServerLoad:
    return ServerLoad(peer, stage, service_s, busy, since)


def three_on_one() -> list[ServerLoad]:
    """3 servers on stage 0 at a third of their time, 1 on stage 1 saturated: stage 1 bounds the pipeline."""
    return [load("c", 0, busy=0.33), load("a", 0, busy=0.33), load("b", 0, busy=0.33), load("d", 1, busy=0.98)]


def test_the_bottleneck_gets_a_server_from_the_best_served_stage() -> None:
    d = plan_move(three_on_one(), blocks=[1, 1], rule=RULE, now=NOW)
    assert (d.move_to, d.source) == (1, 0)
    assert d.capacity_per_s == (30.0, 10.0) and d.predicted_per_s == 20.0
    assert d.load == (0.33, 0.98)
    assert d.mover == "a"  # three moves tie: the lowest peer id


def test_each_server_of_the_stage_agrees_on_one_mover() -> None:
    moves = {}
    for me in "abcd":
        r = Rebalancer(RULE, me=me, blocks=[1, 1])
        r.decide(three_on_one(), now=NOW)
        moves[me] = r.decide(three_on_one(), now=NOW + 10.0)
    assert [me for me, d in moves.items() if d.move_to is not None] == ["a"]
    assert moves["b"].reason.startswith("a moves, not this server")


def test_jittering_figures_name_the_same_mover() -> None:
    """Servers alike measure a little differently each period: the mover stays the lowest peer id."""
    for jitter in ((0.100, 0.097, 0.103), (0.103, 0.100, 0.097), (0.097, 0.103, 0.100)):
        loads = [load(p, 0, service_s=t, busy=0.33) for p, t in zip("cab", jitter, strict=True)]
        d = plan_move([*loads, load("d", 1, busy=0.98)], blocks=[1, 1], rule=RULE, now=NOW)
        assert (d.mover, d.move_to) == ("a", 1)


def test_the_move_that_leaves_the_highest_least_capacity_wins() -> None:
    loads = [load("a", 0, service_s=0.2), load("b", 0, service_s=0.05), load("c", 1, service_s=0.1, busy=1.0)]
    d = plan_move(loads, blocks=[1, 1], rule=RULE, now=NOW)
    # a (5/s) leaving: stage 0 keeps 20/s, stage 1 gets 15/s; b (20/s) leaving would leave stage 0 at 5/s
    assert d.mover == "a" and d.predicted_per_s == 15.0


def test_no_move_below_the_margin() -> None:
    # 2 servers against 1: moving one would give 1 against 2, the least capacity unchanged
    loads = [load("a", 0), load("b", 0), load("c", 1, busy=1.0)]
    d = plan_move(loads, blocks=[1, 1], rule=RULE, now=NOW)
    assert d.move_to is None and "less than the margin" in d.reason
    # with stage 0 twice as slow per micro-batch, 2+1 is balanced already: still no move
    assert plan_move([load("a", 0, service_s=0.2), load("b", 0, service_s=0.2), load("c", 1, busy=1.0)],
                     blocks=[1, 1], rule=RULE, now=NOW).move_to is None


def test_a_stage_that_is_not_saturated_draws_no_server() -> None:
    loads = [load("a", 0, busy=0.1), load("b", 0, busy=0.1), load("c", 0, busy=0.1), load("d", 1, busy=0.3)]
    d = plan_move(loads, blocks=[1, 1], rule=RULE, now=NOW)
    assert d.move_to is None and "do not bound the pipeline" in d.reason


def test_a_stage_is_never_emptied() -> None:
    loads = [load("a", 0, busy=1.0), load("b", 1, busy=0.2), load("c", 2, busy=0.2)]
    d = plan_move(loads, blocks=[1, 1, 1], rule=RULE, now=NOW)
    assert d.move_to is None and "no other stage has a server to spare" in d.reason


def test_a_stage_without_servers_is_not_rebalanced_to() -> None:
    d = plan_move([load("a", 0), load("b", 0)], blocks=[1, 1], rule=RULE, now=NOW)
    assert d.move_to is None and "stage 1 has no server" in d.reason


def test_cooldown_after_any_server_took_its_stage() -> None:
    loads = [*three_on_one()[:3], load("d", 1, busy=0.98, since=NOW - 5.0)]
    d = plan_move(loads, blocks=[1, 1], rule=RULE, now=NOW)
    assert d.move_to is None and d.reason.startswith("cooldown: d took stage 1 5.0 s ago")
    assert plan_move(loads, blocks=[1, 1], rule=RULE, now=NOW + 25.0).move_to == 1


def test_the_same_move_must_be_called_for_over_the_observation_time() -> None:
    r = Rebalancer(RULE, me="a", blocks=[1, 1])
    first = r.decide(three_on_one(), now=NOW)
    assert first.move_to is None and first.reason.startswith("observing for 0.0 of 10 s")
    assert r.decide(three_on_one(), now=NOW + 9.0).move_to is None
    # a period without the imbalance starts the observation afresh
    calm = [load("a", 0), load("b", 0), load("c", 1, busy=1.0), load("d", 1, busy=1.0)]
    assert r.decide(calm, now=NOW + 9.5).move_to is None
    assert r.decide(three_on_one(), now=NOW + 12.0).move_to is None
    assert r.decide(three_on_one(), now=NOW + 22.0).move_to == 1


def test_speeds_are_per_block_and_unmeasured_servers_count_at_the_median() -> None:
    # stage 0 holds 2 blocks, stage 1 one: 0.2 s a micro-batch on stage 0 is 0.1 s on stage 1
    loads = [load("b", 0, service_s=0.0), load("a", 0, service_s=0.2), load("c", 0, service_s=0.2),
             load("e", 0, service_s=0.2), load("d", 1, service_s=0.1, busy=1.0)]
    d = plan_move(loads, blocks=[2, 1], rule=RULE, now=NOW)
    assert d.capacity_per_s == (20.0, 10.0)  # b counts at the median 0.1 s per block
    assert (d.move_to, d.mover, d.predicted_per_s) == (1, "a", 15.0)
    assert "no server has measured" in plan_move([load("a", 0, service_s=0), load("b", 1, service_s=0)],
                                                 blocks=[1, 1], rule=RULE, now=NOW).reason


def test_records_feed_the_rule() -> None:
    peers = [PeerRecord(run_id="r", peer_id="a", endpoint="127.0.0.1:1", role="stage_server",
                        server=StageLoad(stage=1, service_s=0.2, busy=0.5, stage_since=12.0)),
             PeerRecord(run_id="r", peer_id="t", endpoint="127.0.0.1:2", role="trainer")]
    assert server_loads(peers, stages=2) == [ServerLoad("a", 1, 0.2, 0.5, 12.0)]
    back = PeerRecord.from_json(peers[0].to_json()).server
    assert back is not None and (back.service_s, back.busy, back.stage_since) == (0.2, 0.5, 12.0)


@pytest.mark.parametrize(("override", "field"), [
    ("pipeline.rebalance_period_s=0", "pipeline.rebalance_period_s"),
    ("pipeline.rebalance_margin=0", "pipeline.rebalance_margin"),
    ("pipeline.rebalance_cooldown_s=-1", "pipeline.rebalance_cooldown_s"),
    ("pipeline.rebalance_cooldown_s=1", "pipeline.rebalance_cooldown_s"),  # shorter than the period (10 s)
    ("pipeline.rebalance_observe_s=-1", "pipeline.rebalance_observe_s"),
    ("pipeline.rebalance_drain_s=0", "pipeline.rebalance_drain_s"),
])
def test_bad_rebalance_values_are_refused_naming_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(overrides=["model.preset=tiny", override])

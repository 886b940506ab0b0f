"""Lost stages, pure: when a stage counts as lost, which server takes it (from the neighbours or from the
freshest copy), CheckFree's average, the record's copies, the fields."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.config import ConfigError, load_config
from swarmtrain.discovery import PeerRecord, StageLoad
from swarmtrain.discovery.records import RecordError
from swarmtrain.pipeline.lost import (
    LiveServer,
    LostStageWatch,
    choose_restorer,
    choose_taker,
    copy_stages,
    neighbours_of,
    weighted_average,
)
from swarmtrain.telemetry import StageRebuildEvent, parse_line
from swarmtrain.telemetry.events import to_json

pytestmark = pytest.mark.unit


def _servers(*placed: tuple[str, int]) -> list[LiveServer]:
    return [LiveServer(peer, stage, round=3) for peer, stage in placed]


ALL = _servers(("a", 0), ("b", 0), ("c", 1), ("d", 2), ("e", 2))
WITHOUT_C = [s for s in ALL if s.peer_id != "c"]


def test_a_stage_is_lost_only_after_the_grace() -> None:
    watch = LostStageWatch(stages=3, grace_s=5.0)
    assert watch.observe(ALL, now=0.0) == []
    assert watch.observe(WITHOUT_C, now=1.0) == []
    assert watch.observe(WITHOUT_C, now=5.9) == []
    assert watch.empty_for_s(1, now=5.9) == pytest.approx(4.9)
    assert watch.observe(WITHOUT_C, now=6.0) == [1]
    assert watch.last_round[1] == 3


def test_a_server_back_within_the_grace_is_a_restart() -> None:
    watch = LostStageWatch(stages=3, grace_s=5.0)
    watch.observe(ALL, now=0.0)
    watch.observe(WITHOUT_C, now=1.0)
    assert watch.observe(ALL, now=4.0) == []
    assert watch.observe(WITHOUT_C, now=8.0) == []  # the grace counts afresh
    assert watch.observe(WITHOUT_C, now=13.0) == [1]


def test_a_stage_never_served_is_not_lost() -> None:
    watch = LostStageWatch(stages=3, grace_s=1.0)
    for now in (0.0, 5.0, 10.0):
        assert watch.observe(WITHOUT_C, now=now) == []


def test_every_server_names_one_taker_from_a_neighbouring_stage_that_keeps_a_server() -> None:
    assert choose_taker(WITHOUT_C, lost=1) == "a"
    assert choose_taker(list(reversed(WITHOUT_C)), lost=1) == "a"
    # Stage 0 has one server left: it is never emptied, so a server of stage 2 takes stage 1.
    assert choose_taker(_servers(("a", 0), ("d", 2), ("e", 2)), lost=1) == "d"
    # A neighbouring stage's server comes before a lower peer id further away.
    assert choose_taker(_servers(("a", 0), ("b", 0), ("x", 2), ("y", 2), ("z", 3)), lost=3) == "x"
    assert choose_taker(_servers(("a", 0), ("b", 0), ("z", 2)), lost=3) == "a"


def test_no_taker_when_no_stage_has_a_server_to_spare() -> None:
    assert choose_taker(_servers(("a", 0), ("d", 2)), lost=1) is None


def test_only_a_middle_stage_between_stages_of_its_size_is_rebuilt_from_its_neighbours() -> None:
    assert neighbours_of(1, blocks=[2, 2, 2]) == ((0, 2), "")
    for lost in (0, 2):
        pair, why = neighbours_of(lost, blocks=[2, 2, 2])
        assert pair is None and "one neighbouring stage" in why
    pair, why = neighbours_of(1, blocks=[2, 2, 1])
    assert pair is None and "as many blocks" in why


def test_the_average_is_the_hand_computed_one() -> None:
    before = torch.tensor([1.0, 2.0, -3.0, 4.0])
    after = torch.tensor([3.0, 0.0, 1.0, 8.0])
    assert torch.equal(weighted_average([before, after], [0.5, 0.5]), torch.tensor([2.0, 1.0, -1.0, 6.0]))
    # CheckFree's weights (gradient norms 1 and 3): 1/4 and 3/4.
    assert torch.allclose(weighted_average([before, after], [1.0, 3.0]), torch.tensor([2.5, 0.5, 0.0, 7.0]))


@pytest.mark.parametrize(("thetas", "weights"), [
    ([torch.zeros(3), torch.zeros(4)], [1.0, 1.0]),
    ([torch.zeros(3)], [1.0, 1.0]),
    ([torch.zeros(3), torch.zeros(3)], [0.0, 0.0]),
    ([torch.zeros(3), torch.zeros(3)], [1.0, -1.0]),
])
def test_an_average_of_unequal_parts_or_weights_is_refused(thetas: list[torch.Tensor], weights: list[float]) -> None:
    with pytest.raises(ValueError, match="weighted_average"):
        weighted_average(thetas, weights)


@pytest.mark.parametrize(("override", "field"), [
    ("pipeline.lost_stage='checkpoints'", "pipeline.lost_stage"),
    ("pipeline.stage_copy_period_s=0", "pipeline.stage_copy_period_s"),
    ("pipeline.lost_stage_grace_s=0", "pipeline.lost_stage_grace_s"),
    ("pipeline.stage_wait_s=-1", "pipeline.stage_wait_s"),
])
def test_bad_lost_stage_values_are_refused_naming_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(overrides=["model.preset=tiny", override])


def test_the_defaults_rebuild_from_the_neighbours_and_wait_for_the_stage() -> None:
    pipe = load_config(overrides=["model.preset=tiny"]).pipeline
    assert (pipe.lost_stage, pipe.lost_stage_grace_s, pipe.stage_wait_s) == ("neighbours", 30.0, 120.0)
    assert load_config(overrides=["model.preset=tiny", "pipeline.lost_stage='off'"]).pipeline.lost_stage == "off"
    copies = load_config(overrides=["model.preset=tiny", "pipeline.lost_stage='checkpoint'"]).pipeline
    assert (copies.lost_stage, copies.stage_copy_period_s) == ("checkpoint", 60.0)


def test_the_rebuild_line_reads_back() -> None:
    event = StageRebuildEvent(stage=1, from_stage=0, method="neighbours",
                              sources=("stage 0 round 3 abc from a", "stage 2 round 3 def from d"),
                              weights=(0.5, 0.5), lost_s=31.0, round=4, hash="f00d", transfer_s=0.2, drain_s=0.1,
                              unfinished=0, peer="a", at=1.0)
    assert parse_line(to_json(event)) == event


def _holding(peer: str, stage: int, *copies: tuple[int, int]) -> LiveServer:
    return LiveServer(peer, stage, round=9, copies=copies)


def test_servers_keep_copies_of_their_neighbouring_stages() -> None:
    assert copy_stages(0, stages=3) == [1]
    assert copy_stages(1, stages=3) == [0, 2]
    assert copy_stages(2, stages=3) == [1]
    assert copy_stages(0, stages=1) == []


def test_the_spare_server_with_the_freshest_copy_restores_a_lost_stage() -> None:
    servers = [_holding("a", 0, (1, 4)), _holding("b", 0, (1, 6)), _holding("d", 2, (1, 6)), _holding("e", 2, (1, 5))]
    # b and d hold round 6: the neighbour first, then the lowest peer id (both neighbours here: b).
    assert choose_restorer(servers, lost=1) == ("b", 6)
    assert choose_restorer(list(reversed(servers)), lost=1) == ("b", 6)
    # A fresher copy further away wins over a neighbour's older one.
    far = [_holding("a", 0, (1, 2)), _holding("b", 0), _holding("x", 3, (1, 7)), _holding("y", 3)]
    assert choose_restorer(far, lost=1) == ("x", 7)
    # A first or last stage is restored too (its one neighbour holds the copy).
    assert choose_restorer([_holding("c", 1, (2, 3)), _holding("d", 1, (0, 3))], lost=2) == ("c", 3)


def test_no_restorer_without_a_spare_server_holding_a_copy() -> None:
    assert choose_restorer([_holding("a", 0, (1, 4)), _holding("d", 2, (1, 6))], lost=1) is None  # none spare
    assert choose_restorer([_holding("a", 0), _holding("b", 0), _holding("d", 2, (0, 1))], lost=1) is None


def test_a_record_carries_its_copies_and_refuses_malformed_ones() -> None:
    rec = PeerRecord(run_id="r", peer_id="a", endpoint="127.0.0.1:1", role="stage_server",
                     server=StageLoad(stage=1, copies=((0, 4), (2, 5))))
    assert PeerRecord.from_json(rec.to_json()).copies == ((0, 4), (2, 5))
    load = rec.to_json()["server"]
    plain = {**rec.to_json(), "server": {k: v for k, v in load.items() if k != "copies"}}  # a server keeping none
    assert PeerRecord.from_json(plain).copies == ()
    for bad in ([[0]], [[0, "4"]], [[0, True]], "0,4", [[0, 4]] * 9, [[-1, 4]]):
        with pytest.raises(RecordError, match=r"peer\.server\.copies"):
            PeerRecord.from_json({**rec.to_json(), "server": {**load, "copies": bad}})

"""The testbed's pipeline layout (`swarmtrain testbed run --pipeline S:P:T`): parsing, hosts, bad values."""

from __future__ import annotations

import pytest

from swarmtrain.daemon.cli import build_parser
from swarmtrain.testbed import TestbedError
from swarmtrain.testbed.pipeline import PipelineLayout

pytestmark = pytest.mark.unit


def test_parse_even_and_per_stage_counts() -> None:
    even = PipelineLayout.parse("2:3:2")
    assert even.servers_per_stage == (3, 3) and even.trainers == 2 and even.stages == 2
    assert even.num_hosts == 1 + 6 + 2 and even.describe() == "2:3:2"
    uneven = PipelineLayout.parse("2:4,2:2")
    assert uneven.servers_per_stage == (4, 2) and uneven.describe() == "2:4,2:2"


def test_hosts_interleave_stages_and_put_trainers_last() -> None:
    layout = PipelineLayout.parse("2:2,1:2")
    assert layout.servers() == [("s0a", 1, 0), ("s1a", 2, 1), ("s0b", 3, 0)]
    assert layout.trainer_hosts() == [("t0", 4), ("t1", 5)]


@pytest.mark.parametrize(("text", "says"), [
    ("2x3x2", "STAGES:SERVERS_PER_STAGE:TRAINERS"), ("2:3", "STAGES:SERVERS_PER_STAGE:TRAINERS"),
    ("0:3:2", "stages must be >= 1"), ("2:0:2", ">= 1 server"), ("2:3:0", "trainers must be >= 1"),
    ("2:1,2,3:1", "3 server counts for 2 stages"), ("2:-1:2", "STAGES:SERVERS_PER_STAGE:TRAINERS"),
    ("2:150:1", "more than a testbed has"),
])
def test_bad_layouts_say_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(TestbedError, match=says):
        PipelineLayout.parse(text)


def test_cli_run_takes_a_pipeline_without_host_or_command() -> None:
    args = build_parser().parse_args(["testbed", "run", "--pipeline", "2:3:2", "--set", "pipeline.rebalance=true"])
    assert args.pipeline == "2:3:2" and args.host is None and args.overrides == ["pipeline.rebalance=true"]
    args = build_parser().parse_args(["testbed", "run", "--host", "1", "--", "true"])
    assert args.pipeline is None and args.host == 1

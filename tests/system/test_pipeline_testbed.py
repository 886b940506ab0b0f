"""A pipeline swarm on the namespace testbed (root): servers and a trainer each in a host, a server killed
and started again, activations counted by the kernel on the shaped links."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmtrain.process.children import group_alive
from swarmtrain.telemetry.events import StepEvent
from swarmtrain.testbed import LinkSpec, Testbed, find_testbeds, read_counters
from swarmtrain.testbed.pipeline import PipelineLayout, PipelineSwarm

pytestmark = [pytest.mark.system, pytest.mark.root, pytest.mark.timeout(120)]

if os.geteuid() != 0:
    pytest.skip("the namespace testbed needs root (ip netns, veth, tc need CAP_NET_ADMIN)", allow_module_level=True)
if shutil.which("ip") is None or shutil.which("tc") is None:
    pytest.skip("the namespace testbed needs iproute2 (`ip`, `tc`)", allow_module_level=True)

TINY_PIPELINE = [
    "model.preset=tiny", "data.max_corpus_bytes=400000", "data.seq_len=32", "inner.warmup_steps=1",
    "diloco.rounds=1000", "diloco.inner_steps=50", "pipeline.microbatch_size=4", "pipeline.samples_per_step=8",
    "pipeline.call_timeout_s=5", "pipeline.min_deadline_s=1", "pipeline.avoid_s=5",
    "discovery.heartbeat_s=0.5", "discovery.record_ttl_s=3.0", "rpc.call_timeout_s=5", "train.threads=1",
]


@pytest.fixture
def name() -> Iterator[str]:
    tb_name = f"cp{os.getpid() % 100_000}"
    yield tb_name
    assert tb_name not in find_testbeds(), f"namespaces of testbed {tb_name} were left behind"


def _step_at_least(n: int) -> object:
    return lambda x: isinstance(x, StepEvent) and x.step >= n


def test_pipeline_swarm_starts_in_hosts_and_survives_a_server_restart(name: str, tmp_path: Path) -> None:
    layout = PipelineLayout.parse("2:2,1:1")  # coordinator h0, s0a h1, s1a h2, s0b h3, trainer h4
    with Testbed(name, num_hosts=layout.num_hosts, link=LinkSpec(rate_bit_s=50_000_000)) as tb, \
            PipelineSwarm(tb, layout, log_dir=tmp_path / "logs", run_overrides=TINY_PIPELINE) as swarm:
        ready = swarm.start(timeout_s=60)
        assert set(ready) == {"s0a", "s1a", "s0b", "t0"}
        trainer = swarm.child("t0")
        trainer.wait_for(_step_at_least(2), timeout_s=40, what="step 2")
        before = read_counters(name)
        swarm.restart_server("s0a")  # SIGKILL, then the same host, ports and stage
        swarm.child("s0a").wait_ready(timeout_s=40)
        done = len(swarm.steps("t0"))
        trainer.wait_for(_step_at_least(done + 3), timeout_s=40, what=f"3 steps after the restart (from {done})")
        delta = {i: c.minus(before[i]) for i, c in read_counters(name).items()}
        steps = swarm.steps("t0")
        pgids = [swarm.child(n).pgid for n in ("coordinator", *ready)]

    assert sum(s.lost for s in steps) == 0, [s.lost_reasons for s in steps if s.lost]
    assert len({s.step for s in steps}) == len(steps)
    # The trainer's activations crossed its shaped link in the data-plane class; s1a (the last stage) was used.
    trainer_up = delta[4].upload.data_payload_bytes
    assert trainer_up > 50_000 and delta[2].upload.data_payload_bytes > 50_000, delta
    assert delta[0].upload.data_bytes < trainer_up  # the coordinator carries no activations
    assert all(not group_alive(g) for g in pgids), "a swarmtrain process survived teardown"

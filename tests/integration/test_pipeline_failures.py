"""Stage servers that die or stall mid-run: every micro-batch completes (rerouted, never lost) and the loss
keeps falling; a stage with no server left loses its micro-batches with a reason, and the run goes on."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from swarmtrain.config import load_config
from swarmtrain.testing.pipeline import PipelineSwarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STEPS = 16


def _config(*extra: str):
    return load_config(overrides=[
        "model.preset=tiny", "model.n_layer=2", "data.seq_len=16", "inner.warmup_steps=2", "inner.lr=3e-3",
        "diloco.rounds=4", "diloco.inner_steps=8", "pipeline.stages=2", "pipeline.microbatch_size=2",
        "pipeline.samples_per_step=8", "pipeline.call_timeout_s=3", "pipeline.min_deadline_s=0.3",
        "pipeline.avoid_s=30", "rpc.run_key='k'", "rpc.call_timeout_s=3", *extra,
    ])


def _data(cfg, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable stream: each sequence repeats a short random pattern, targets are the next tokens."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        pattern = torch.randint(0, 16, (cfg.pipeline.samples_per_step, 4), generator=g)
        seq = pattern.repeat(1, cfg.data.seq_len // 4 + 1)
        out.append((seq[:, :cfg.data.seq_len], seq[:, 1:cfg.data.seq_len + 1]))
    return out


def _falls(losses: list[float]) -> bool:
    third = len(losses) // 3
    return sum(losses[-third:]) / third < 0.9 * sum(losses[:third]) / third


@pytest.mark.parametrize("when", ["between steps", "mid-step"])
def test_a_killed_stage_server_loses_no_microbatch(when: str) -> None:
    """s1.0 dies half-way (its record stays listed, as until its TTL): calls to it fail at once and go to
    s1.1; the micro-batches in flight there re-send from stage 1's input."""
    cfg = _config()
    data = _data(cfg, STEPS)
    with PipelineSwarm(cfg, servers_per_stage=2) as swarm:
        trainer = swarm.pipeline_trainers[0]
        reports = []
        for step, (idx, targets) in enumerate(data):
            if step == STEPS // 2:
                if when == "between steps":
                    swarm.kill("s1.0")
                else:  # while the step's micro-batches are in flight
                    threading.Timer(0.05, swarm.kill, args=("s1.0",)).start()
            reports.append(trainer.step(idx, targets, timeout_s=120))
    assert sum(r.lost for r in reports) == 0, [r.lost_reasons for r in reports]
    assert sum(r.microbatches for r in reports) == STEPS * 4
    after = reports[STEPS // 2:]
    assert sum(r.rerouted for r in after) >= 1  # what was in flight to s1.0 (or first chose it) went elsewhere
    assert _falls([r.loss for r in reports]), [round(r.loss, 3) for r in reports]
    survivor = next(s for s in swarm.servers if s.name == "s1.1")
    assert survivor.server.backwards > 0


def test_a_server_stalled_past_its_deadline_is_routed_around() -> None:
    """s0.1 stops answering (as under SIGSTOP) from step 4 on: its calls pass their adaptive deadline and
    go to s0.0; no micro-batch is lost."""
    cfg = _config()
    data = _data(cfg, STEPS)
    with PipelineSwarm(cfg, servers_per_stage=2) as swarm:
        trainer = swarm.pipeline_trainers[0]
        stalled = next(s for s in swarm.servers if s.name == "s0.1")
        release = threading.Event()
        real_forward = stalled.server.forward

        def frozen(*args, **kwargs):
            release.wait(30)
            return real_forward(*args, **kwargs)

        reports = []
        try:
            for step, (idx, targets) in enumerate(data):
                if step == 4:
                    stalled.server.forward = frozen  # type: ignore[method-assign]
                start = time.monotonic()
                reports.append(trainer.step(idx, targets, timeout_s=120))
                assert time.monotonic() - start < 60
        finally:
            release.set()
    assert sum(r.lost for r in reports) == 0, [r.lost_reasons for r in reports]
    assert sum(r.rerouted for r in reports[4:]) >= 1
    assert _falls([r.loss for r in reports])


def test_a_stage_without_servers_loses_microbatches_with_a_reason_and_the_run_goes_on() -> None:
    cfg = _config("pipeline.stage_wait_s=3")
    data = _data(cfg, 3)
    with PipelineSwarm(cfg, servers_per_stage=1) as swarm:
        trainer = swarm.pipeline_trainers[0]
        first = trainer.step(*data[0], timeout_s=60)
        swarm.kill("s1.0", forget=True)
        second = trainer.step(*data[1], timeout_s=60)
    assert first.lost == 0
    assert second.lost == second.microbatches == 4 and second.samples == 0
    assert all("stage 1" in why for why in second.lost_reasons), second.lost_reasons


def test_a_stage_s_only_server_answering_late_once_loses_no_microbatch() -> None:
    """s1.0, its stage's only server, answers one forward after its adaptive deadline (a pause, as of a loaded
    machine) but well within `pipeline.call_timeout_s`: the trainer has nobody else to send it to, so it calls
    the same server again with the whole call_timeout_s, and nothing is lost."""
    cfg = _config()
    data = _data(cfg, 8)
    with PipelineSwarm(cfg, servers_per_stage=1) as swarm:
        trainer = swarm.pipeline_trainers[0]
        late = next(s for s in swarm.servers if s.name == "s1.0")
        real_forward = late.server.forward
        pauses = [1.0]  # one call: past the 0.3 s min_deadline_s its few-ms p95 gives, under call_timeout_s=3

        def slow_once(*args, **kwargs):
            if pauses:
                time.sleep(pauses.pop())
            return real_forward(*args, **kwargs)

        reports = []
        for step, (idx, targets) in enumerate(data):
            if step == 4:
                late.server.forward = slow_once  # type: ignore[method-assign]
            reports.append(trainer.step(idx, targets, timeout_s=120))
    assert not pauses  # the pause happened
    assert sum(r.lost for r in reports) == 0, [r.lost_reasons for r in reports]
    assert sum(r.rerouted for r in reports[4:]) >= 1  # the late call was sent again

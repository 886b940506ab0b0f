"""A lost stage with real processes: coordinator + 3 stages (2 servers on stage 0, one each on stages 1 and 2)
+ 1 trainer on 127.0.0.1. The only stage-1 server is SIGKILLed: once its record has expired and the grace has
passed, one stage-0 server takes stage 1 and rebuilds it from its neighbours (CheckFree), the trainer's
micro-batches that waited for it go through, none is lost, and the loss comes back."""

from __future__ import annotations

import statistics

import pytest

from swarmtrain.process.children import Child
from swarmtrain.telemetry import StageRebuildEvent, StepEvent
from swarmtrain.testing.procs import ProcessSet, sigkill
from swarmtrain.testing.wait import wait_until

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]

KEY = "lost stage run key"
# Each process's own discovery settings (peer-scope: a run's record does not set them). A dead server's record
# outlives the trainer's call deadline (6 s against 4 s): its calls wait for the record to expire instead of
# counting the micro-batch lost while the dead server is still listed.
TTL_S, GRACE_S = 6.0, 1.0
LOCAL = ["--set", "discovery.heartbeat_s=0.5", "--set", f"discovery.record_ttl_s={TTL_S}"]
RUN = [
    "model.preset=tiny", "model.n_layer=3", "data.max_corpus_bytes=300000", "data.seq_len=16",
    "inner.warmup_steps=2", "inner.lr=3e-3", "diloco.rounds=1000", "diloco.inner_steps=10", "pipeline.stages=3",
    "pipeline.microbatch_size=2", "pipeline.samples_per_step=8", "pipeline.call_timeout_s=4",
    f"pipeline.lost_stage_grace_s={GRACE_S}", "pipeline.stage_wait_s=60", "pipeline.rebalance_drain_s=2",
    "rpc.call_timeout_s=4", "train.threads=1",
    "outer.lr=1.0", "outer.momentum=0", "outer.nesterov=false",
]
START_S = 120.0
BEFORE_STEPS = 30  # trainer steps before the kill
AFTER_STEPS = 30  # trainer steps after the rebuild
WINDOW = 5  # steps whose mean loss is compared
LOSS_FACTOR = 1.15  # as in tests/integration/test_pipeline_lost_stage.py


def _steps(child: Child) -> list[StepEvent]:
    return [x for x in child.snapshot() if isinstance(x, StepEvent)]


def _rebuilds(children: list[Child]) -> list[tuple[Child, StageRebuildEvent]]:
    return [(c, x) for c in children for x in c.snapshot() if isinstance(x, StageRebuildEvent)]


def test_a_sigkilled_middle_stage_is_rebuilt_from_its_neighbours(procs: ProcessSet,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMTRAIN_RUN_KEY", KEY)
    _, join = procs.coordinator(RUN, timeout_s=START_S)
    placement = {"s0a": 0, "s0b": 0, "s1a": 1, "s2a": 2}
    servers = {n: procs.peer(n, join, "--role", "server", "--stage", str(k), *LOCAL) for n, k in placement.items()}
    for s in servers.values():
        s.wait_ready(timeout_s=START_S)
    trainer = procs.peer("t1", join, "--role", "trainer", *LOCAL)
    trainer.wait_ready(timeout_s=START_S)

    trainer.wait_for(lambda x: isinstance(x, StepEvent) and x.step >= BEFORE_STEPS, timeout_s=180,
                     what=f"{BEFORE_STEPS} trainer steps")
    sigkill(servers["s1a"])
    killed_step = max(s.step for s in _steps(trainer))
    takers = [servers["s0a"], servers["s0b"], servers["s2a"]]
    wait_until(lambda: bool(_rebuilds(takers)), timeout_s=TTL_S + GRACE_S + 60, interval_s=0.2,
               what="the rebuild of stage 1")
    [(taker, rebuild)] = _rebuilds(takers)
    assert taker in (servers["s0a"], servers["s0b"]), "the server that took stage 1 left stage 2 empty"
    assert rebuild.stage == 1 and rebuild.from_stage == 0 and rebuild.method == "neighbours", rebuild
    assert rebuild.weights == (0.5, 0.5) and [s.split()[:2] for s in rebuild.sources] == [["stage", "0"],
                                                                                            ["stage", "2"]]
    assert rebuild.lost_s >= GRACE_S, rebuild
    wait_until(lambda: sum(s.at > rebuild.at for s in _steps(trainer)) >= AFTER_STEPS + WINDOW, timeout_s=180,
               interval_s=0.2,
               what=f"{AFTER_STEPS + WINDOW} trainer steps after the rebuild")

    steps = _steps(trainer)
    assert [s.step for s in steps] == list(range(1, len(steps) + 1))
    assert all(len(s.lost_reasons) == s.lost for s in steps)  # none lost silently
    assert sum(s.lost for s in steps) == 0, [s.lost_reasons for s in steps if s.lost]  # they waited instead
    assert all(s.samples == 8 for s in steps), [(s.step, s.samples) for s in steps if s.samples != 8]
    before = statistics.mean(s.loss for s in steps[killed_step - WINDOW:killed_step] if s.loss is not None)
    rebuilt = [s for s in steps if s.at > rebuild.at]
    after = statistics.mean(s.loss for s in rebuilt[AFTER_STEPS:AFTER_STEPS + WINDOW] if s.loss is not None)
    assert after < LOSS_FACTOR * before, f"loss {before:.3f} before the kill, {after:.3f} after"
    print(f"stage 1 rebuilt {rebuild.lost_s:.1f} s after its last record; loss {before:.3f} before the kill, "
          f"{after:.3f} {AFTER_STEPS} steps after the rebuild (trainer steps {killed_step} to {rebuilt[0].step} "
          "waited for it)")

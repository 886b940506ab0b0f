"""A pipeline of real processes: coordinator + 2 stages × 2 servers + 2 trainers on 127.0.0.1. Once stage 1
committed an outer round, one of its servers is SIGKILLed (and restarted: it heals to its stage's θ_global and
serves again), and while it restarts one stage-0 server is SIGSTOPped (longer than its calls' deadlines), so
that each stage is down to one server at once, while the trainers train:
every micro-batch sent completes (lost = 0, rerouted > 0), the loss keeps falling, each part (each stage's
servers, the trainers' ends) commits its outer rounds with one θ_global hash per round, and the stopped server
averages with its stage again once it runs."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from swarmtrain.process.children import Child
from swarmtrain.telemetry import HealEvent, LeaveEvent, StageRoundEvent, StageStepEvent, StepEvent
from swarmtrain.telemetry.events import Line
from swarmtrain.testing.procs import ProcessSet, sigcont, sigkill, sigstop

pytestmark = [pytest.mark.system, pytest.mark.timeout(420)]

KEY = "pipeline run key"
STEPS = 240  # diloco.rounds × diloco.inner_steps
RUN = [
    "model.preset=small", "data.max_corpus_bytes=400000", "data.seq_len=64", "inner.warmup_steps=2",
    "inner.lr=3e-3", "diloco.rounds=12", "diloco.inner_steps=20", "pipeline.stages=2", "pipeline.microbatch_size=4",
    "pipeline.samples_per_step=16", "pipeline.call_timeout_s=4", "pipeline.min_deadline_s=0.5",
    "pipeline.avoid_s=20", "discovery.heartbeat_s=0.5", "discovery.record_ttl_s=4.0", "rpc.call_timeout_s=4.0",
    "train.threads=1",
    # SWARM's plain averaging of a stage's weights: with H = 20, DiLoCo's Nesterov momentum 0.9 amplifies the
    # consistent early Δs up to 10x (docs/pipeline.md#outer-rounds-diloco-per-part)
    "outer.lr=1.0", "outer.momentum=0", "outer.nesterov=false",
]
START_S = 120.0


def _steps(child: Child) -> list[StepEvent]:
    return [x for x in child.snapshot() if isinstance(x, StepEvent)]


def _committed(line: Line) -> bool:
    return isinstance(line, StageRoundEvent) and line.committed


def _at_step(n: int) -> Callable[[Line], bool]:
    def match(line: Line) -> bool:
        return isinstance(line, StepEvent) and line.step >= n
    return match


def test_killed_and_stalled_stage_servers_cost_no_microbatch(procs: ProcessSet, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    monkeypatch.setenv("SWARMTRAIN_RUN_KEY", KEY)
    # Every process is given a checkpoint directory that does not exist yet (its votes go there): a run whose
    # vote books could not be written committed no outer round at all.
    fresh = tmp_path / "not-yet"
    _, join = procs.coordinator(RUN, timeout_s=START_S)
    servers = {f"s{k}{x}": procs.peer(f"s{k}{x}", join, "--role", "server", "--stage", str(k),
                                      checkpoint_dir=fresh / f"s{k}{x}") for k in (0, 1) for x in "ab"}
    for s in servers.values():
        s.wait_ready(timeout_s=START_S)
    trainers = [procs.peer(f"t{i}", join, "--role", "trainer", checkpoint_dir=fresh / f"t{i}") for i in (1, 2)]
    for t in trainers:
        t.wait_ready(timeout_s=START_S)

    servers["s1b"].wait_for(_committed, timeout_s=180, what="stage 1's first committed round")
    sigkill(servers["s1a"])
    killed_at = max(s.step for s in _steps(trainers[0]))
    trainers[0].wait_for(_at_step(killed_at + 4), timeout_s=120, what="4 trainer steps after the kill")
    # s1a comes back: it starts from stage 1's θ_global (a heal line from s1b) and serves again. While it starts
    # (tens of seconds on a loaded machine), a stage-0 server stops: both stages are down to one server at once.
    back = procs.peer("s1a", join, "--role", "server", "--stage", "1", checkpoint_dir=fresh / "s1a")
    stopped_at = max(s.step for s in _steps(trainers[0]))
    sigstop(servers["s0a"])
    trainers[0].wait_for(_at_step(stopped_at + 15), timeout_s=180, what="15 trainer steps with a server stopped")
    sigcont(servers["s0a"])
    resumed_at = time.time()
    # Stage 0 averages again after the stall: the stopped server (avoided for a while, so idle) joins the round s0b
    # waits in, and both leave it at one θ_global. The run is long enough that this is waited for, not hoped for.
    resumed_step = max(s.step for s in _steps(trainers[0]))
    assert resumed_step < STEPS - 120, f"the stall ended at step {resumed_step}: make the run longer"
    # Where the trainers were when s1a was back (read now: the stage-0 waits below may take the run to its end).
    back.wait_ready(timeout_s=START_S)
    back_at = max(s.step for s in _steps(trainers[0]))
    assert back_at < STEPS - 40, f"s1a was back at step {back_at}: too late to serve before the run ends"
    after: dict[str, tuple[int, str]] = {}  # each server's first commit after the stall: (round, hash)
    for name in ("s0a", "s0b"):
        try:
            _, line = servers[name].wait_for(lambda x: _committed(x) and x.at > resumed_at,  # type: ignore[union-attr]
                                             timeout_s=120, what="a committed stage-0 round after the stall")
        except TimeoutError as e:
            rounds = [(round(x.at - resumed_at, 1), x.round, x.committed, x.reason) for x in servers[name].snapshot()
                      if isinstance(x, StageRoundEvent)]
            raise AssertionError(f"{name}: {e}; its rounds (s after the SIGCONT, round, committed, why): {rounds}\n"
                                 f"{servers[name].diagnostics()}") from None
        assert isinstance(line, StageRoundEvent)
        after[name] = (line.round, line.hash)
    back.wait_for(lambda x: isinstance(x, StageStepEvent) and x.backwards > 0, timeout_s=120,
                  what="the restarted server's first served backward")
    for t in trainers:
        t.wait_for(lambda line: isinstance(line, LeaveEvent), timeout_s=300, what="the trainer's leave")

    for t in trainers:
        steps = _steps(t)
        leave = next(x for x in t.snapshot() if isinstance(x, LeaveEvent))
        assert leave.reason == "done" and [s.step for s in steps] == list(range(1, STEPS + 1))
        assert sum(s.lost for s in steps) == 0, [s.lost_reasons for s in steps if s.lost]
        assert sum(s.microbatches for s in steps) == STEPS * 4
        losses = [s.loss for s in steps]
        assert all(x is not None for x in losses)
        # It learns through the kill and the stall: the last 40 steps well below the first 10 (the loss drops
        # from ~5.4 to a ~2.9 plateau in 10 steps and creeps down from there: thirds of the run differ by
        # too little to compare without flaking).
        first, last = losses[:10], losses[-40:]
        assert sum(last) / len(last) < 0.8 * sum(first) / len(first), losses  # type: ignore[arg-type]
    assert sum(s.rerouted for t in trainers for s in _steps(t) if s.step > killed_at) > 0
    # It learns the rounds whose material its stage still keeps from their certificates and downloads the state
    # past them, from the one live holder of its stage.
    heals = [x for x in back.snapshot() if isinstance(x, HealEvent)]
    assert heals and all(h.to_round > h.from_round for h in heals), heals
    s1b = servers["s1b"].wait_ready(timeout_s=1)["peer_id"]
    assert all(h.source in ("certificate", s1b) for h in heals), heals
    heal = heals[-1]
    served = [x for x in back.snapshot() if isinstance(x, StageStepEvent)]
    # it trained on after joining, from where its stage's round puts the schedule
    assert served and served[-1].backwards > 0 and served[-1].step > heal.to_round * 20
    # Each part's holders commit their rounds with one θ_global hash per round (the restarted s1a too).
    parts = {0: [servers["s0a"], servers["s0b"]], 1: [servers["s1a"], servers["s1b"], back], -1: trainers}
    for stage, holders in parts.items():
        committed: dict[int, set[str]] = {}
        for child in holders:
            for x in child.snapshot():
                if isinstance(x, StageRoundEvent) and x.committed:
                    assert x.stage == stage
                    committed.setdefault(x.round, set()).add(x.hash)
        assert len(committed) >= 2 and all(len(h) == 1 for h in committed.values()), (stage, committed)
    for name in ("s0a", "s0b"):  # the first round each committed after the stall, at the hash the other left it at
        r, h = after[name]
        other = "s0b" if name == "s0a" else "s0a"
        theirs = [x.hash for x in servers[other].snapshot() if _committed(x) and x.round == r]  # type: ignore[union-attr]
        assert theirs == [h], (name, r, h, theirs)

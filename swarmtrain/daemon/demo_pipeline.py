"""`swarmtrain demo --pipeline`: a coordinator, 2 stages × 2 stage servers and 2 trainers on 127.0.0.1; one
server is SIGKILLed half-way; prints the trainers' progress, each part's outer rounds (a stage's servers, the
trainers' ends) and a summary (loss before/after, micro-batches sent, completed, re-sent, lost, rounds
committed per part and whether their holders agree on θ_global)."""

from __future__ import annotations

import queue
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from swarmtrain.config import RunConfig
from swarmtrain.process.children import Child, ChildExitedError, start_coordinator, stop_all, swarmtrain_argv
from swarmtrain.telemetry.events import LeaveEvent, Line, StageRoundEvent, StepEvent

__all__ = ["PIPELINE_OVERRIDES", "run_pipeline_demo"]

PIPELINE_OVERRIDES: tuple[str, ...] = (
    "model.preset=small",
    "data.max_corpus_bytes=2000000",
    "data.seq_len=64",
    "inner.warmup_steps=5",
    "diloco.inner_steps=10",
    "pipeline.stages=2",
    "pipeline.microbatch_size=4",
    "pipeline.samples_per_step=16",
    "pipeline.call_timeout_s=10",
    "pipeline.min_deadline_s=1",
    "discovery.heartbeat_s=1.0",
    "discovery.record_ttl_s=6.0",
    "rpc.call_timeout_s=5.0",
    "train.threads=1",
)
TRAINERS = 2
SERVERS = (("s0a", 0), ("s1a", 1), ("s0b", 0), ("s1b", 1))
VICTIM = "s1a"


def run_pipeline_demo(cfg: RunConfig, overrides: list[str], config_args: list[str], *, log_dir: str | None,
                      start_timeout_s: float, timeout_s: float, hold: Callable[[str], None] | None = None) -> int:
    """Run the pipeline demo; 0 when no micro-batch was lost and the loss fell."""
    steps = cfg.diloco.rounds * cfg.diloco.inner_steps
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="swarmtrain-pipeline-demo-"))
    logs.mkdir(parents=True, exist_ok=True)
    lines: queue.Queue[tuple[str, Line]] = queue.Queue()
    children: list[Child] = []
    started = time.monotonic()
    try:
        _say(f"swarmtrain demo --pipeline: coordinator + {cfg.pipeline.stages} stages × 2 servers + {TRAINERS} "
             f"trainers on 127.0.0.1, {steps} steps each, model {cfg.model.preset}; {VICTIM} is killed half-way; "
             f"logs in {logs}")
        join, dashboard = start_coordinator(overrides, config_args, log_dir=logs, timeout_s=start_timeout_s,
                                            children=children, dashboard=True)
        _say(f"dashboard: {dashboard}")
        servers = {name: Child(name, swarmtrain_argv("peer", "--join", join, "--role", "server", "--stage", str(k)),
                               log_path=logs / f"{name}.log", on_line=lambda name, line: lines.put((name, line)))
                   for name, k in SERVERS}
        children.extend(servers.values())
        for name, child in servers.items():
            info = child.wait_ready(timeout_s=start_timeout_s)
            _say(f"{name} ready: stage {info.get('stage')}, blocks {info.get('blocks')}, "
                 f"{info.get('num_params')} parameters")
        trainers = [Child(f"t{i}", swarmtrain_argv("peer", "--join", join, "--role", "trainer"),
                          log_path=logs / f"t{i}.log", on_line=lambda name, line: lines.put((name, line)))
                    for i in range(TRAINERS)]
        children.extend(trainers)
        for t in trainers:
            t.wait_ready(timeout_s=start_timeout_s)
        rc = _follow(trainers, servers, lines, steps=steps, deadline=started + timeout_s, started=started)
        if hold is not None:
            hold(dashboard)  # the coordinator and its dashboard stay up until interrupted
        return rc
    except (ChildExitedError, TimeoutError) as e:
        _say(f"demo failed: {e}")
        return 1
    finally:
        stop_all(children)


def _follow(trainers: list[Child], servers: dict[str, Child], lines: queue.Queue[tuple[str, Line]], *, steps: int,
            deadline: float, started: float) -> int:
    seen: dict[str, list[StepEvent]] = {t.name: [] for t in trainers}
    rounds: dict[int, dict[int, set[str]]] = {}  # part (stage, -1 = ends) -> committed round -> hashes
    left: set[str] = set()
    killed = False
    while len(left) < len(trainers):
        if time.monotonic() > deadline:
            raise TimeoutError("the pipeline demo did not finish in time (see the logs)")
        try:
            name, line = lines.get(timeout=0.5)
        except queue.Empty:
            for t in trainers:
                if not t.alive and t.name not in left:
                    raise ChildExitedError(f"{t.name} exited early; {t.diagnostics(tail_lines=5)}") from None
            continue
        if isinstance(line, StageRoundEvent):
            _round_line(name, line, rounds, started)
        elif isinstance(line, LeaveEvent) and name in seen:
            left.add(name)
        elif isinstance(line, StepEvent):
            seen[name].append(line)
            if line.step % max(1, steps // 10) == 0 or line.rerouted or line.lost:
                _say(f"[{time.monotonic() - started:6.1f}s] {name} step {line.step:4d}/{steps}  loss "
                     f"{line.loss if line.loss is None else round(line.loss, 3)}  re-sent {line.rerouted}  "
                     f"lost {line.lost}  stage latency {list(line.stage_latency_s)} s")
            if not killed and line.step >= steps // 2:
                servers[VICTIM].signal_group(signal.SIGKILL)
                killed = True
                _say(f"[{time.monotonic() - started:6.1f}s] killed {VICTIM} (SIGKILL)")
    all_steps = [s for v in seen.values() for s in v]
    sent = sum(s.microbatches for s in all_steps)
    lost = sum(s.lost for s in all_steps)
    rerouted = sum(s.rerouted for s in all_steps)
    tenth = max(1, steps // 10)
    before = [s.loss for v in seen.values() for s in v[:tenth] if s.loss is not None]
    after = [s.loss for v in seen.values() for s in v[-tenth:] if s.loss is not None]
    first, last = sum(before) / max(len(before), 1), sum(after) / max(len(after), 1)
    agree = all(len(hashes) == 1 for part in rounds.values() for hashes in part.values())
    ok = lost == 0 and bool(before) and bool(after) and last < first and agree
    _say("summary:")
    _say(f"  loss (first / last {tenth} steps of each trainer): {first:.3f} -> {last:.3f}")
    _say(f"  micro-batches sent {sent}, completed {sent - lost}, re-sent to another server {rerouted}, lost {lost}")
    for part in sorted(rounds):
        _say(f"  {_part(part)}: {len(rounds[part])} outer rounds committed, "
             f"{'one θ_global hash per round' if agree else 'holders DISAGREE on θ_global'}")
    _say(f"  wall time {time.monotonic() - started:.1f}s; result: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def _part(stage: int) -> str:
    return "trainers' ends" if stage < 0 else f"stage {stage}"


def _round_line(name: str, line: StageRoundEvent, rounds: dict[int, dict[int, set[str]]], started: float) -> None:
    """Record a part's round; print it the first time one of its holders reports it committed, and every abort."""
    if not line.committed:
        _say(f"[{time.monotonic() - started:6.1f}s] {_part(line.stage)} round {line.round} aborted at {name}: "
             f"{line.reason}")
        return
    part = rounds.setdefault(line.stage, {})
    first = line.round not in part
    part.setdefault(line.round, set()).add(line.hash)
    if first:
        _say(f"[{time.monotonic() - started:6.1f}s] {_part(line.stage)} round {line.round} committed "
             f"({len(line.members)} holders, θ_global {line.hash[:12]}, reported by {name})")


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()

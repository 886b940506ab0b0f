"""Pipeline benchmark on the namespace testbed (root): a SWARM pipeline of real processes, one per host, on
links shaped to RATE; samples/s, micro-batches lost and kernel-counted bytes next to swarmtrain's own count.

    sudo .venv/bin/python benchmarks/pipeline_testbed.py                      # every arm, 100 Mbit/s
    sudo .venv/bin/python benchmarks/pipeline_testbed.py --arms failure_free,int8 --seconds 30

Arms, one after another on one testbed (each its own processes; coordinator on host 0, every stage server
and trainer on a host of its own; every process 1 torch thread):
  failure_free  STAGES x SERVERS servers + TRAINERS trainers, fp32 activations
  churn         the same, one server SIGKILLed and started again every PERIOD s (round-robin over the
                servers, stages interleaved)
  int8          the same as failure_free with pipeline.activation_codec=int8
  uneven_off    an uneven start (UNEVEN servers per stage, the same total), pipeline.rebalance=false
  uneven_on     the same start with pipeline.rebalance=true (short rebalancing windows, see REBALANCE)
An arm's rate is the samples of the trainers' step lines that end inside its window, over the window; the
window opens once every trainer has done WARMUP steps. An arm in which servers moved also reports its rate
before the first move and after the last one (from SETTLE_S after it to the window's end). Bytes: the
kernel's data-plane class (TCP to/from the data port, headers removed) against swarmtrain's own count:
4 encoded tensors per stage and completed micro-batch (activation and gradient, each way) plus the
outer-round bytes the stage servers report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The loopback benchmark's workload (benchmarks/pipeline.py), unchanged: the small preset's activations
# (4 x 64 x 128 fp32 = 128 KiB a call) make a 100 Mbit/s link matter while 9 processes share 2 cores.
from pipeline import RUN, WARMUP  # noqa: E402  (benchmarks/pipeline.py, beside this file)

from swarmtrain.config import load_config  # noqa: E402
from swarmtrain.telemetry.events import HealEvent, StageMoveEvent, StageRoundEvent, StepEvent  # noqa: E402
from swarmtrain.testbed import LinkSpec, Testbed, parse_rate, read_counters  # noqa: E402
from swarmtrain.testbed.counters import HostCounters  # noqa: E402
from swarmtrain.testbed.pipeline import PipelineLayout, PipelineSwarm  # noqa: E402

# Rebalancing decides within an arm's window: shorter look period, observation and cool-down than the defaults.
REBALANCE = ["pipeline.rebalance_period_s=5", "pipeline.rebalance_observe_s=10", "pipeline.rebalance_cooldown_s=20",
             "pipeline.rebalance_drain_s=10"]
ARMS = ("failure_free", "churn", "int8", "uneven_off", "uneven_on")
SETTLE_S = 10.0  # after the last move in a window: its rate is read from here on


def encoded_bytes(overrides: list[str]) -> int:
    """Bytes of one encoded activation (or gradient) of a micro-batch, with the run's codec."""
    import torch

    from swarmtrain.models.gpt import resolve_shape
    from swarmtrain.pipeline.tensors import TensorCodec

    cfg = load_config(overrides=overrides)
    shape = (cfg.pipeline.microbatch_size, cfg.data.seq_len, resolve_shape(cfg.model).n_embd)
    return len(TensorCodec(cfg.pipeline.activation_codec, max_shape=shape).encode(torch.randn(shape))[1])


def _wire(before: dict[int, HostCounters], after: dict[int, HostCounters]) -> dict[str, int]:
    delta = [after[i].minus(before[i]) for i in after]
    return {"wire_bytes": sum(c.upload.total_bytes for c in delta),
            "wire_data_payload_bytes": sum(c.upload.data_payload_bytes for c in delta),
            "wire_other_bytes": sum(c.upload.other_bytes for c in delta),
            "wire_dropped_packets": sum(c.upload.dropped + c.download.dropped for c in delta)}


def run_arm(tb: Testbed, layout: PipelineLayout, overrides: list[str], *, seconds: float, period: float,
            log_dir: Path) -> dict[str, Any]:
    """One arm: start the swarm, wait for the trainers' warm-up, measure a window (killing a server every
    `period` s when > 0), stop everything; the figures of that window."""
    started = time.monotonic()
    with PipelineSwarm(tb, layout, log_dir=log_dir, run_overrides=overrides) as swarm:
        swarm.start(timeout_s=240)
        startup_s = time.monotonic() - started
        for name in swarm.trainers:
            swarm.child(name).wait_for(lambda x: isinstance(x, StepEvent) and x.step >= WARMUP, timeout_s=300,
                                       what="warm-up")
        names = list(swarm.servers)
        before, t0, start, load0 = read_counters(tb.name), time.time(), time.monotonic(), os.getloadavg()[0]
        kills = 0
        while (elapsed := time.monotonic() - start) < seconds:
            time.sleep(min(1.0, seconds - elapsed))
            if period and time.monotonic() - start >= period * (kills + 1):
                swarm.restart_server(names[kills % len(names)])
                kills += 1
        after, t1, load1 = read_counters(tb.name), time.time(), os.getloadavg()[0]
        lines = {name: swarm.lines(name) for name in [*swarm.servers, *swarm.trainers]}
    _dump(lines, log_dir / "events.jsonl")
    steps = [x for n in swarm.trainers for _, x in lines[n] if isinstance(x, StepEvent)]
    window = [s for s in steps if t0 <= s.at <= t1]
    events = [x for ls in lines.values() for _, x in ls]
    rounds = [x for x in events if isinstance(x, StageRoundEvent) and t0 <= x.at <= t1]
    moves = [x for x in events if isinstance(x, StageMoveEvent)]
    completed = sum(s.microbatches - s.lost for s in window)
    phases = _move_phases(window, [m.at for m in moves if t0 <= m.at <= t1], t0, t1)
    activation = 4 * layout.stages * completed * encoded_bytes(overrides)
    # A round line's bytes are its process's data-plane counter over the round; a trainer's counter also
    # counts the activation calls it makes meanwhile, so only the servers' round lines are added (the
    # trainers' own part, embeddings and head, is under 1 MB a round here).
    outer = sum(r.bytes_sent for r in rounds if r.stage >= 0)
    wire = _wire(before, after)
    return {
        "window_s": round(t1 - t0, 2), "startup_s": round(startup_s, 1),
        # 1-minute load average of the machine (2 cores) at the window's start and end: other work shows here.
        "loadavg_1m": [round(load0, 2), round(load1, 2)],
        "samples_per_s": sum(s.samples for s in window) / (t1 - t0),
        "steps": len(window), "microbatches": sum(s.microbatches for s in window), "completed": completed,
        "lost": sum(s.lost for s in window), "lost_whole_run": sum(s.lost for s in steps),
        "lost_reasons": sorted({r for s in steps for r in s.lost_reasons})[:5],
        "rerouted": sum(s.rerouted for s in window), "kills": kills,
        "heals": sum(1 for x in events if isinstance(x, HealEvent) and x.to_round > 0),
        "stage_moves": [{"from": m.from_stage, "to": m.to_stage, "peer": m.peer[:12], "t_s": round(m.at - t0, 1)}
                        for m in moves],
        "outer_rounds_committed": len({(r.stage, r.round) for r in rounds if r.committed}),
        "swarmtrain_activation_bytes": activation, "swarmtrain_outer_bytes": outer,
        "swarmtrain_bytes": activation + outer, **wire,
        "wire_over_swarmtrain": wire["wire_data_payload_bytes"] / max(1, activation + outer),
        "last_loss": next((s.loss for s in reversed(steps) if s.loss is not None), None), **phases,
    }


def _move_phases(window: list[StepEvent], moves_at: list[float], t0: float, t1: float) -> dict[str, float]:
    """With moves in the window: the samples/s before the first move, and after the last one once SETTLE_S
    have passed (the mover's drain and its new stage's first steps), each over its own span."""
    if not moves_at:
        return {}
    first, settled = min(moves_at), max(moves_at) + SETTLE_S
    phases = {"samples_per_s_before_moves": sum(s.samples for s in window if s.at <= first) / (first - t0)}
    if settled < t1:
        phases["samples_per_s_after_moves"] = sum(s.samples for s in window if s.at >= settled) / (t1 - settled)
        phases["after_moves_s"] = round(t1 - settled, 1)
    return phases


def _dump(lines: dict[str, list[tuple[float, Any]]], path: Path) -> None:
    """Every event line of every server and trainer, to `path` (JSON lines, `proc` names the process)."""
    with path.open("w") as f:
        for name, ls in lines.items():
            for _, x in ls:
                if dataclasses.is_dataclass(x) and not isinstance(x, type):
                    f.write(json.dumps({"proc": name, "event": getattr(x, "event", "ready"),
                                        **dataclasses.asdict(x)}) + "\n")


def arm_plan(args: argparse.Namespace) -> dict[str, tuple[PipelineLayout, list[str], float, float]]:
    """Arm -> (layout, extra run config, window seconds, kill period)."""
    even = PipelineLayout((args.servers,) * args.stages, args.trainers)
    uneven = PipelineLayout(tuple(int(x) for x in args.uneven.split(",")), args.trainers)
    return {
        "failure_free": (even, [], args.seconds, 0.0),
        "churn": (even, [], args.failure_seconds, args.period),
        "int8": (even, ["pipeline.activation_codec=int8"], args.seconds, 0.0),
        "uneven_off": (uneven, ["pipeline.rebalance=false"], args.uneven_seconds, 0.0),
        "uneven_on": (uneven, ["pipeline.rebalance=true", *REBALANCE], args.uneven_seconds, 0.0),
    }


def _git_commit() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True,
                           check=False).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def _table(results: dict[str, Any]) -> str:
    rows = ["| arm | layout | samples/s | lost | rerouted | kills | moves | kernel data MB | swarmtrain MB | ratio |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, arm in results["arms"].items():
        rows.append(f"| {key} | {arm['layout']} | {arm['samples_per_s']:.1f} | {arm['lost']} | {arm['rerouted']} | "
                    f"{arm['kills']} | {len(arm['stage_moves'])} | {arm['wire_data_payload_bytes'] / 1e6:.1f} | "
                    f"{arm['swarmtrain_bytes'] / 1e6:.1f} | {arm['wire_over_swarmtrain']:.3f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)}")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--servers", type=int, default=3, help="servers per stage (failure_free, churn, int8)")
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--uneven", default="4,2", help="servers per stage of the uneven arms")
    ap.add_argument("--rate", default="100mbit", help="every host's link rate, each direction")
    ap.add_argument("--server-cpus", type=float, default=None,
                    help="cap each stage server's host at this many CPUs (a cgroup each), so servers compute like "
                         "slow machines of their own instead of sharing every core; the coordinator and the "
                         "trainers stay uncapped (default: no cap)")
    ap.add_argument("--seconds", type=float, default=60.0, help="window of failure_free and int8")
    ap.add_argument("--failure-seconds", type=float, default=95.0, help="window of the churn arm")
    ap.add_argument("--period", type=float, default=30.0, help="seconds between two kills in the churn arm")
    ap.add_argument("--uneven-seconds", type=float, default=150.0, help="window of the uneven arms")
    ap.add_argument("--name", default="pbt", help="testbed name (it must not exist)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline-testbed.json"))
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
    plan = {k: v for k, v in arm_plan(args).items() if k in arms}
    base = [*RUN, *args.overrides]
    os.environ.setdefault("SWARMTRAIN_RUN_KEY", "pipeline testbed benchmark key")
    logs = Path(tempfile.mkdtemp(prefix="swarmtrain-pipeline-testbed-"))
    hosts = max(layout.num_hosts for layout, *_ in plan.values())
    results: dict[str, Any] = {
        "command": " ".join(sys.argv), "commit": _git_commit(), "overrides": base,
        "machine": {"cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                    "kernel": platform.release(), "python": platform.python_version()},
        "testbed": {"hosts": hosts, "rate_bit_s": parse_rate(args.rate), "cpus_per_server_host": args.server_cpus},
        "warmup_steps": WARMUP, "arms": {},
    }
    server_hosts = {h for layout, *_ in plan.values() for _, h, _ in layout.servers()}
    trainer_hosts = {h for layout, *_ in plan.values() for _, h in layout.trainer_hosts()}
    if args.server_cpus is not None and server_hosts & trainer_hosts:
        ap.error("--server-cpus: the arms' layouts put servers and trainers on the same hosts; run them apart")
    caps = {} if args.server_cpus is None else {h: args.server_cpus for h in sorted(server_hosts)}
    with Testbed(args.name, num_hosts=hosts, link=LinkSpec(rate_bit_s=parse_rate(args.rate)), cpus=caps) as tb:
        for key, (layout, extra, seconds, period) in plan.items():
            print(f"{key}: {layout.describe()} {extra} window {seconds:.0f}s", flush=True)
            arm = run_arm(tb, layout, [*base, *extra], seconds=seconds, period=period, log_dir=logs / key)
            results["arms"][key] = {"layout": layout.describe(), "overrides": extra, "period_s": period, **arm}
            print(f"{key}:", json.dumps(results["arms"][key]), flush=True)
    a = results["arms"]
    if "failure_free" in a and "churn" in a:
        results["churn_over_failure_free"] = a["churn"]["samples_per_s"] / a["failure_free"]["samples_per_s"]
    if "failure_free" in a and "int8" in a:
        results["int8_over_fp32"] = a["int8"]["samples_per_s"] / a["failure_free"]["samples_per_s"]
    if "uneven_off" in a and "uneven_on" in a:
        results["rebalance_on_over_off"] = a["uneven_on"]["samples_per_s"] / a["uneven_off"]["samples_per_s"]
        if "samples_per_s_after_moves" in a["uneven_on"]:
            on = a["uneven_on"]
            results["after_moves_over_off"] = on["samples_per_s_after_moves"] / a["uneven_off"]["samples_per_s"]
            results["after_moves_over_before"] = on["samples_per_s_after_moves"] / on["samples_per_s_before_moves"]
    print(_table(results))
    for k in ("churn_over_failure_free", "int8_over_fp32", "rebalance_on_over_off", "after_moves_over_off",
              "after_moves_over_before"):
        if k in results:
            print(f"{k}: {results[k]:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"saved {args.out} (process logs in {logs})")


if __name__ == "__main__":
    main()

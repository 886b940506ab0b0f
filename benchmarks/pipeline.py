"""Pipeline benchmark: samples/s of a SWARM pipeline of real processes on 127.0.0.1 against the same model
trained in one process, and with one stage server killed and restarted every PERIOD seconds against the
same pipeline without failures; peak RSS of every process.

    python benchmarks/pipeline.py --seconds 60 --period 30 --failure-seconds 100
    python benchmarks/pipeline.py --memory --seconds 20     # peak RSS, a 57M-parameter model
    python benchmarks/pipeline.py --outer --seconds 90      # outer rounds off / plain averaging / DiLoCo

Arms, one after another (each its own processes, every process 1 torch thread):
  one process   the same GPT (the pipeline's parts assembled) trained on the same micro-batches and steps
  pipeline 1×   coordinator + one server per stage + one trainer
  pipeline 2×   two servers per stage + one trainer, failure-free
  2×, churn     the same, one server SIGKILLed and restarted every PERIOD s (round-robin; it heals to
                its stage's θ_global when it comes back)
The servers of a stage run their outer rounds (every diloco.inner_steps of their inner steps) in every
arm; each arm reports how many each stage committed and whether its servers agreed on θ_global.
A pipeline arm's rate is counted from the trainer's step lines (their `at` times) once WARMUP steps are
done, over the arm's window.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WARMUP = 3
RUN = [
    "model.preset=small", "data.max_corpus_bytes=2000000", "data.seq_len=64", "inner.warmup_steps=5",
    "diloco.rounds=1000", "diloco.inner_steps=100", "pipeline.microbatch_size=4", "pipeline.samples_per_step=16",
    "pipeline.call_timeout_s=10", "pipeline.min_deadline_s=1", "pipeline.avoid_s=15",
    "discovery.heartbeat_s=1", "discovery.record_ttl_s=5", "rpc.call_timeout_s=10", "train.threads=1",
]


def vm_hwm_mb(pid: int) -> float:
    """Peak resident memory of a live process, MB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# -- the one-process arm (a subprocess, so its memory and threads are its own) ------------------------------
def single(overrides: list[str], seconds: float) -> None:
    import torch

    from swarmtrain.config import load_config
    from swarmtrain.data import load_corpus
    from swarmtrain.diloco.inner import build_inner_optimizer, lr_factor, set_lr
    from swarmtrain.peer.data import peer_batches
    from swarmtrain.testing.pipeline import reference_model

    torch.set_num_threads(1)
    cfg = load_config(overrides=overrides)
    model = reference_model(cfg)
    opt = build_inner_optimizer(model, cfg.inner)
    n, size = cfg.pipeline.samples_per_step, cfg.pipeline.microbatch_size
    batches = iter(peer_batches(cfg.replace(data={"batch_size": n}), load_corpus(cfg.data).train, "single"))
    total = cfg.diloco.rounds * cfg.diloco.inner_steps
    times, losses = [], []
    start = time.monotonic()
    step = 0
    while time.monotonic() - start < seconds or step < WARMUP + 2:
        idx, targets = next(batches)
        set_lr(opt, cfg.inner.lr * lr_factor(step, cfg=cfg.inner, total_steps=total))
        for i in range(0, n, size):
            _, loss = model(idx[i:i + size], targets[i:i + size])
            assert loss is not None
            (loss * size / n).backward()
        if cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        times.append(time.time())
        losses.append(loss.item())
    rate = n * (len(times) - 1 - WARMUP) / (times[-1] - times[WARMUP])
    print(json.dumps({"samples_per_s": rate, "steps": step, "peak_rss_mb": vm_hwm_mb(os.getpid()),
                      "params": sum(p.numel() for p in model.parameters()), "last_loss": losses[-1]}))


def run_single(overrides: list[str], seconds: float) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--worker-single", "--seconds", str(seconds),
                          *[x for o in overrides for x in ("--set", o)]], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the pipeline arms -------------------------------------------------------------------------------------
def run_pipeline(overrides: list[str], *, per_stage: int, stages: int, seconds: float, period: float,
                 log_dir: Path) -> dict[str, Any]:
    from swarmtrain.telemetry import HealEvent, StageRoundEvent, StepEvent
    from swarmtrain.testing.procs import ProcessSet, sigkill

    with ProcessSet(log_dir) as procs:
        _, join = procs.coordinator(overrides, timeout_s=180)
        # Stages interleaved: consecutive kills hit different stages, so one stage loses one server at a time.
        names = [(f"s{k}{chr(97 + x)}", k) for x in range(per_stage) for k in range(stages)]
        servers = {name: procs.peer(name, join, "--role", "server", "--stage", str(k)) for name, k in names}
        every = list(servers.values())  # killed ones too: their rounds count
        for s in servers.values():
            s.wait_ready(timeout_s=180)
        trainer = procs.peer("trainer", join, "--role", "trainer")
        trainer.wait_ready(timeout_s=180)
        trainer.wait_for(lambda x: isinstance(x, StepEvent) and x.step >= WARMUP, timeout_s=300, what="warm-up")
        start = time.monotonic()
        kills, turn, heals = 0, 0, 0
        while time.monotonic() - start < seconds:
            time.sleep(min(1.0, seconds - (time.monotonic() - start)) if seconds > 0 else 0)
            if period and time.monotonic() - start >= period * (kills + 1):
                name, k = names[turn % len(names)]
                turn += 1
                sigkill(servers[name])
                servers[name] = procs.peer(name, join, "--role", "server", "--stage", str(k))
                every.append(servers[name])
                kills += 1
        steps = [x for x in trainer.snapshot() if isinstance(x, StepEvent)]
        rss = {name: vm_hwm_mb(c.proc.pid) for name, c in [*servers.items(), ("trainer", trainer)] if c.alive}
        heals = sum(1 for c in every for x in c.snapshot() if isinstance(x, HealEvent) and x.to_round > 0)
        rounds = [x for c in every for x in c.snapshot() if isinstance(x, StageRoundEvent)]
    hashes: dict[tuple[int, int], set[str]] = {}
    for r in rounds:
        if r.committed:
            hashes.setdefault((r.stage, r.round), set()).add(r.hash)
    outer = {"committed": {str(k): sum(1 for st, _ in hashes if st == k) for k in range(stages)},
             "aborted_lines": sum(1 for r in rounds if not r.committed),
             "one_hash_per_round": all(len(h) == 1 for h in hashes.values()),
             "comm_s_mean": sum(r.comm_s for r in rounds if r.committed) / max(1, sum(r.committed for r in rounds))}
    timed = [s for s in steps if s.step > WARMUP]
    rate = sum(s.samples for s in timed[1:]) / (timed[-1].at - timed[0].at) if len(timed) > 1 else float("nan")
    return {"samples_per_s": rate, "steps": len(steps), "microbatches": sum(s.microbatches for s in steps),
            "lost": sum(s.lost for s in steps), "rerouted": sum(s.rerouted for s in steps), "kills": kills,
            "heals": heals, "outer_rounds": outer, "peak_rss_mb": rss, "loss_per_50_steps": _windows(steps, 50),
            "last_loss": steps[-1].loss if steps else None,
            "first_loss": steps[0].loss if steps else None}


def _windows(steps: list[Any], width: int) -> list[float]:
    """The trainer's mean loss over each `width` consecutive steps (a full window only)."""
    losses = [s.loss for s in steps if s.loss is not None]
    return [round(sum(losses[i:i + width]) / width, 4) for i in range(0, len(losses) - width + 1, width)]


def baseline_rss_mb() -> float:
    """Peak RSS of a process that imports what a stage server imports and builds no model."""
    code = ("import swarmtrain.roles.trainer, swarmtrain.peer.network, torch, os; "
            "print(open(f'/proc/{os.getpid()}/status').read())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return next(int(x.split()[1]) / 1024 for x in out.splitlines() if x.startswith("VmHWM:"))


def memory(overrides: list[str], *, stages: int, seconds: float, log_dir: Path) -> dict[str, Any]:
    """Peak RSS of one process training the whole model against each stage server and the trainer."""
    from swarmtrain.config import load_config
    from swarmtrain.pipeline.parts import build_ends, build_stage

    cfg = load_config(overrides=overrides)
    shares = [sum(p.numel() for p in build_stage(cfg.model, k, stages, seed=0).parameters()) for k in range(stages)]
    ends = sum(p.numel() for p in build_ends(cfg.model, seed=0).parameters())
    one = run_single(overrides, seconds)
    piped = run_pipeline(overrides, per_stage=1, stages=stages, seconds=seconds, period=0.0, log_dir=log_dir)
    return {"baseline_rss_mb": baseline_rss_mb(), "params_per_stage": shares, "params_trainer": ends,
            "params_total": one["params"], "single_peak_rss_mb": one["peak_rss_mb"],
            "pipeline_peak_rss_mb": piped["peak_rss_mb"], "single_steps": one["steps"],
            "pipeline_steps": piped["steps"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0, help="timed window of the failure-free arms")
    ap.add_argument("--failure-seconds", type=float, default=100.0, help="timed window of the churn arm")
    ap.add_argument("--period", type=float, default=30.0, help="seconds between two kills in the churn arm")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline.json"))
    ap.add_argument("--memory", action="store_true",
                    help="instead: peak RSS of one process against each stage server, on a larger model "
                         "(model.n_layer=8, n_embd=768; a few steps)")
    ap.add_argument("--outer", action="store_true",
                    help="instead: 2 servers per stage, the stages' outer rounds off (averaging.min_peers=99), "
                         "plain weight averaging (outer.lr=1, no momentum) and the run's DiLoCo outer step, "
                         "one after another over --seconds each: samples/s and the trainer's loss per 50 steps")
    ap.add_argument("--worker-single", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    overrides = [*RUN, f"pipeline.stages={args.stages}", *args.overrides]
    if args.worker_single:
        single(args.overrides, args.seconds)
        return
    os.environ.setdefault("SWARMTRAIN_RUN_KEY", "pipeline benchmark key")
    logs = Path(tempfile.mkdtemp(prefix="swarmtrain-pipeline-bench-"))
    if args.memory:
        big = [*overrides, "model.n_layer=8", "model.n_embd=768", "model.n_head=12", "data.seq_len=64"]
        result = {"command": " ".join(sys.argv), "overrides": big,
                  **memory(big, stages=args.stages, seconds=args.seconds, log_dir=logs / "memory")}
        print(json.dumps(result, indent=2))
        out = Path(args.out).with_name("pipeline-memory.json") if args.out.endswith("pipeline.json") else Path(args.out)
        out.write_text(json.dumps(result, indent=2))
        print(f"saved {out}")
        return
    if args.outer:
        variants = {"no_outer_rounds": ["averaging.min_peers=99"],
                    "plain_averaging": ["outer.lr=1.0", "outer.momentum=0", "outer.nesterov=false"],
                    "diloco_outer": []}
        result = {"command": " ".join(sys.argv), "overrides": overrides}
        for key, extra in variants.items():
            arm = run_pipeline([*overrides, *extra], per_stage=2, stages=args.stages, seconds=args.seconds,
                               period=0.0, log_dir=logs / key)
            result[key] = {"overrides": extra, **arm}
            print(f"{key}:", json.dumps({k: arm[k] for k in ("samples_per_s", "steps", "outer_rounds",
                                                              "loss_per_50_steps")}))
        out = Path(args.out).with_name("pipeline-outer.json") if args.out.endswith("pipeline.json") else Path(args.out)
        out.write_text(json.dumps(result, indent=2))
        print(f"saved {out}")
        return
    results: dict[str, Any] = {"command": " ".join(sys.argv), "overrides": overrides}
    results["single"] = run_single(overrides, args.seconds)
    print("one process:", json.dumps(results["single"]))
    for key, per_stage, seconds, period in (("pipeline_1x", 1, args.seconds, 0.0),
                                            ("pipeline_2x", 2, args.seconds, 0.0),
                                            ("pipeline_2x_churn", 2, args.failure_seconds, args.period)):
        results[key] = run_pipeline(overrides, per_stage=per_stage, stages=args.stages, seconds=seconds,
                                    period=period, log_dir=logs / key)
        print(f"{key}:", json.dumps(results[key]))
    single_rate = results["single"]["samples_per_s"]
    results["efficiency_1x"] = results["pipeline_1x"]["samples_per_s"] / single_rate
    results["efficiency_2x"] = results["pipeline_2x"]["samples_per_s"] / single_rate
    results["churn_over_failure_free"] = (results["pipeline_2x_churn"]["samples_per_s"]
                                          / results["pipeline_2x"]["samples_per_s"])
    for k in ("efficiency_1x", "efficiency_2x", "churn_over_failure_free"):
        print(f"{k}: {results[k]:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"saved {args.out} (process logs in {logs})")


if __name__ == "__main__":
    main()

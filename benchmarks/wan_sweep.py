"""Tune the WAN workload in-process: DiLoCo / DDP arms of wan.py's model and data, without the testbed.

Every arm continues from the same warm start (`--warm-start-steps` DDP steps at lr 3e-3, like
wan.py's) and trains `--rounds` x H steps per worker on 4 workers, with the final weights scored on
64 validation batches. Val loss depends only on the config here (no timing, no network), so arms
can run on a loaded box and be compared with each other; they are not wan.py's numbers (those train
on the testbed, and time-paced rounds vary the steps per peer).

    python benchmarks/wan_sweep.py --arm dl_mom0.8=outer.momentum=0.8 --arm dl_H25=diloco.inner_steps=25
    python benchmarks/wan_sweep.py --ddp-lr 6e-3 --rounds 32

Each arm's result (with its full config) goes to OUT/NAME-STEPS.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
from dataclasses import replace
from pathlib import Path

from convergence import Arm, Job, run_job, warm_start

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = ("model.preset=small", "data.seq_len=128", "data.batch_size=4", "data.max_corpus_bytes=20000000",
            "diloco.eval_batches=64")
DILOCO = ("compress.codec=int8", "inner.lr=0.0015", "outer.lr=1.0")  # on top: each arm's own overrides


def parse_arm(spec: str) -> tuple[str, tuple[str, ...]]:
    """"NAME=SECTION.KEY=VALUE,..." -> (NAME, overrides); NAME alone is the DiLoCo defaults above."""
    name, _, rest = spec.partition("=")
    if not name:
        raise SystemExit(f"--arm {spec!r}: give NAME or NAME=SECTION.KEY=VALUE[,...]")
    return name, tuple(x for x in rest.split(",") if x)


def build_jobs(args: argparse.Namespace) -> list[Job]:
    jobs = []
    for lr in args.ddp_lrs:
        arm = Arm(f"ddp_{lr:g}", "ddp", 50, overrides=(f"inner.lr={lr!r}",))
        jobs.append(Job("stdlib", args.seed, arm, 4, args.rounds * 50, WORKLOAD))
    for spec in args.arms:
        name, overrides = parse_arm(spec)
        h = next((int(x.split("=", 1)[1]) for x in overrides if x.startswith("diloco.inner_steps=")), 50)
        arm = Arm(name, "diloco", h, overrides=tuple(x for x in overrides if not x.startswith("diloco.inner_steps=")))
        jobs.append(Job("stdlib", args.seed, arm, 4, args.rounds * 50, (*WORKLOAD, *DILOCO)))
    return jobs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", dest="arms", action="append", default=[], metavar="NAME[=SECTION.KEY=VALUE,...]",
                   help="a DiLoCo arm (int8, inner lr 1.5e-3, outer lr 1.0, H=50 unless overridden)")
    p.add_argument("--ddp-lr", dest="ddp_lrs", type=float, action="append", default=[], help="a DDP arm at this lr")
    p.add_argument("--rounds", type=int, default=32, help="outer steps of H=50 (the token budget of every arm)")
    p.add_argument("--warm-start-steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "wan-workload-tuning")
    args = p.parse_args(argv)
    jobs = build_jobs(args)
    if not jobs:
        raise SystemExit("nothing to run: give --arm and/or --ddp-lr")
    args.out.mkdir(parents=True, exist_ok=True)
    warm_arm = Arm("ddp lr=0.003", "ddp", 50, overrides=("inner.lr=0.003",))
    with mp.get_context("fork").Pool(args.processes, maxtasksperchild=1) as pool:
        warm = pool.apply(warm_start, (Job("stdlib", args.seed, warm_arm, 4, args.warm_start_steps, WORKLOAD),))
        results = pool.map(run_job, [replace(j, warm=warm) for j in jobs], chunksize=1)
    for job, result in zip(jobs, results, strict=True):
        path = args.out / f"{job.arm.name}-{job.steps}.json"
        path.write_text(json.dumps(result, indent=1))
        print(f"{job.arm.name:<28} val {result['final_val_loss']:.4f}  -> {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run the deterministic simulation tester (swarmtrain/testing/sim) over many random fault schedules and report
safety violations, schedules without liveness after the faults stop, spinning peers and code errors.

    python benchmarks/consensus_sim.py                 # 10,000 schedules, 40 s of faults each (~1.5 h, 2 cores)
    python benchmarks/consensus_sim.py --schedules 1000 --faults-until 90 --start 100000
    python benchmarks/consensus_sim.py --schedules 200 --jobs 1       # a quick look

Each schedule draws 5-9 peers with clocks skewed by up to ±8 s, and crashes (restarting later, with their
checkpoint directory), frozen peers, partitions, stale DHT reads and lost calls until `--faults-until`
seconds of virtual time; then every fault ends and each live peer must commit within 20 attempt spans.
Schedule `seed` replays exactly: `run_schedule(Schedule.draw(seed, faults_until_s=...))`. Progress goes to a
JSON-lines file (one line per schedule) that `--resume` continues; the summary goes to `--out`. Exits 1 when
any schedule failed; its seed is printed.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _one(job: tuple[int, float]) -> dict[str, Any]:
    from swarmtrain.testing.sim.run import Schedule, run_schedule

    seed, faults_until_s = job
    schedule = Schedule.draw(seed, faults_until_s=faults_until_s)
    started = time.perf_counter()
    r = run_schedule(schedule)
    return {"seed": seed, "ok": r.ok, "peers": schedule.peers, "faults": len(schedule.faults),
            "kinds": sorted({f.kind for f in schedule.faults}), "rounds": r.rounds,
            "rounds_at_faults_end": r.rounds_at_faults_end, "recovered_s": r.recovered_s, "virtual_s": r.virtual_s,
            "safety": r.safety, "liveness": r.liveness, "bugs": r.bugs, "wall_s": time.perf_counter() - started,
            "summary": "" if r.ok else r.summary()}


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)  # a schedule's faults log by the hundred
    import torch

    torch.set_num_threads(1)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize(rows: list[dict[str, Any]], *, faults_until_s: float, wall_s: float, jobs: int) -> dict[str, Any]:
    recovered = [r["recovered_s"] for r in rows if r["recovered_s"] is not None]
    kinds: dict[str, int] = {}
    for r in rows:
        for k in r["kinds"]:
            kinds[k] = kinds.get(k, 0) + 1
    return {
        "schedules": len(rows), "faults_until_s": faults_until_s, "seeds": [min(r["seed"] for r in rows),
                                                                          max(r["seed"] for r in rows)],
        "safety_violations": sum(bool(r["safety"]) for r in rows),
        "without_liveness": sum(any(x.startswith(("no commit", "deadlock")) for x in r["liveness"]) for r in rows),
        "spinning": sum(any("attempts within" in x for x in r["liveness"]) for r in rows),
        "code_errors": sum(bool(r["bugs"]) for r in rows),
        "failed_seeds": [r["seed"] for r in rows if not r["ok"]][:50],
        "peers": {"min": min(r["peers"] for r in rows), "max": max(r["peers"] for r in rows)},
        "faults_per_schedule": statistics.mean(r["faults"] for r in rows),
        "schedules_with_fault_kind": kinds,
        "rounds_per_schedule": {"median": statistics.median(r["rounds"] for r in rows),
                                "min": min(r["rounds"] for r in rows)},
        "recovered_s": {"median": statistics.median(recovered) if recovered else None,
                        "p99": _percentile(recovered, 0.99), "max": max(recovered, default=None)},
        "virtual_s_total": sum(r["virtual_s"] for r in rows),
        "wall_s": wall_s, "jobs": jobs, "machine": f"{os.cpu_count()}-core {os.uname().machine}",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--start", type=int, default=0, help="first seed")
    parser.add_argument("--faults-until", type=float, default=40.0, help="virtual seconds of faults per schedule")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--progress", default=str(REPO / "benchmarks" / "results" / "consensus-sim.jsonl"))
    parser.add_argument("--resume", action="store_true", help="skip the seeds the progress file already holds")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "consensus-sim.json"))
    args = parser.parse_args()
    progress = Path(args.progress)
    done: dict[int, dict[str, Any]] = {}
    if args.resume and progress.is_file():
        for line in progress.read_text().splitlines():
            row = json.loads(line)
            done[row["seed"]] = row
    elif progress.exists():
        progress.unlink()
    seeds = [s for s in range(args.start, args.start + args.schedules) if s not in done]
    started = time.perf_counter()
    rows = [done[s] for s in sorted(done) if args.start <= s < args.start + args.schedules]
    with progress.open("a") as out, multiprocessing.get_context("fork").Pool(args.jobs, initializer=_quiet) as pool:
        for i, row in enumerate(pool.imap_unordered(_one, [(s, args.faults_until) for s in seeds], chunksize=4)):
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            if not row["ok"]:
                print(f"FAILED {row['summary']}", flush=True)
            if (i + 1) % 100 == 0:
                print(f"{len(rows)} schedules, {sum(not r['ok'] for r in rows)} failed, "
                      f"{time.perf_counter() - started:.0f} s", flush=True)
    summary = summarize(rows, faults_until_s=args.faults_until, wall_s=round(time.perf_counter() - started, 1),
                        jobs=args.jobs)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 1 if summary["failed_seeds"] else 0


if __name__ == "__main__":
    sys.exit(main())

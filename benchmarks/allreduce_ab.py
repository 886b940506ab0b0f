"""The all-reduce benchmark of two checkouts side by side: `benchmarks/allreduce.py` run alternately from this
tree and from another (`git worktree add /tmp/old <commit>`), A B A B ..., so that both see the same machine
state; prints each run's seconds per arm (and each arm's CPU seconds per peer), the medians and new / old.

    git worktree add /tmp/old 84744cc
    python benchmarks/allreduce_ab.py --old /tmp/old --pairs 6 -- --numel 25000000 --peers 4 --arms ours

Everything after `--` goes to allreduce.py (its `--out` is set here). Results: `--out` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(tree: Path, extra: list[str], out: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, "benchmarks/allreduce.py", *extra, "--out", str(out)], cwd=tree, env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = json.loads(out.read_text())["results"]
    seconds = {f"{arm} {r['numel']} x{r['peers']}": a["median_s"] for r in results for arm, a in r["arms"].items()}
    cpu = {f"{arm} {r['numel']} x{r['peers']} cpu/peer": a["cpu_s_per_peer"] for r in results
           for arm, a in r["arms"].items() if a.get("cpu_s_per_peer") is not None}
    return seconds | cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="the other checkout's root")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "allreduce-ab.json"))
    args, extra = parser.parse_known_args()
    extra = [x for x in extra if x != "--"]
    old, new = Path(args.old).resolve(), REPO
    runs: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for name, tree in (("old", old), ("new", new)):
                got = _run(tree, extra, Path(tmp) / f"{name}-{i}.json")
                for arm, seconds in got.items():
                    runs[name].setdefault(arm, []).append(seconds)
                print(f"pair {i + 1}/{args.pairs} {name}: " + ", ".join(f"{a} {s:.3f} s" for a, s in got.items()),
                      flush=True)
    summary = {}
    for arm in runs["new"]:
        o, n = statistics.median(runs["old"][arm]), statistics.median(runs["new"][arm])
        summary[arm] = {"old_s": runs["old"][arm], "new_s": runs["new"][arm], "old_median_s": o, "new_median_s": n,
                        "new_over_old": n / o}
        print(f"{arm}: old {o:.3f} s, new {n:.3f} s (medians of {args.pairs}): new / old = {n / o:.3f}")
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=old, capture_output=True, text=True).stdout
    Path(args.out).write_text(json.dumps({"old_tree": str(old), "old_commit": git.strip(), "allreduce_args": extra,
                                          "pairs": args.pairs, "arms": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

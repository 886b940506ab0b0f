"""The peer-cost benchmark of two checkouts side by side: `benchmarks/peer_cost.py` (this tree's script) run
alternately on the swarmtrain of this tree and of another (`git worktree add /tmp/old <commit>`), A B A B ..., so
that both see the same machine state; prints each run's figures per peer, the medians and new / old.

    git worktree add /tmp/old 1580029
    python benchmarks/peer_cost_ab.py --old /tmp/old --pairs 3 -- --preset medium

Everything after `--` goes to peer_cost.py (its `--out` is set here). Figures per peer: event-loop lag p99 from
READY to the last round, peak RSS, seconds per inner step, the wall time READY to exit; and at the first round,
the event loops running in the peer process and its OS threads. Results: `--out` (JSON).
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
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FIGURES = ("lag_p99_ms", "peak_rss_gb", "step_s", "wall_s", "event_loops", "os_threads")


def _run(tree: Path, extra: list[str], out: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "peer_cost.py"), *extra, "--out", str(out)], cwd=REPO,
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    doc = json.loads(out.read_text())
    if not doc["agreement"]["all_agree"]:
        raise SystemExit(f"{tree}: the peers committed different states: {doc['agreement']}")
    rows = []
    for f in doc["peers"].values():
        threads = f.get("threads_at_first_round") or {}
        rows.append({"lag_p99_ms": f["lag_ms"]["steady"]["p99_ms"], "peak_rss_gb": f["peak_rss_bytes"] / 1e9,
                     "step_s": f["step_s"], "wall_s": doc["wall_s_ready_to_exit"],
                     "event_loops": threads.get("event_loops"), "os_threads": threads.get("os_threads"),
                     "python_threads": threads.get("python_threads")})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="the other checkout's root")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "peer-cost-ab.json"))
    args, extra = parser.parse_known_args()
    extra = [x for x in extra if x != "--"]
    old, new = Path(args.old).resolve(), REPO
    runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for name, tree in (("old", old), ("new", new)):
                rows = _run(tree, extra, Path(tmp) / f"{name}-{i}.json")
                runs[name] += rows
                print(f"pair {i + 1}/{args.pairs} {name}: " + "; ".join(
                    ", ".join(f"{k} {r[k]}" if not isinstance(r[k], float) else f"{k} {r[k]:.3f}" for k in FIGURES)
                    for r in rows), flush=True)
    summary: dict[str, dict[str, float]] = {}
    for k in FIGURES:
        o = statistics.median(r[k] for r in runs["old"] if r[k] is not None) if any(
            r[k] is not None for r in runs["old"]) else float("nan")
        n = statistics.median(r[k] for r in runs["new"] if r[k] is not None)
        summary[k] = {"old_median": o, "new_median": n, "new_over_old": n / o if o else float("nan")}
        print(f"{k}: old {o:.3f}, new {n:.3f} (medians over {len(runs['new'])} peer runs): new / old = {n / o:.3f}")
    commit = {name: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True,
                                   text=True).stdout.strip() for name, tree in (("old", old), ("new", new))}
    print(f"Python threads at the first round: old {runs['old'][0]['python_threads']}; "
          f"new {runs['new'][0]['python_threads']}")
    Path(args.out).write_text(json.dumps({"commits": commit, "peer_cost_args": extra, "pairs": args.pairs,
                                          "machine": "2-core x86 CPU machine", "figures": summary, "runs": runs},
                                         indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

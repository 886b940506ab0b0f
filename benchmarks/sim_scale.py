"""The round at a swarm's size in the simulator (swarmtrain/testing/sim/scale.py): N peers on access links of
5-50 ms one way (round trips of 20-200 ms), each peer crashing with probability `--churn` per round (at any
moment of it) and restarting from its checkpoint 5-30 s later, the production round code on virtual time.

Per size: the rounds committed, the share of peers' round attempts that committed, the share of rounds that
every peer present committed at its first attempt, each round's length outside compute (median, p90), the
simulated calls and DHT operations per peer per round, and the wall time the simulation took here.

  python benchmarks/sim_scale.py --peers 8 16 32 64 --rounds 10
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--rounds", type=int, default=10, help="rounds' worth of virtual time per size")
    p.add_argument("--churn", type=float, default=0.01, help="crash probability per peer per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/sim-scale.json")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)
    import torch

    from swarmtrain.testing.sim.scale import ScaleRun, run_scale

    torch.set_num_threads(1)
    rows = []
    for n in args.peers:
        started = time.perf_counter()
        result = run_scale(ScaleRun(peers=n, rounds=args.rounds, churn=args.churn, seed=args.seed))
        row = {**result.summary(), "wall_s": time.perf_counter() - started}
        per = max(1, n * max(1, row["rounds"]))
        row["calls_per_peer_round"] = row["calls"] / per
        row["dht_ops_per_peer_round"] = row["dht_ops"] / per
        rows.append(row)
        print(f"{n:5d} peers: {row['rounds']} rounds, attempts committed {100 * row['commit_rate']:.1f}%, rounds "
              f"first try {100 * row['first_try_rate']:.1f}%, outside compute median {row['outside_s_median']:.2f} s "
              f"p90 {row['outside_s_p90']:.2f} s, {row['calls_per_peer_round']:.0f} calls and "
              f"{row['dht_ops_per_peer_round']:.1f} DHT ops per peer per round, {row['crashes']} crashes, "
              f"safety {row['safety'] or 'ok'}; {row['wall_s']:.0f} s here; aborts {row['abort_reasons']}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows,
                               "machine": "2-core x86 CPU machine (simulation wall time)"}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

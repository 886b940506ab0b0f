"""Byzantine members: 1 of 8 simulated DiLoCo workers sends an attack instead of its pseudo-gradient.

For each attack (scale: Δ×100, signflip: −4Δ, random: noise of 10× Δ's norm, nan) and each aggregator
(mean, trimmed_mean with trim 1), trains the same model from the same init on the same data as the
attack-free run, and prints the final val loss and its ratio to the attack-free run of the same
aggregator (and to the attack-free mean). Saves JSON under benchmarks/results/.

    python benchmarks/byzantine.py                        # the docs/benchmarks.md table (2 processes)
    python benchmarks/byzantine.py --rounds 5 --inner-steps 5 --out /tmp/b.json   # a quick look
    python benchmarks/byzantine.py --cost-only           # what a reducer pays for the trimmed mean

Also measures, side by side in one process, a reducer's time to combine 8 int8 contributions of a
4M-value shard with each aggregator (median of 5 runs each).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
ATTACKS = ("scale", "signflip", "random", "nan")
AGGREGATORS = ("mean", "trimmed_mean")


def _arm(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from swarmtrain.averaging.aggregate import Aggregation
    from swarmtrain.averaging.attacks import with_byzantine
    from swarmtrain.averaging.inprocess import InProcessGroup
    from swarmtrain.compress import codec_from_config
    from swarmtrain.config import load_config
    from swarmtrain.data import load_corpus
    from swarmtrain.diloco.simulation import simulate_diloco
    from swarmtrain.diloco.worker import round_device_of

    torch.set_num_threads(1)
    cfg = load_config(overrides=[*job["overrides"], f"averaging.aggregator={json.dumps(job['aggregator'])}"])
    corpus = load_corpus(cfg.data)
    codec = codec_from_config(cfg.compress, seed=cfg.train.seed, device=round_device_of(cfg))
    group = InProcessGroup(codec, num_workers=job["workers"],
                           aggregation=Aggregation(cfg.averaging.aggregator, cfg.averaging.trim))
    average_all = group.average_all
    if job["attack"]:
        average_all = with_byzantine(average_all, num_workers=job["workers"], byzantine=job["byzantine"],
                                     name=job["attack"], seed=cfg.train.seed)
    start = time.perf_counter()
    result = simulate_diloco(cfg, train_tokens=corpus.train, val_tokens=corpus.val, num_workers=job["workers"],
                             average_all=average_all, codec=codec)
    return {**job, "initial_val_loss": result.initial_val_loss, "final_val_loss": result.final_val_loss,
            "val_losses": [r.val_loss for r in result.rounds], "wall_s": time.perf_counter() - start}


def reducer_cost(*, parts: int = 8, numel: int = 4 << 20, repeats: int = 5) -> dict[str, float]:
    """Seconds (median of `repeats`) a reducer takes to combine `parts` encoded int8 shards, per aggregator."""
    import statistics

    import torch

    from swarmtrain.averaging.aggregate import Aggregation, aggregate_encoded
    from swarmtrain.compress import get_codec

    torch.set_num_threads(1)
    codec = get_codec("int8")
    g = torch.Generator().manual_seed(0)
    encoded = [codec.encode(torch.randn(numel, generator=g)) for _ in range(parts)]
    out = torch.empty(numel)
    times: dict[str, list[float]] = {rule: [] for rule in AGGREGATORS}
    for _ in range(repeats):
        for rule in AGGREGATORS:  # interleaved: the machine's noise hits both alike
            start = time.perf_counter()
            aggregate_encoded(codec, encoded, Aggregation(rule), out=out)
            times[rule].append(time.perf_counter() - start)
    return {rule: statistics.median(t) for rule, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--byzantine", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--codec", default="int8")
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "byzantine.json"))
    parser.add_argument("--cost-only", action="store_true", help="only the reducer's cost of each aggregator")
    args = parser.parse_args()
    cost = reducer_cost()
    print(f"a reducer combining 8 int8 shards of 4M values: mean {cost['mean']:.3f} s, trimmed_mean "
          f"{cost['trimmed_mean']:.3f} s ({cost['trimmed_mean'] / cost['mean']:.1f}x)")
    if args.cost_only:
        return 0
    overrides = [f"model.preset={json.dumps(args.model)}", f"diloco.rounds={args.rounds}",
                 f"diloco.inner_steps={args.inner_steps}", f"compress.codec={json.dumps(args.codec)}",
                 f"data.paths={json.dumps([args.data])}", "train.threads=1"]
    jobs = [{"attack": attack, "aggregator": aggregator, "workers": args.workers,
             "byzantine": args.byzantine if attack else 0, "overrides": overrides}
            for attack in ("", *ATTACKS) for aggregator in AGGREGATORS]
    with mp.get_context("spawn").Pool(args.processes) as pool:
        results = pool.map(_arm, jobs)
    clean = {r["aggregator"]: r["final_val_loss"] for r in results if not r["attack"]}
    print(f"{args.byzantine} of {args.workers} workers Byzantine; model {args.model}, {args.rounds} rounds × "
          f"{args.inner_steps} inner steps, codec {args.codec}; initial val loss {results[0]['initial_val_loss']:.3f}")
    print(f"{'attack':<10} {'aggregator':<13} {'final val loss':>15} {'÷ clean, same agg.':>19} {'÷ clean mean':>13}")
    for r in results:
        loss = r["final_val_loss"]
        print(f"{r['attack'] or 'none':<10} {r['aggregator']:<13} {loss:>15.4f} "
              f"{loss / clean[r['aggregator']]:>19.3f} {loss / clean['mean']:>13.3f}")
    Path(args.out).write_text(json.dumps({"args": vars(args), "reducer_cost_s": cost, "results": results},
                                         indent=1) + "\n")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

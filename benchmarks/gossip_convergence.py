"""Gossip convergence: NoLoCo (groups of 2, no all-reduce) against DiLoCo (all-reduce) and data-parallel, on the
same tokens, at K workers.

Every arm trains the same model from the same init on the same token stream (worker k's batch at step t is
slot k of the data-parallel K×B batch at step t) for the same number of optimizer steps per worker; both
DiLoCo and NoLoCo send Δ with the same codec (NoLoCo also sends φ with `averaging.gossip_weights_codec`).
Prints each arm's final val loss (NoLoCo: replica 0's, the replicas' mean and their spread), the ratios
NoLoCo / DiLoCo and to DDP, and the bytes each worker sent per round; writes JSON under benchmarks/results/.

    python benchmarks/gossip_convergence.py                        # K = 8, H = 50, 128 outer steps, int8
    python benchmarks/gossip_convergence.py --workers 8 16 --jobs 2
    python benchmarks/gossip_convergence.py --workers 4 --rounds 4 --inner-steps 5   # a quick check
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
MODES = ("ddp", "diloco", "noloco")


def run_arm(job: tuple[str, int, list[str]]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from swarmtrain.averaging.inprocess import InProcessGroup
    from swarmtrain.compress import codec_from_config, get_codec
    from swarmtrain.config import load_config
    from swarmtrain.data import load_corpus
    from swarmtrain.diloco.gossip_simulation import simulate_noloco
    from swarmtrain.diloco.simulation import simulate_ddp, simulate_diloco

    mode, workers, overrides = job
    cfg = load_config(overrides=[*overrides, *(['averaging.mode="gossip"'] if mode == "noloco" else [])])
    corpus = load_corpus(cfg.data)
    began = time.perf_counter()

    def progress(record: Any) -> None:
        if (record.round + 1) % 16 == 0:
            sys.stderr.write(f"  K={workers} {mode:<7} round {record.round + 1}: val {record.val_loss:.4f} "
                             f"({time.perf_counter() - began:.0f}s)\n")

    data = {"train_tokens": corpus.train, "val_tokens": corpus.val, "num_workers": workers, "on_round": progress}
    gossip = None
    if mode == "ddp":
        result = simulate_ddp(cfg, wire_codec=get_codec("fp32"), **data)
    else:
        codec = codec_from_config(cfg.compress, seed=cfg.train.seed)
        if mode == "diloco":
            result = simulate_diloco(cfg, average_all=InProcessGroup(codec, num_workers=workers).average_all,
                                     codec=codec, **data)
        else:
            result, gossip = simulate_noloco(cfg, codec=codec, **data)
    out = result.to_json(cfg)
    del out["config"]
    out["overrides"] = overrides
    if gossip is not None:
        out["gossip"] = gossip.to_json()
    sys.stderr.write(f"  done K={workers} {mode:<7} val {out['final_val_loss']:.4f} ({out['wall_s']:.0f}s)\n")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[8])
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=128, help="outer steps (DDP: rounds × H steps)")
    parser.add_argument("--codec", default="int8", help="Δ's codec for DiLoCo and NoLoCo (compress.codec)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every arm (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="arms trained at once (one process each)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gossip-convergence.json"))
    args = parser.parse_args()
    common = [f"diloco.inner_steps={args.inner_steps}", f"diloco.rounds={args.rounds}",
              f"compress.codec={json.dumps(args.codec)}", *args.overrides]
    jobs = [(mode, k, common) for k in args.workers for mode in MODES]
    start = time.perf_counter()
    with mp.get_context("fork").Pool(args.jobs) as pool:
        results = pool.map(run_arm, jobs, chunksize=1)
    rows = []
    for k in args.workers:
        by = {r["mode"]: r for r in results if r["workers"] == k}
        nl, dl, ddp = by["noloco"], by["diloco"], by["ddp"]
        rounds = len(nl["rounds"])
        row = {
            "workers": k, "inner_steps": args.inner_steps, "rounds": rounds, "codec": args.codec,
            "val_loss": {m: by[m]["final_val_loss"] for m in MODES},
            "noloco_mean_replica_val_loss": nl["gossip"]["mean_replica_val_loss"],
            "noloco_replica_val_losses": nl["gossip"]["replica_val_losses"],
            "noloco_over_diloco": nl["final_val_loss"] / dl["final_val_loss"],
            "noloco_over_ddp": nl["final_val_loss"] / ddp["final_val_loss"],
            "diloco_over_ddp": dl["final_val_loss"] / ddp["final_val_loss"],
            "bytes_per_worker_per_round": {m: by[m]["bytes_sent"] / rounds for m in MODES},
            "spread": [r["spread"] for r in nl["rounds"]],
            "clipped": nl["gossip"]["clipped"],
            "val_curves": {m: [r["val_loss"] for r in by[m]["rounds"]] for m in MODES},
        }
        rows.append(row)
        spread = row["spread"]
        print(f"K={k} H={args.inner_steps} rounds={rounds} Δ codec {args.codec}")
        for m in MODES:
            print(f"  {m:<7} final val loss {by[m]['final_val_loss']:.4f}   bytes/worker/round "
                  f"{row['bytes_per_worker_per_round'][m] / 1e6:9.3f} MB")
        print(f"  noloco replicas: mean-φ val {row['noloco_mean_replica_val_loss']:.4f}, replica range "
              f"{min(row['noloco_replica_val_losses']):.4f}..{max(row['noloco_replica_val_losses']):.4f}; spread "
              f"(relative L2 to the mean φ) first {spread[0]:.4f}, max {max(spread):.4f}, last {spread[-1]:.4f}; "
              f"partner parts clipped {row['clipped']}")
        print(f"  NoLoCo / DiLoCo val loss {row['noloco_over_diloco']:.4f} (target <= 1.01); NoLoCo / DDP "
              f"{row['noloco_over_ddp']:.4f}; DiLoCo / DDP {row['diloco_over_ddp']:.4f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "runs": results, "wall_s": time.perf_counter() - start,
                               "command": " ".join(sys.argv)}, indent=1) + "\n", encoding="utf-8")
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

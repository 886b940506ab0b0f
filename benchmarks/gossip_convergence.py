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
    python benchmarks/gossip_convergence.py --rounds 32 --modes diloco noloco --gossip-grid 0.7:0.5 0.7:0.8 --jobs 2

`--gossip-grid LR:MOMENTUM ...` trains one NoLoCo arm per (averaging.gossip_lr, averaging.gossip_momentum)
pair on the same tokens (a tuning sweep); each gets its row of ratios against DiLoCo and DDP.
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
    from swarmtrain.diloco.worker import round_device_of

    mode, workers, overrides = job
    if mode.startswith("noloco"):
        overrides = [*overrides, 'averaging.mode="gossip"', *_grid_overrides(mode)]
    cfg = load_config(overrides=overrides)
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
        codec = codec_from_config(cfg.compress, seed=cfg.train.seed, device=round_device_of(cfg))
        if mode == "diloco":
            result = simulate_diloco(cfg, average_all=InProcessGroup(codec, num_workers=workers).average_all,
                                     codec=codec, **data)
        else:
            result, gossip = simulate_noloco(cfg, codec=codec, **data)
    out = result.to_json(cfg)
    del out["config"]
    out["overrides"] = overrides
    out["arm"] = mode
    if gossip is not None:
        out["gossip"] = gossip.to_json()
    sys.stderr.write(f"  done K={workers} {mode:<7} val {out['final_val_loss']:.4f} ({out['wall_s']:.0f}s)\n")
    return out


def _grid_overrides(arm: str) -> list[str]:
    """`noloco@0.7:0.5` -> the gossip lr and momentum overrides of that arm (`noloco` alone: the config's)."""
    if "@" not in arm:
        return []
    lr, momentum = arm.split("@", 1)[1].split(":")
    return [f"averaging.gossip_lr={float(lr)}", f"averaging.gossip_momentum={float(momentum)}"]


def _grid_point(text: str) -> str:
    try:
        lr, momentum = text.split(":")
        float(lr), float(momentum)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LR:MOMENTUM (e.g. 0.7:0.5)") from None
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[8])
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=128, help="outer steps (DDP: rounds × H steps)")
    parser.add_argument("--codec", default="int8", help="Δ's codec for DiLoCo and NoLoCo (compress.codec)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every arm (repeatable)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="arms to train (the ratios need diloco and ddp; a missing one is left out)")
    parser.add_argument("--gossip-grid", nargs="+", type=_grid_point, default=[], metavar="LR:MOMENTUM",
                        help="one NoLoCo arm per (averaging.gossip_lr, averaging.gossip_momentum) pair")
    parser.add_argument("--jobs", type=int, default=1, help="arms trained at once (one process each)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gossip-convergence.json"))
    args = parser.parse_args()
    common = [f"diloco.inner_steps={args.inner_steps}", f"diloco.rounds={args.rounds}",
              f"compress.codec={json.dumps(args.codec)}", *args.overrides]
    arms = [m for m in args.modes if m != "noloco"]
    if "noloco" in args.modes:
        arms += [f"noloco@{point}" for point in args.gossip_grid] or ["noloco"]
    jobs = [(arm, k, common) for k in args.workers for arm in arms]
    start = time.perf_counter()
    with mp.get_context("fork").Pool(args.jobs) as pool:
        results = pool.map(run_arm, jobs, chunksize=1)
    rows = []
    for k in args.workers:
        by = {r["arm"]: r for r in results if r["workers"] == k}
        dl, ddp = by.get("diloco"), by.get("ddp")
        print(f"K={k} H={args.inner_steps} rounds={args.rounds} Δ codec {args.codec}")
        for arm in arms:
            r = by[arm]
            rounds = len(r["rounds"])
            print(f"  {arm:<16} final val loss {r['final_val_loss']:.4f}   bytes/worker/round "
                  f"{r['bytes_sent'] / rounds / 1e6:9.3f} MB")
        for arm in (a for a in arms if a.startswith("noloco")):
            nl = by[arm]
            rounds = len(nl["rounds"])
            row = {
                "workers": k, "inner_steps": args.inner_steps, "rounds": rounds, "codec": args.codec, "arm": arm,
                "gossip_overrides": _grid_overrides(arm),
                "val_loss": {a: by[a]["final_val_loss"] for a in ("ddp", "diloco", arm) if a in by},
                "noloco_mean_replica_val_loss": nl["gossip"]["mean_replica_val_loss"],
                "noloco_replica_val_losses": nl["gossip"]["replica_val_losses"],
                "noloco_over_diloco": nl["final_val_loss"] / dl["final_val_loss"] if dl else None,
                "noloco_over_ddp": nl["final_val_loss"] / ddp["final_val_loss"] if ddp else None,
                "diloco_over_ddp": dl["final_val_loss"] / ddp["final_val_loss"] if dl and ddp else None,
                "bytes_per_worker_per_round": {a: by[a]["bytes_sent"] / rounds for a in ("ddp", "diloco", arm)
                                               if a in by},
                "spread": [r["spread"] for r in nl["rounds"]],
                "clipped": nl["gossip"]["clipped"],
                "val_curves": {a: [r["val_loss"] for r in by[a]["rounds"]] for a in ("ddp", "diloco", arm)
                               if a in by},
            }
            rows.append(row)
            spread = row["spread"]
            print(f"  {arm} replicas: mean-φ val {row['noloco_mean_replica_val_loss']:.4f}, replica range "
                  f"{min(row['noloco_replica_val_losses']):.4f}..{max(row['noloco_replica_val_losses']):.4f}; "
                  f"spread (relative L2 to the mean φ) first {spread[0]:.4f}, max {max(spread):.4f}, last "
                  f"{spread[-1]:.4f}; partner parts clipped {row['clipped']}")
            ratios = [f"{name} {row[key]:.4f}" for name, key in (("NoLoCo / DiLoCo val loss", "noloco_over_diloco"),
                                                                ("NoLoCo / DDP", "noloco_over_ddp"),
                                                                ("DiLoCo / DDP", "diloco_over_ddp"))
                      if row[key] is not None]
            print(f"  {arm}: " + "; ".join(ratios) + (" (target NoLoCo / DiLoCo <= 1.01)" if dl else ""))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "runs": results, "wall_s": time.perf_counter() - start,
                               "command": " ".join(sys.argv)}, indent=1) + "\n", encoding="utf-8")
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

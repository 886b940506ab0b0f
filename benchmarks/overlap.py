"""Overlapped DiLoCo (diloco.overlap) vs classic DiLoCo: what landing the mean k inner steps late costs.

In-process simulation (no network), the paper's warm-start protocol: every arm continues from one
DDP checkpoint. Arms: classic DiLoCo, and overlapped DiLoCo with the mean landing after
k = --max-steps inner steps of the next round (`diloco.overlap_max_steps`; the simulation lands every
mean exactly there, a real peer's worst case). Prints final val loss per arm and its ratio to classic.

  python benchmarks/overlap.py                     # the README figures (~10 min on 2 cores)
  python benchmarks/overlap.py --rounds 8 --max-steps 3    # a quick look
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

BASE = ("model.preset=tiny", "data.seq_len=64", "data.batch_size=8", "diloco.eval_batches=16", "diloco.inner_steps=50")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=32, help="outer steps after the warm start (default: 32)")
    p.add_argument("--max-steps", type=int, nargs="+", default=[2, 3, 5, 10, 50],
                   help="overlapped arms: inner steps before the mean lands (50 = a whole round)")
    p.add_argument("--warm-start-steps", type=int, default=400)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="overrides", action="append", default=["outer.lr=1.0"], metavar="SECTION.KEY=VALUE",
                   help="config override of every DiLoCo arm (default: outer.lr=1.0, the warm-start sweep's best)")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/overlap.json")
    return p.parse_args(argv)


def _config(overrides: list[str]) -> Any:
    from swarmtrain.config import load_config

    return load_config(overrides=[*BASE, *overrides])


def warm_start(args: argparse.Namespace) -> bytes:
    import torch

    from swarmtrain.data import load_corpus
    from swarmtrain.diloco.simulation import simulate_ddp

    torch.set_num_threads(1)
    cfg = _config([f"train.seed={args.seed}", f"diloco.rounds={args.warm_start_steps // 50}", "inner.lr=1.2e-2"])
    data = load_corpus(cfg.data)
    result = simulate_ddp(cfg, train_tokens=data.train, val_tokens=data.val, num_workers=args.workers)
    return result.final_theta.numpy().tobytes()


def run_arm(job: tuple[str, list[str], bytes, argparse.Namespace]) -> dict[str, Any]:
    import torch

    from swarmtrain.averaging.inprocess import InProcessGroup
    from swarmtrain.compress import get_codec
    from swarmtrain.data import load_corpus
    from swarmtrain.diloco.simulation import simulate_diloco

    name, overrides, theta, args = job
    torch.set_num_threads(1)
    cfg = _config([f"train.seed={args.seed}", f"diloco.rounds={args.rounds}", *args.overrides, *overrides])
    data = load_corpus(cfg.data)
    start = time.perf_counter()
    result = simulate_diloco(cfg, train_tokens=data.train, val_tokens=data.val, num_workers=args.workers,
                             average_all=InProcessGroup(get_codec("fp32"), num_workers=args.workers).average_all,
                             init_theta=torch.frombuffer(bytearray(theta), dtype=torch.float32),
                             start_step=args.warm_start_steps)
    return {"arm": name, "overrides": overrides, "val_loss": result.rounds[-1].val_loss,
            "curve": [r.val_loss for r in result.rounds], "initial_val_loss": result.initial_val_loss,
            "wall_s": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    theta = warm_start(args)
    jobs = [("classic", [], theta, args)]
    jobs += [(f"overlap k={k}", ["diloco.overlap=true", f"diloco.overlap_max_steps={k}"], theta, args)
             for k in args.max_steps]
    with ProcessPoolExecutor(args.processes) as pool:
        results = list(pool.map(run_arm, jobs))
    classic = results[0]["val_loss"]
    print(f"\n{'arm':>16} {'val loss':>9} {'vs classic':>11}")
    for r in results:
        r["vs_classic"] = r["val_loss"] / classic - 1
        print(f"{r['arm']:>16} {r['val_loss']:9.4f} {100 * r['vs_classic']:+10.2f}%")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "base": BASE, "rounds": args.rounds,
                               "warm_start_steps": args.warm_start_steps, "workers": args.workers,
                               "overrides": args.overrides, "results": results}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fuzz every decoder of network bytes with mutated inputs: prints, per decoder, how many inputs were
accepted, refused with the decoder's typed error, and crashed (any other exception), and the rate.

    python benchmarks/fuzz.py                      # 50,000 inputs per decoder (800,000 in all)
    python benchmarks/fuzz.py --per-target 500     # a quick look

Exits 1 when any input crashed a decoder; the first few crashing inputs are written next to the results.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-target", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fuzz.json"))
    args = parser.parse_args()

    import torch

    from swarmtrain.testing.fuzz import TARGETS, mutate

    torch.set_num_threads(1)
    logging.disable(logging.CRITICAL)  # decoders log what they refuse: a line per input here
    rng = random.Random(args.seed)
    every_seed = [s for t in TARGETS for s in t.seeds]
    rows, crashes = [], []
    print(f"{'decoder':<16} {'inputs':>8} {'accepted':>9} {'refused':>9} {'crashed':>8} {'inputs/s':>9}")
    for target in TARGETS:
        counts = {"accepted": 0, "refused": 0, "crashed": 0}
        start = time.perf_counter()
        for i in range(args.per_target):
            data = (mutate(rng.choice(target.seeds), rng, others=every_seed) if i % 10
                    else rng.randbytes(rng.randint(0, 256)))
            if target.resign is not None and i % 2:
                data = target.resign(data)
            try:
                target.run(data)
                counts["accepted"] += 1
            except target.allowed:
                counts["refused"] += 1
            except Exception as e:  # a crash: what the run is looking for
                counts["crashed"] += 1
                if len(crashes) < 20:
                    crashes.append({"decoder": target.name, "error": f"{type(e).__name__}: {e}"[:300],
                                    "input_hex": data[:4096].hex()})
        rate = args.per_target / (time.perf_counter() - start)
        rows.append({"decoder": target.name, "inputs": args.per_target, **counts, "inputs_per_s": round(rate)})
        print(f"{target.name:<16} {args.per_target:>8} {counts['accepted']:>9} {counts['refused']:>9} "
              f"{counts['crashed']:>8} {rate:>9.0f}")
    total = sum(r["inputs"] for r in rows)
    crashed = sum(r["crashed"] for r in rows)
    print(f"{total} inputs to {len(rows)} decoders: {crashed} crashed (untyped errors)")
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "crashes": crashes}, indent=1) + "\n")
    print(f"-> {args.out}")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())

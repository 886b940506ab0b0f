"""Sparse-codec variants on the convergence protocol, at the bytes of the codec's own top-k arm.

Two questions the codec's design answers by measurement here:

* Would positions the receivers can regenerate beat top-k at equal bytes? A round's k positions per
  chunk drawn from a seed that every peer shares for that round (`positions=shared`), or that each
  peer draws for itself (`positions=own`), cost no offsets on the wire: 2-bit values and the chunk's
  scales only, so about 7× the density of top-k for the same bytes. The codec has no such mode; this
  script swaps the reference codec's top-k choice for the random one (the run still carries the
  offsets, and the table reports the bytes without them).
* Would a longer round (larger H) at a proportionally higher density do better at equal bytes per
  token? Plain config overrides (`diloco.inner_steps`, `diloco.rounds`, `compress.density`).

Every arm continues from the convergence protocol's shared warm start (tiny GPT, K=4, 400 DDP steps
at lr 1.2e-2, 6,400 steps per worker after it) and is scored on its final val loss.

    python benchmarks/sparse_variants.py \\
        --arm topk=compress.density=0.01 \\
        --arm shared=positions=shared,compress.density=0.077,outer.lr=1.5 \\
        --arm h100=compress.density=0.02,diloco.inner_steps=100,diloco.rounds=64
        # -> benchmarks/results/sparse-variants.json

Each arm starts from SparseLoCo's outer step (`SPARSE` below); an arm's own overrides come after it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

from convergence import Arm, Job, run_job, warm_start

RESULTS = Path(__file__).resolve().parent / "results"
PROTOCOL = ("model.preset=tiny", "data.seq_len=64", "data.batch_size=8", "diloco.eval_batches=16")
SPARSE = ("compress.codec=sparse", "compress.error_feedback=true", "compress.error_feedback_decay=0.9",
          "outer.momentum=0", "outer.nesterov=false", "outer.lr=4")
POSITIONS = ("topk", "shared", "own")


def parse_arm(spec: str) -> tuple[str, str, tuple[str, ...]]:
    """"NAME=[positions=P,]SECTION.KEY=VALUE,..." -> (NAME, P, overrides)."""
    name, _, rest = spec.partition("=")
    if not name or not rest:
        raise SystemExit(f"--arm {spec!r}: give NAME=[positions=topk|shared|own,]SECTION.KEY=VALUE[,...]")
    positions, overrides = "topk", []
    for item in rest.split(","):
        key, _, value = item.partition("=")
        if key == "positions":
            if value not in POSITIONS:
                raise SystemExit(f"--arm {name}: positions={value!r} is not one of {POSITIONS}")
            positions = value
        elif item:
            overrides.append(item)
    return name, positions, tuple(overrides)


def use_random_positions(mode: str) -> None:
    """Swap the reference codec's top-k choice for k random positions per chunk (in this process).

    `shared`: the generator is seeded by the round, the same on every peer. `own`: by the chunk's
    contents, which differ between peers, so each peer picks its own positions. Either way the same
    input gives the same positions, so error feedback's round trip and the averager's encode agree.
    """
    import torch

    import swarmtrain.compress.sparse as sparse
    from swarmtrain.diloco.worker import DilocoWorker

    state = {"round": 0}
    delta = DilocoWorker.delta

    def delta_in_round(self: DilocoWorker) -> torch.Tensor:
        state["round"] = self.round
        return delta(self)

    def select(rows: torch.Tensor, k: int) -> torch.Tensor:
        n, width = rows.shape
        if mode == "shared":
            seeds = [(state["round"] * 1_000_003 + width) * 65_537 + i for i in range(n)]
        else:  # a wrapping weighted sum of the chunk's bits: equal contents, equal positions
            words = rows.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
            weights = 2 * torch.arange(width, dtype=torch.int64) + 1
            seeds = [int(s) for s in ((words * weights) & 0xFFFFFFFF).sum(dim=1)]
        picks = [torch.rand(width, generator=torch.Generator().manual_seed(s)).topk(k).indices for s in seeds]
        return torch.stack(picks).sort(dim=1).values

    DilocoWorker.delta = delta_in_round  # type: ignore[method-assign]
    sparse._select = select


def run_arm(item: tuple[str, str, Job]) -> dict[str, Any]:
    name, positions, job = item
    if positions != "topk":
        use_random_positions(positions)
    out = run_job(job)
    out.update(name=name, positions=positions)
    return out


def offset_bytes(config: dict[str, Any], numel: int) -> int:
    """Bytes of the offsets in one sparse message of `numel` values, with the run's codec settings."""
    from swarmtrain.compress.sparse import sparse_layout
    from swarmtrain.compress.sparse_codec import sparse_k

    c = config["compress"]
    lay = sparse_layout(numel, chunk=c["chunk_size"], k=sparse_k(c["density"], c["chunk_size"]), bits=c["bits"])
    return lay.body_bytes - lay.offsets_at


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", dest="arms", action="append", default=[], metavar="NAME=[positions=P,]OVERRIDES")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--processes", type=int, default=2, help="worker processes (1 torch thread each)")
    p.add_argument("--out", type=Path, default=RESULTS / "sparse-variants.json")
    args = p.parse_args(argv)
    arms = [parse_arm(a) for a in args.arms]
    if not arms:
        raise SystemExit("nothing to run: give --arm")
    os.environ["SWARMTRAIN_KERNELS"] = "torch"  # the swapped choice lives in the reference codec
    start = time.perf_counter()
    warm_job = Job("stdlib", args.seed, Arm("ddp lr=0.012", "ddp", 50, overrides=("inner.lr=0.012",)), 4, 400,
                   PROTOCOL)
    overrides = (*PROTOCOL, "outer.lr=1.0")
    items = []
    for name, positions, extra in arms:
        steps = next((int(x.split("=", 1)[1]) for x in extra if x.startswith("diloco.inner_steps=")), 50)
        if 6400 % steps:
            raise SystemExit(f"--arm {name}: H={steps} does not divide the protocol's 6,400 steps per worker")
        # run_job sets H and the rounds (6,400 // H) from the arm's inner steps
        arm = Arm(name, "diloco", steps, overrides=(*SPARSE, *(x for x in extra if not x.startswith("diloco.inner_steps="))))
        items.append((name, positions, Job("stdlib", args.seed, arm, 4, 6400, overrides)))
    with mp.get_context("fork").Pool(args.processes, maxtasksperchild=1) as pool:
        warm = pool.apply(warm_start, (warm_job,))
        results = pool.map(run_arm, [(n, pos, Job(j.corpus, j.seed, j.arm, j.workers, j.steps, j.overrides, warm))
                                     for n, pos, j in items], chunksize=1)
    rows = []
    print(f"{'arm':<20} {'positions':<9} {'H':>4} {'val loss':>9} {'MB sent':>8} {'MB without offsets':>19}")
    for (name, positions, _), r in zip(items, results, strict=True):
        messages = len(r["rounds"]) * (r["workers"] - 1)  # a gathered round: one message to each other member
        without = r["bytes_sent"] - (messages * offset_bytes(r["config"], r["num_params"]) if positions != "topk" else 0)
        rows.append({"arm": name, "positions": positions, "inner_steps": r["inner_steps"],
                     "final_val_loss": r["final_val_loss"], "bytes_sent": r["bytes_sent"],
                     "bytes_without_offsets": without})
        print(f"{name:<20} {positions:<9} {r['inner_steps']:>4} {r['final_val_loss']:>9.4f} {r['bytes_sent'] / 1e6:>8.3f} "
              f"{without / 1e6:>19.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"argv": sys.argv, "seed": args.seed, "wall_s": time.perf_counter() - start}
    args.out.write_text(json.dumps({"meta": meta, "table": rows, "runs": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

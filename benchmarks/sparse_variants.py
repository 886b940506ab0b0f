"""Sparse-codec variants on the convergence protocol, at the bytes of the codec's own top-k arm.

Four questions the codec's design answers by measurement here:

* Would positions the receivers can regenerate beat top-k at equal bytes? A round's k positions per
  chunk drawn from a seed that every peer shares for that round (`positions=shared`), or that each
  peer draws for itself (`positions=own`), cost no offsets on the wire: 2-bit values and the chunk's
  scales only, so about 7× the density of top-k for the same bytes. The codec has no such mode; this
  script swaps the reference codec's top-k choice for the random one (the run still carries the
  offsets, and the table reports the bytes without them).
* Would a longer round (larger H) at a proportionally higher density do better at equal bytes per
  token? Plain config overrides (`diloco.inner_steps`, `diloco.rounds`, `compress.density`).
* Does top-k lose because a chunk that straddles two parameters spends its k on the one whose Δ is
  larger? `positions=tensors` splits each chunk's k between the parameters it holds in proportion to
  their lengths (largest remainders) and takes the top of each part: the same k, offsets and bytes.
* Does the gathered mean lose because a coordinate that one member sent is divided by all K?
  `combine=count` divides each coordinate of the sum by the number of members that sent it (a
  coordinate no member sent stays 0), in place of K.

Every arm continues from the convergence protocol's shared warm start (tiny GPT, K=4, 400 DDP steps
at lr 1.2e-2, 6,400 steps per worker after it) and is scored on its final val loss.

    python benchmarks/sparse_variants.py \\
        --arm topk=compress.density=0.01 \\
        --arm shared=positions=shared,compress.density=0.077,outer.lr=1.5 \\
        --arm h100=compress.density=0.02,diloco.inner_steps=100,diloco.rounds=64 \\
        --arm tensors=positions=tensors,compress.density=0.01 \\
        --arm count=combine=count,compress.density=0.01,outer.lr=2
        # -> benchmarks/results/sparse-variants.json

Each arm starts from SparseLoCo's outer step (`SPARSE` below); an arm's own overrides come after it.
"""

from __future__ import annotations

import argparse
import itertools
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
POSITIONS = ("topk", "shared", "own", "tensors")
COMBINES = ("mean", "count")


def parse_arm(spec: str) -> tuple[str, str, str, tuple[str, ...]]:
    """"NAME=[positions=P,][combine=C,]SECTION.KEY=VALUE,..." -> (NAME, P, C, overrides)."""
    name, _, rest = spec.partition("=")
    if not name or not rest:
        raise SystemExit(f"--arm {spec!r}: give NAME=[positions={'|'.join(POSITIONS)},]"
                         f"[combine={'|'.join(COMBINES)},]SECTION.KEY=VALUE[,...]")
    positions, combine, overrides = "topk", "mean", []
    for item in rest.split(","):
        key, _, value = item.partition("=")
        if key == "positions":
            if value not in POSITIONS:
                raise SystemExit(f"--arm {name}: positions={value!r} is not one of {POSITIONS}")
            positions = value
        elif key == "combine":
            if value not in COMBINES:
                raise SystemExit(f"--arm {name}: combine={value!r} is not one of {COMBINES}")
            combine = value
        elif item:
            overrides.append(item)
    return name, positions, combine, tuple(overrides)


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


def parameter_starts(overrides: tuple[str, ...]) -> list[int]:
    """Where each parameter of the run's model begins in the flat θ, and θ's length last."""
    from swarmtrain.config import load_config
    from swarmtrain.models import build_model

    starts = [0]
    for p in build_model(load_config(overrides=list(overrides)).model).parameters():
        starts.append(starts[-1] + p.numel())
    return starts


def use_tensor_positions(starts: list[int]) -> None:
    """Swap the reference codec's top-k for one that splits each chunk's k between the parameters the
    chunk holds (`starts`: each parameter's first flat index, then θ's length), in proportion to their
    lengths with the remainders to the largest fractions, and takes the top of each part by |x|.

    Only θ as a whole is encoded this way (one fragment): a message of another length raises."""
    import torch

    import swarmtrain.compress.sparse as sparse

    top = sparse._select
    encode = sparse.sparse_encode
    cursor = {"at": 0}

    def encode_whole(x: torch.Tensor, *, chunk: int, k: int, bits: int) -> torch.Tensor:
        if x.numel() != starts[-1]:
            raise ValueError(f"positions=tensors encodes all of θ ({starts[-1]} values), got {x.numel()}")
        cursor["at"] = 0
        return encode(x, chunk=chunk, k=k, bits=bits)

    def select(rows: torch.Tensor, k: int) -> torch.Tensor:
        n, width = rows.shape
        picks = []
        for r in range(n):
            first = cursor["at"] + r * width
            cuts = sorted({first, first + width, *(s for s in starts if first < s < first + width)})
            if len(cuts) == 2:
                picks.append(top(rows[r:r + 1], k)[0])
                continue
            spans = list(itertools.pairwise(cuts))
            share = [k * (b - a) / width for a, b in spans]
            quota = [int(q) for q in share]
            by_fraction = sorted(range(len(spans)), key=lambda i: quota[i] - share[i])
            for i in by_fraction[: k - sum(quota)]:
                quota[i] += 1
            parts = [top(rows[r:r + 1, a - first:b - first], q)[0] + (a - first)
                     for (a, b), q in zip(spans, quota, strict=True) if q]
            picks.append(torch.cat(parts).sort().values)
        cursor["at"] += n * width
        return torch.stack(picks)

    sparse.sparse_encode = encode_whole
    sparse._select = select


def use_count_mean() -> None:
    """Swap the in-process group's gathered mean for sum / (members that sent the coordinate)."""
    import torch

    import swarmtrain.averaging.inprocess as inprocess

    def mean_by_count(codec: Any, parts: Any, *, out: torch.Tensor) -> torch.Tensor:
        if not parts:
            raise ValueError("mean_by_count: no contributions")
        out.zero_()
        count, one = torch.zeros_like(out), torch.empty_like(out)
        for part in parts:
            one.zero_()
            codec.decode_accumulate(part, one)
            count += one != 0
            out += one
        return out.div_(count.clamp_(min=1))

    inprocess.mean_of_gathered = mean_by_count


def run_arm(item: tuple[str, str, str, Job]) -> dict[str, Any]:
    name, positions, combine, job = item
    if positions == "tensors":
        use_tensor_positions(parameter_starts(job.overrides))
    elif positions != "topk":
        use_random_positions(positions)
    if combine == "count":
        use_count_mean()
    out = run_job(job)
    out.update(name=name, positions=positions, combine=combine)
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
    p.add_argument("--arm", dest="arms", action="append", default=[],
                   metavar="NAME=[positions=P,][combine=C,]OVERRIDES")
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
    for name, positions, combine, extra in arms:
        steps = next((int(x.split("=", 1)[1]) for x in extra if x.startswith("diloco.inner_steps=")), 50)
        if 6400 % steps:
            raise SystemExit(f"--arm {name}: H={steps} does not divide the protocol's 6,400 steps per worker")
        if combine == "count" and "averaging.combine=reencode" in extra:
            raise SystemExit(f"--arm {name}: combine=count swaps the gathered mean; "
                             "averaging.combine=reencode has none")
        # run_job sets H and the rounds (6,400 // H) from the arm's inner steps
        arm = Arm(name, "diloco", steps,
                  overrides=(*SPARSE, *(x for x in extra if not x.startswith("diloco.inner_steps="))))
        items.append((name, positions, combine, Job("stdlib", args.seed, arm, 4, 6400, overrides)))
    with mp.get_context("fork").Pool(args.processes, maxtasksperchild=1) as pool:
        warm = pool.apply(warm_start, (warm_job,))
        results = pool.map(run_arm, [(n, pos, c, Job(j.corpus, j.seed, j.arm, j.workers, j.steps, j.overrides, warm))
                                     for n, pos, c, j in items], chunksize=1)
    rows = []
    print(f"{'arm':<20} {'positions':<9} {'combine':<7} {'H':>4} {'val loss':>9} {'MB sent':>8} "
          f"{'MB without offsets':>19}")
    for (name, positions, combine, _), r in zip(items, results, strict=True):
        messages = len(r["rounds"]) * (r["workers"] - 1)  # a gathered round: one message to each other member
        random = positions in ("shared", "own")  # positions a receiver could draw itself need no offsets
        without = r["bytes_sent"] - (messages * offset_bytes(r["config"], r["num_params"]) if random else 0)
        rows.append({"arm": name, "positions": positions, "combine": combine, "inner_steps": r["inner_steps"],
                     "final_val_loss": r["final_val_loss"], "bytes_sent": r["bytes_sent"],
                     "bytes_without_offsets": without})
        print(f"{name:<20} {positions:<9} {combine:<7} {r['inner_steps']:>4} {r['final_val_loss']:>9.4f} "
              f"{r['bytes_sent'] / 1e6:>8.3f} {without / 1e6:>19.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"argv": sys.argv, "seed": args.seed, "wall_s": time.perf_counter() - start}
    args.out.write_text(json.dumps({"meta": meta, "table": rows, "runs": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How to code the offsets of a sparse pseudo-gradient: bytes per kept value of four codings, measured.

On a real pseudo-gradient (θ before − θ after H AdamW steps of the `tiny` preset on the standard library's
source) and on N(0, 1) noise, per chunk of 4096 values at 1–3% density, the offsets of the top-k values cost:
  fixed    w = 12 bits each, bit-packed (what the sparse codec sends)
  bitmap   one bit per value of the chunk
  rice     the gaps between sorted offsets, Golomb-Rice coded with each chunk's best parameter (+4 bits for it)
  entropy  log2 C(chunk, k) bits per chunk: the bound no coding of a set of offsets beats on average
and, beside them, the share of the chunks' energy (sum of squares) that the top-k values hold: what
top-k selection concentrates, against k/chunk for positions drawn at random.

    python benchmarks/sparse_index.py        # -> benchmarks/results/sparse-index.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch

from swarmtrain.compress.sparse_codec import sparse_k
from swarmtrain.config import load_config
from swarmtrain.data import ShardedBatches, load_corpus
from swarmtrain.diloco import DilocoWorker
from swarmtrain.models import build_model

RESULTS = Path(__file__).resolve().parent / "results"


def pseudo_gradient(steps: int, seed: int) -> torch.Tensor:
    cfg = load_config(overrides=["model.preset=tiny", "data.seq_len=64", "data.batch_size=8", f"train.seed={seed}",
                                 f"diloco.inner_steps={steps}", "compress.codec=fp32"])
    tokens = load_corpus(cfg.data).train
    batches = ShardedBatches(tokens, worker_index=0, num_workers=1, batch_size=cfg.data.batch_size,
                             seq_len=cfg.data.seq_len, seed=seed)
    worker = DilocoWorker(cfg, model=build_model(cfg.model, seed=seed), batches=batches, device=torch.device("cpu"))
    worker.train_inner(steps)
    return worker.delta()


def rice_bits(gaps: list[int]) -> int:
    best = min(sum((g >> r) + 1 + r for g in gaps) for r in range(13))
    return best + 4


def energy_kept(x: torch.Tensor, chunk: int, k: int) -> float:
    """The share of the full chunks' sum of squares that each chunk's k largest magnitudes hold."""
    rows = x[: x.numel() // chunk * chunk].view(-1, chunk).double()
    return float(rows.abs().topk(k, dim=1).values.pow(2).sum() / rows.pow(2).sum())


def offsets_of(x: torch.Tensor, chunk: int, k: int) -> list[list[int]]:
    full = x.numel() // chunk
    rows = x[: full * chunk].view(full, chunk).abs()
    return [sorted(r) for r in rows.topk(k, dim=1).indices.tolist()]


def measure(x: torch.Tensor, *, chunk: int, density: float) -> dict[str, float]:
    k = sparse_k(density, chunk)
    chunks = offsets_of(x, chunk, k)
    w = (chunk - 1).bit_length()
    fixed = sum(math.ceil(k * w / 8) for _ in chunks)
    bitmap = len(chunks) * chunk / 8
    rice = sum(math.ceil(rice_bits([o[0], *(b - a - 1 for a, b in itertools.pairwise(o))]) / 8) for o in chunks)
    entropy = len(chunks) * (math.lgamma(chunk + 1) - math.lgamma(k + 1) - math.lgamma(chunk - k + 1)) / math.log(2) / 8
    kept = len(chunks) * k
    return {"density": density, "k": k, "chunks": len(chunks), "fixed": fixed / kept, "bitmap": bitmap / kept,
            "rice": rice / kept, "entropy": entropy / kept, "energy": energy_kept(x, chunk, k)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="inner steps of the real pseudo-gradient (H)")
    p.add_argument("--out", type=Path, default=RESULTS / "sparse-index.json")
    args = p.parse_args()
    torch.manual_seed(0)
    sources = {"pseudo-gradient (tiny, H=50)": pseudo_gradient(args.steps, seed=0), "N(0, 1)": torch.randn(1 << 20)}
    rows = []
    print(f"{'source':<30} {'density':>7} {'fixed':>7} {'bitmap':>7} {'rice':>7} {'entropy':>7}  "
          f"(bytes per kept value) {'energy':>7}")
    for name, x in sources.items():
        for density in (0.01, 0.02, 0.03):
            row = {"source": name, "numel": x.numel(), **measure(x, chunk=4096, density=density)}
            rows.append(row)
            print(f"{name:<30} {density:7.2f} {row['fixed']:7.3f} {row['bitmap']:7.3f} {row['rice']:7.3f} "
                  f"{row['entropy']:7.3f} {row['energy']:29.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"argv": sys.argv, "chunk": 4096, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

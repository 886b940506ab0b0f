"""One rank of the data-parallel baseline for benchmarks/wan.py: torch.distributed (gloo) over the testbed.

Every step: forward/backward on this rank's shard of the global batch, one all-reduce of the flat
fp32 gradient (as DDP with a single bucket, without overlapping it with backward, so compute and
communication time are measured apart), then the same clipped AdamW step and lr schedule as a
DiLoCo peer's inner steps. Rank k reads worker slot k of `ShardedBatches`, so the K ranks'
batches at step t are one global batch of K x B windows.

Run inside a testbed host (wan.py does this):
  python benchmarks/ddp_worker.py --rank R --world-size K --master 10.77.0.10:29500 \
      --steps S --out final.pt --set model.preset=small ...
Prints one JSON line at the end: compute_s, comm_s, wall_s, steps, tokens, grad bytes all-reduced.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch
import torch.distributed as dist

from swarmtrain.config import RunConfig, load_config
from swarmtrain.data import ShardedBatches, load_corpus
from swarmtrain.diloco.inner import build_inner_optimizer, lr_factor, set_lr
from swarmtrain.models import build_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master", required=True, metavar="HOST:PORT", help="rank 0's TCP store address")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps (the lr schedule spans them)")
    p.add_argument("--start-step", type=int, default=0,
                   help="data position to start from (after a warm start of that many steps; model.init_from)")
    p.add_argument("--out", required=True, help="where rank 0 saves the final weights (torch.save state_dict)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--timeout-s", type=float, default=600.0, help="deadline of every collective")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(overrides=args.overrides)
    host, _, port = args.master.rpartition(":")
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=args.rank,
                            world_size=args.world_size, timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        report = train(cfg, rank=args.rank, world_size=args.world_size, steps=args.steps, out=args.out,
                       start_step=args.start_step)
    finally:
        dist.destroy_process_group()
    print(json.dumps(report), flush=True)
    return 0


def train(cfg: RunConfig, *, rank: int, world_size: int, steps: int, out: str,
          start_step: int = 0) -> dict[str, float | int]:
    corpus = load_corpus(cfg.data)
    batches = ShardedBatches(corpus.train, worker_index=rank, num_workers=world_size,
                             batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len, seed=cfg.train.seed,
                             position=start_step)
    model = build_model(cfg.model, seed=cfg.train.seed)  # every rank starts from the same weights
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_inner_optimizer(model, cfg.inner)
    dist.barrier()  # start the clock when every rank is ready
    compute_s = comm_s = 0.0
    tokens = 0
    start = time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = next(batches)
        _, loss = model(x, y)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        t1 = time.perf_counter()
        dist.all_reduce(flat)
        t2 = time.perf_counter()
        flat /= world_size
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p))  # type: ignore[union-attr]
            offset += n
        if cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.inner.grad_clip)
        set_lr(optimizer, cfg.inner.lr * lr_factor(step, cfg=cfg.inner, total_steps=steps))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        compute_s += (t1 - t0) + (t3 - t2)
        comm_s += t2 - t1
        tokens += y.numel()
        if rank == 0 and (step + 1) % 50 == 0:
            print(json.dumps({"event": "progress", "step": step + 1, "loss": float(loss)}), file=sys.stderr, flush=True)
    wall_s = time.perf_counter() - start
    if rank == 0:
        torch.save(model.state_dict(), out)
    grad_bytes = 4 * sum(p.numel() for p in params)
    return {"event": "ddp", "rank": rank, "steps": steps, "tokens": tokens, "compute_s": compute_s,
            "comm_s": comm_s, "wall_s": wall_s, "allreduced_bytes": grad_bytes * steps}


if __name__ == "__main__":
    sys.exit(main())

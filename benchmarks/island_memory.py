"""Per-rank memory and step time of a 2-rank island, DDP against FSDP (`train.parallel`), side by side in one run.

    python benchmarks/island_memory.py                     # the `medium` preset, 2 gloo ranks on CPU
    python benchmarks/island_memory.py --preset base --steps 3

Each mode starts 2 ranks (real processes: rank 0 an IslandWorker, rank 1 an IslandFollower) that take
`--steps` inner steps. Each rank then counts the bytes of the tensors it holds for the inner steps: the
model's weights (its shards under FSDP) and the inner optimizer's state (AdamW's two moments), plus, on
rank 0, what it keeps whole for the swarm (θ_local's whole copy under FSDP, θ_global, the outer momentum),
and its peak RSS. Target: FSDP's per-rank weights + optimizer state about half of DDP's. Rank 0 also times
`--steps` inner steps in one `train_inner` call after one warm-up step (what a round's steps cost, θ_local
whole on rank 0 at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "island-memory.json"


def _bytes(tensors: Any) -> int:
    seen, total = set(), 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.data_ptr() in seen or local.numel() == 0:
            continue
        seen.add(local.data_ptr())
        total += local.numel() * local.element_size()
    return total


def _optimizer_bytes(optimizer: Any) -> int:
    import torch

    return _bytes(v for st in optimizer.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0)


def _child(rank: int, port: int, preset: str, parallel: str, steps: int) -> None:
    import torch

    from swarmtrain.config import load_config
    from swarmtrain.data import ShardedBatches
    from swarmtrain.diloco.island import Island
    from swarmtrain.diloco.island_steps import IslandFollower, IslandWorker, RankSlice
    from swarmtrain.models import build_model

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    cfg = load_config(overrides=[f"model.preset={preset}", "data.seq_len=64", "data.batch_size=2",
                                 "diloco.inner_steps=4", "train.device=cpu", f"train.parallel={parallel}"])
    island = Island.start(rank=rank, world_size=2, backend="gloo", timeout_s=600)
    tokens = torch.randint(0, cfg.model.vocab_size, (200_000,), generator=torch.Generator().manual_seed(0))
    batches = RankSlice(ShardedBatches(tokens, worker_index=0, num_workers=1, batch_size=4, seq_len=64, seed=0),
                        rank=rank, world_size=2)
    model = build_model(cfg.model, seed=0)
    row: dict[str, Any] = {"rank": rank, "parallel": parallel}
    if rank == 0:
        worker = IslandWorker(cfg, island=island, model=model, batches=batches)
        worker.train_inner(1)  # warm-up: the first step allocates the optimizer's state
        started = time.perf_counter()
        worker.train_inner(steps)
        row["step_s"] = (time.perf_counter() - started) / steps
        row["weights_bytes"] = _bytes(worker.sharded if worker.fsdp else worker.params)
        row["optimizer_bytes"] = _optimizer_bytes(worker.inner)
        row["whole_copies_bytes"] = (_bytes(worker.params) if worker.fsdp else 0) + _bytes(
            [worker.theta_global, *worker.outer.state_tensors().values()])
        worker.stop_island("measured")
    else:
        follower = IslandFollower(cfg, island=island, model=model, batches=batches)
        follower.run()
        row["weights_bytes"] = _bytes(follower.params)
        row["optimizer_bytes"] = _optimizer_bytes(follower.inner)
        row["whole_copies_bytes"] = 0
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    row["numel"] = sum(p.numel() for p in build_model(cfg.model, seed=0).parameters())
    island.close()
    print("ROW " + json.dumps(row), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(preset: str, parallel: str, steps: int) -> list[dict[str, Any]]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(rank), str(port), preset, parallel,
                               str(steps)], stdout=subprocess.PIPE, text=True, env=env) for rank in range(2)]
    rows: list[dict[str, Any]] = []
    outputs: list[str] = ["", ""]

    def read(i: int) -> None:
        assert procs[i].stdout is not None
        outputs[i] = procs[i].stdout.read()

    readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in readers:
        t.start()
    for p in procs:
        p.wait(timeout=1800)
    for t in readers:
        t.join()
    for i, p in enumerate(procs):
        if p.returncode != 0:
            raise SystemExit(f"{parallel} rank {i} exited with {p.returncode}")
        rows += [json.loads(line[4:]) for line in outputs[i].splitlines() if line.startswith("ROW ")]
    return sorted(rows, key=lambda r: r["rank"])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        rank, port, preset, parallel, steps = sys.argv[2:7]
        _child(int(rank), int(port), preset, parallel, int(steps))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    started = time.perf_counter()
    runs = {mode: _run(args.preset, mode, args.steps) for mode in ("ddp", "fsdp")}
    mb = 1 / 2**20
    print(f"{args.preset}: {runs['ddp'][0]['numel']:,} parameters, 2 gloo ranks, {args.steps} inner steps")
    print("rank | ddp weights+optimizer MB | fsdp weights+optimizer MB | fsdp/ddp | rank 0's whole copies ddp / fsdp "
          "MB | peak RSS ddp / fsdp MB")
    summary = []
    for d, f in zip(runs["ddp"], runs["fsdp"], strict=True):
        held_d, held_f = d["weights_bytes"] + d["optimizer_bytes"], f["weights_bytes"] + f["optimizer_bytes"]
        ratio = held_f / held_d
        summary.append({"rank": d["rank"], "ddp_held_bytes": held_d, "fsdp_held_bytes": held_f, "ratio": ratio})
        print(f"{d['rank']} | {held_d * mb:.1f} | {held_f * mb:.1f} | {ratio:.3f} | "
              f"{d['whole_copies_bytes'] * mb:.1f} / {f['whole_copies_bytes'] * mb:.1f} | "
              f"{d['peak_rss_bytes'] * mb:.0f} / {f['peak_rss_bytes'] * mb:.0f}")
    step_s = {mode: runs[mode][0]["step_s"] for mode in runs}
    print(f"rank 0's inner step: ddp {step_s['ddp']:.3f} s, fsdp {step_s['fsdp']:.3f} s "
          f"(fsdp/ddp {step_s['fsdp'] / step_s['ddp']:.2f})")
    result = {"preset": args.preset, "step_s": step_s, "steps": args.steps, "ranks": 2, "backend": "gloo",
              "machine": "2-core x86 CPU", "runs": runs, "summary": summary,
              "wall_s": round(time.perf_counter() - started, 1),
              "command": f"python benchmarks/island_memory.py --preset {args.preset} --steps {args.steps}"}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

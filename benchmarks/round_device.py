"""A round's arithmetic on the training device against on the host (`train.round_device = train | cpu`).

One worker per arm, the same model, trained on `--device`; every round θ_local is θ_global plus a seeded move
(no inner step is timed) and the round runs through what a networked peer runs: Δ read a slice at a time and
encoded per shard (`encode_from`), a reducer's mean of `--members` contributions per shard (decode-accumulate
and encode, on the arm's round device), the peer's decode of the means piece by piece with the outer Nesterov
step (`apply`), and the state digest. Both arms run in the same process, alternating round by round; the
ratios printed are train / cpu (below 1: the round on the training device is faster). On a CPU machine both
arms run on the CPU (the ratio only shows the two paths cost the same there); on a GPU it measures the
GPU-resident round.

  python benchmarks/round_device.py --device cuda --set model.preset=medium --json round-device-GPU.json
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from swarmtrain.averaging.aggregate import Aggregation, aggregate_encoded
from swarmtrain.averaging.material import Material, layout_of, sharded_mean
from swarmtrain.averaging.reducer import shard_bounds
from swarmtrain.compress import codec_from_config
from swarmtrain.config import load_config
from swarmtrain.diloco.averager import AverageResult, reader
from swarmtrain.diloco.flat import assign_flat
from swarmtrain.diloco.worker import DilocoWorker, resolve_round_device
from swarmtrain.models import build_model

ARM = ["model.preset=small", "compress.codec=int8", "compress.error_feedback=true"]
PHASES = ("delta+encode", "reduce", "decode+outer step", "digest")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


class Arm:
    def __init__(self, overrides: list[str], device: torch.device, round_device: str, shards: int) -> None:
        self.cfg = load_config(overrides=[*overrides, f"train.round_device={round_device}"])
        self.round_device = resolve_round_device(round_device, device)
        self.codec = codec_from_config(self.cfg.compress, seed=0, device=self.round_device)
        self.worker = DilocoWorker(self.cfg, model=build_model(self.cfg.model, seed=0), batches=iter([]),
                                   device=device, codec=self.codec)
        self.bounds = shard_bounds(self.worker.numel, (1.0,) * shards, align=self.codec.alignment)
        self.device = device
        self.times: dict[str, list[float]] = {p: [] for p in PHASES}

    def round(self, move: torch.Tensor, members: int, keep: bool) -> None:
        w, codec = self.worker, self.codec
        assign_flat(w.theta_global.detach().to(self.device) + move, w.params)
        w._local_version += 1

        def encode() -> list[bytes]:
            read = reader(w.delta())  # with error feedback: Δ + residual, and what the wire loses of it
            return [codec.encode_from(functools.partial(_at, read, lo), hi - lo) for lo, hi in self.bounds]

        def reduce(pushes: list[bytes]) -> list[bytes]:
            out = []
            for (lo, hi), push in zip(self.bounds, pushes, strict=True):
                acc = torch.empty(hi - lo, dtype=torch.float32, device=self.round_device)
                out.append(codec.encode(aggregate_encoded(codec, [push] * members, Aggregation(), out=acc,
                                                          checked=True)))
            return out

        def apply(blobs: list[bytes]) -> None:
            layout = layout_of(blobs, self.bounds, numel=w.numel, codec=codec.name, gather=False)
            mean = sharded_mean(Material(layout, list(blobs)), codec)  # as a peer holds the round's material
            w.apply(AverageResult(round=w.round, committed=True, mean=mean, members=("a",) * members))

        t_encode, pushes = _timed(self.device, encode)
        t_reduce, blobs = _timed(self.device, lambda: reduce(pushes))
        t_apply, _ = _timed(self.device, lambda: apply(blobs))
        t_digest, _ = _timed(self.device, w.digest)
        if keep:
            for phase, t in zip(PHASES, (t_encode, t_reduce, t_apply, t_digest), strict=True):
                self.times[phase].append(t)


def _at(read: Callable[[int, int], torch.Tensor], lo: int, a: int, b: int) -> torch.Tensor:
    return read(lo + a, lo + b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=8, help="rounds timed per arm (after 2 of warm-up)")
    ap.add_argument("--members", type=int, default=4, help="contributions each reducer averages")
    ap.add_argument("--shards", type=int, default=4, help="shards the Δ is cut into (reducers)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    overrides = [*ARM, *args.set]
    arms = {name: Arm(overrides, device, name, args.shards) for name in ("train", "cpu")}
    numel = arms["train"].worker.numel
    gen = torch.Generator().manual_seed(0)
    for r in range(args.rounds + 2):
        move = (torch.randn(numel, generator=gen) * 1e-3).to(device)
        for arm in arms.values():
            arm.round(move, args.members, keep=r >= 2)
    hashes = {name: arm.worker.digest() for name, arm in arms.items()}
    med = {name: {p: statistics.median(t) for p, t in arm.times.items()} for name, arm in arms.items()}
    total = {name: sum(m.values()) for name, m in med.items()}
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"{numel:,} parameters, {arms['train'].cfg.compress.codec}, {args.members} members, {args.shards} shards, "
          f"training on {device} ({gpu}); medians of {args.rounds} rounds, seconds")
    print(f"  {'phase':20s} {'train':>10s} {'cpu':>10s} {'train/cpu':>10s}")
    for p in PHASES:
        print(f"  {p:20s} {med['train'][p]:10.4f} {med['cpu'][p]:10.4f} {med['train'][p] / med['cpu'][p]:10.3f}")
    print(f"  {'round':20s} {total['train']:10.4f} {total['cpu']:10.4f} {total['train'] / total['cpu']:10.3f}")
    print(f"  same committed state in both arms: {hashes['train'] == hashes['cpu']}")
    if args.json:
        args.json.write_text(json.dumps({
            "device": str(device), "device_name": gpu, "torch": torch.__version__, "numel": numel,
            "overrides": overrides, "members": args.members, "shards": args.shards, "rounds": args.rounds,
            "median_s": med, "round_s": total, "ratio_train_over_cpu": total["train"] / total["cpu"],
            "same_state": hashes["train"] == hashes["cpu"]}, indent=2) + "\n")


if __name__ == "__main__":
    main()

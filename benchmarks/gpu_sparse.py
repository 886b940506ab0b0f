"""Sparse-kernel benchmark on a GPU: encode and decode-accumulate GB/s of the fused top-k kernels.

On one N(0, 1) fp32 tensor per size: the fused sparse encode / decode-accumulate at each density, the
fused int8 kernels (block 64) and a device-to-device `dst.copy_(src)` as references. Times are CUDA
events around one call, best of --repeats after --warmup calls; arms are interleaved round by round so
clock drift hits them alike. GB/s = input fp32 bytes / s.

    python benchmarks/gpu_sparse.py                       # 16M and 256M floats, density 1% and 2%, bits 2
    python benchmarks/gpu_sparse.py --sizes 16777216 --densities 0.01 --out /tmp/sparse.json
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from swarmtrain.compress import sparse
from swarmtrain.compress.kernels import fused_backend
from swarmtrain.compress.kernels.cuda import CudaKernels

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Arm:
    """One thing measured: a name, bytes sent per element, and its best encode and decode-accumulate times."""

    name: str
    bytes_per_element: float
    encode: Callable[[], object]
    decode_acc: Callable[[], object]
    encode_s: float = float("inf")
    decode_acc_s: float = float("inf")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1 << 24, 1 << 28], help="fp32 elements per tensor")
    p.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.02])
    p.add_argument("--bits", type=int, default=2, choices=sparse.SPARSE_BITS)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10, help="timed calls per arm (best is kept)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default results/gpu-sparse-<gpu>.json)")
    return p.parse_args(argv)


def gpu_label() -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name()).strip("-")


def time_call(fn: Callable[[], object]) -> float:
    """Seconds of one call, by CUDA events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def build_arms(kernels: CudaKernels, x: torch.Tensor, args: argparse.Namespace) -> list[Arm]:
    out = torch.zeros_like(x)
    dst = torch.empty_like(x)
    arms = [Arm("copy_ d2d (reference)", 4.0, lambda: dst.copy_(x), lambda: dst.copy_(x))]
    kw = {"block_size": 64, "scale_fp16": False, "stochastic": False, "generator": None}
    q, s = kernels.int8_quantize(x, **kw)
    arms.append(Arm("int8 block64", (q.numel() + 4 * s.numel()) / x.numel(), lambda: kernels.int8_quantize(x, **kw),
                    lambda: kernels.int8_dequantize_accumulate(q, s, block_size=64, out=out)))
    for density in args.densities:
        k = max(1, min(args.chunk, round(density * args.chunk)))
        skw = {"chunk": args.chunk, "k": k, "bits": args.bits}
        body = kernels.sparse_encode(x, **skw)

        def encode(skw: dict[str, int] = skw) -> object:
            return kernels.sparse_encode(x, **skw)

        def decode_acc(body: torch.Tensor = body, skw: dict[str, int] = skw) -> None:
            kernels.sparse_decode_accumulate(body, numel=x.numel(), out=out, **skw)

        arms.append(Arm(f"sparse {density:g} k={k}/{args.chunk} {args.bits}b", body.numel() / x.numel(), encode,
                        decode_acc))
    return arms


def measure(arms: list[Arm], *, warmup: int, repeats: int) -> None:
    for arm in arms:
        for _ in range(warmup):
            arm.encode(), arm.decode_acc()
    torch.cuda.synchronize()
    for _ in range(repeats):
        for arm in arms:
            arm.encode_s = min(arm.encode_s, time_call(arm.encode))
            arm.decode_acc_s = min(arm.decode_acc_s, time_call(arm.decode_acc))


def report(arms: list[Arm], *, numel: int) -> list[dict[str, object]]:
    gb = 4 * numel / 1e9
    copy_gbs = gb / arms[0].encode_s
    print(f"\n{numel} fp32 elements ({gb:.2f} GB)")
    print(f"{'arm':32} {'B/elem':>7} {'enc GB/s':>9} {'%copy':>6} {'dec+acc GB/s':>12} {'%copy':>6}")
    rows: list[dict[str, object]] = []
    for a in arms:
        enc, dec = gb / a.encode_s, gb / a.decode_acc_s
        rows.append({"arm": a.name, "numel": numel, "bytes_per_element": a.bytes_per_element, "encode_s": a.encode_s,
                     "decode_acc_s": a.decode_acc_s, "encode_gbs": enc, "decode_acc_gbs": dec,
                     "encode_pct_copy": 100 * enc / copy_gbs, "decode_acc_pct_copy": 100 * dec / copy_gbs})
        print(f"{a.name:32} {a.bytes_per_element:7.4f} {enc:9.1f} {100 * enc / copy_gbs:6.0f} {dec:12.1f} "
              f"{100 * dec / copy_gbs:6.0f}")
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device: torch sees none")
    kernels = fused_backend("cuda")
    assert isinstance(kernels, CudaKernels)
    rows: list[dict[str, object]] = []
    for numel in args.sizes:
        x = torch.randn(numel, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
        arms = build_arms(kernels, x, args)
        measure(arms, warmup=args.warmup, repeats=args.repeats)
        rows += report(arms, numel=numel)
        del x, arms
        torch.cuda.empty_cache()
    label = gpu_label()
    print(f"\n{label}; best of {args.repeats} after {args.warmup} warm-up calls; GB/s = input fp32 bytes / s; "
          "%copy vs a device-to-device copy_ of the same tensor (copy GB/s counts its input bytes only)")
    path = args.out or RESULTS / f"gpu-sparse-{label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path.write_text(json.dumps({"gpu": label, "args": meta, "torch": torch.__version__, "arms": rows}, indent=2)
                    + "\n", encoding="utf-8")
    print("wrote", path)


if __name__ == "__main__":
    main()

"""Codec benchmark: size, error and encode / decode-accumulate GB/s of every codec, side by side with copy bandwidth.

One run measures, on the same N(0, 1) fp32 tensor: every swarmtrain codec (fp32, fp16, bf16, int8,
int4; with and without zstd) through the full codec (header, checksum, bytes), the int8/int4 and the
chunked top-k sparse kernels alone (fused and torch reference; sparse at 1% and 2% density, 2-bit
values), hivemind's Uniform8BitQuantization and bitsandbytes' blockwise
8-bit (if installed), and `dst.copy_(src)` of the same size. Arms are interleaved round by round and
each keeps its best time, so a noisy neighbour slows all arms alike. GB/s = input fp32 bytes / s.

    python benchmarks/codecs.py                      # CPU, 1 thread
    python benchmarks/codecs.py --device cuda        # GPU: device-to-device copy as the reference
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
import torch

from swarmtrain.compress import get_codec, quant, sparse
from swarmtrain.compress.kernels import backend_name, fused_backend

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Arm:
    """One thing measured: bytes/element and errors once, then best-of-rounds encode/decode-accumulate time."""

    name: str
    bytes_per_element: float
    rel_l2: float
    max_err: float
    encode: Callable[[], object] = field(repr=False)
    decode_acc: Callable[[], object] = field(repr=False)
    encode_s: float = float("inf")
    decode_acc_s: float = float("inf")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 24, help="elements of the fp32 tensor (default 16M = 64 MB)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--zstd-level", type=int, default=3, help="level of the +zstd arms")
    p.add_argument("--sparse-chunk", type=int, default=4096, help="chunk of the sparse kernel arms")
    p.add_argument("--sparse-bits", type=int, default=2, choices=sparse.SPARSE_BITS,
                   help="value bits of the sparse arms")
    p.add_argument("--threads", type=int, default=1, help="torch / kernel CPU threads")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per arm (best is kept)")
    p.add_argument("--min-round-s", type=float, default=0.25, help="a fast arm repeats this long per round")
    p.add_argument("--max-seconds", type=float, default=300.0, help="stop starting new rounds after this")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1]
                break
    return f"{device.type}-" + re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")


def _errors(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    d = (y.reshape(-1).double() - x.reshape(-1).double())
    return float(d.norm() / x.double().norm()), float(d.abs().max())


def codec_arm(name: str, x: torch.Tensor, out: torch.Tensor, **options: object) -> Arm:
    codec = get_codec(name, device=x.device, **options)
    data = codec.encode(x)
    rel, mx = _errors(x, codec.decode(data))
    label = name + (f"+zstd{options['zstd_level']}" if options.get("zstd_level") else "")
    return Arm(label, len(data) / x.numel(), rel, mx, lambda: codec.encode(x),
               lambda: codec.decode_accumulate(data, out))


def kernel_arm(label: str, backend: quant.QuantBackend, x: torch.Tensor, out: torch.Tensor, *, int4: bool,
               block_size: int) -> Arm:
    """The quantize / dequantize-accumulate functions alone: no header, checksum or bytes."""
    kw = {"block_size": block_size, "scale_fp16": False, "stochastic": False, "generator": None}
    enc = backend.int4_quantize if int4 else backend.int8_quantize
    acc = backend.int4_dequantize_accumulate if int4 else backend.int8_dequantize_accumulate
    q, s = enc(x, **kw)
    decoded = torch.zeros_like(x)
    acc(q, s, block_size=block_size, out=decoded)
    rel, mx = _errors(x, decoded)
    size = (q.numel() * q.element_size() + s.numel() * s.element_size()) / x.numel()
    return Arm(label, size, rel, mx, lambda: enc(x, **kw), lambda: acc(q, s, block_size=block_size, out=out))


def sparse_kernel_arm(label: str, backend: sparse.SparseBackend, x: torch.Tensor, out: torch.Tensor, *,
                      chunk: int, density: float, bits: int) -> Arm:
    """The chunked top-k encode / decode-accumulate functions alone: no header, checksum or bytes."""
    kw = {"chunk": chunk, "k": max(1, min(chunk, round(density * chunk))), "bits": bits}
    body = backend.sparse_encode(x, **kw)
    decoded = torch.zeros_like(x)
    backend.sparse_decode_accumulate(body, numel=x.numel(), out=decoded, **kw)
    rel, mx = _errors(x, decoded)
    return Arm(label, body.numel() / x.numel(), rel, mx, lambda: backend.sparse_encode(x, **kw),
               lambda: backend.sparse_decode_accumulate(body, numel=x.numel(), out=out, **kw))


def patch_hivemind_extract() -> bool:
    """hivemind 1.1.12's Quantization.extract does int() of a 1-element array, a TypeError under numpy >= 2.4
    (fixed upstream after 1.1.12). Replace it, in this process only, by the same decode read with [0]."""
    from hivemind.compression import Uniform8BitQuantization
    from hivemind.compression.base import CompressionInfo
    from hivemind.compression.quantization import Quantization

    def extract(self: Quantization, serialized: object) -> torch.Tensor:
        buf = serialized.buffer  # type: ignore[attr-defined]
        n_codes = int(np.frombuffer(buf, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buf, offset=8, count=n_codes, dtype=self.codebook_dtype)
        indices = np.frombuffer(buf, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(tuple(serialized.size))  # type: ignore[attr-defined]
        return torch.as_tensor(codebook).to(getattr(torch, serialized.dtype))[idx]  # type: ignore[attr-defined]

    probe, codec = torch.randn(16), Uniform8BitQuantization()
    msg = codec.compress(probe, CompressionInfo.from_tensor(probe))
    try:
        codec.extract(msg)
        return False
    except TypeError:
        Quantization.extract = extract  # type: ignore[method-assign]
        return True


def hivemind_arm(x: torch.Tensor, out: torch.Tensor) -> Arm:
    from hivemind.compression import Uniform8BitQuantization
    from hivemind.compression.base import CompressionInfo

    codec, info = Uniform8BitQuantization(), CompressionInfo.from_tensor(x)
    msg = codec.compress(x, info)
    rel, mx = _errors(x, codec.extract(msg))
    return Arm("hivemind Uniform8Bit", msg.ByteSize() / x.numel(), rel, mx, lambda: codec.compress(x, info),
               lambda: out.add_(codec.extract(msg)))


def bitsandbytes_arm(x: torch.Tensor, out: torch.Tensor, *, block_size: int) -> Arm:
    import bitsandbytes.functional as bnb

    q, state = bnb.quantize_blockwise(x, blocksize=block_size)
    rel, mx = _errors(x, bnb.dequantize_blockwise(q, state))
    size = (q.numel() + state.absmax.numel() * state.absmax.element_size()) / x.numel()
    return Arm(f"bitsandbytes blockwise{block_size}", size, rel, mx,
               lambda: bnb.quantize_blockwise(x, blocksize=block_size),
               lambda: out.add_(bnb.dequantize_blockwise(q, state)))


def build_arms(x: torch.Tensor, out: torch.Tensor, args: argparse.Namespace, notes: list[str]) -> list[Arm]:
    dst = torch.empty_like(x)
    copy = Arm("torch copy_ (reference)", 4.0, 0.0, 0.0, lambda: dst.copy_(x), lambda: dst.copy_(x))
    arms = [copy]
    bs = args.block_size
    for name in ("fp32", "fp16", "bf16", "int8", "int4"):
        opts: dict[str, object] = {"block_size": bs} if name in ("int8", "int4") else {}
        arms.append(codec_arm(name, x, out, **opts))
        arms.append(codec_arm(name, x, out, zstd_level=args.zstd_level, **opts))
    fused = fused_backend(x.device)
    for int4 in (False, True):
        kind = "int4" if int4 else "int8"
        arms.append(kernel_arm(f"{kind} kernel {backend_name(fused)}", fused, x, out, int4=int4, block_size=bs))
        arms.append(kernel_arm(f"{kind} kernel torch-reference", quant, x, out, int4=int4, block_size=bs))
    sparse_backends: list[tuple[str, sparse.SparseBackend]] = [("torch-reference", sparse)]
    if hasattr(fused, "sparse_encode"):
        sparse_backends.insert(0, (backend_name(fused), cast(sparse.SparseBackend, fused)))
    else:
        notes.append(f"no fused sparse kernels on {x.device.type}: only the torch reference sparse arms")
    for density in (0.01, 0.02):
        for name, backend in sparse_backends:
            label = f"sparse{density:.0%} b{args.sparse_bits} kernel {name}"
            arms.append(sparse_kernel_arm(label, backend, x, out, chunk=args.sparse_chunk, density=density,
                                          bits=args.sparse_bits))
    if x.device.type == "cpu":
        if patch_hivemind_extract():
            notes.append("patched hivemind Quantization.extract (int() of a 1-element array fails under numpy "
                         f"{np.__version__}; this process only, same decode)")
        arms.append(hivemind_arm(x, out))
    else:
        notes.append("hivemind codecs run on the CPU only: no hivemind arm on cuda")
    try:
        arms.append(bitsandbytes_arm(x, out, block_size=bs))
    except Exception as exc:  # an optional comparison arm: any failure to import or run just drops it
        notes.append(f"bitsandbytes arm skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    return arms


def time_arms(arms: list[Arm], *, rounds: int, max_seconds: float, min_round_s: float,
              sync: Callable[[], None]) -> int:
    """Interleaved rounds; each arm keeps its best single-call encode and decode-accumulate time.

    Within a round a fast arm repeats for min_round_s, so on a busy machine every arm gets many
    chances at an undisturbed call. Returns the number of rounds run."""
    for arm in arms:  # warm-up: first-touch allocations, lazy init
        arm.encode(), arm.decode_acc()
    sync()
    start = time.perf_counter()
    done = 0
    while done < rounds and (done == 0 or time.perf_counter() - start < max_seconds):
        for arm in arms:
            for which in ("encode", "decode_acc"):
                fn, best, spent = getattr(arm, which), getattr(arm, f"{which}_s"), 0.0
                while spent < min_round_s:
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    dt = time.perf_counter() - t0
                    best, spent = min(best, dt), spent + dt
                setattr(arm, f"{which}_s", best)
        done += 1
    return done


def report(arms: list[Arm], *, numel: int) -> list[dict[str, object]]:
    gbs = 4 * numel / 1e9
    copy_gbs = gbs / min(arms[0].encode_s, arms[0].decode_acc_s)  # both columns of the copy arm time a copy
    hm = next((a for a in arms if a.name.startswith("hivemind")), None)
    rows = []
    print(f"{'arm':34} {'B/elem':>7} {'rel L2':>9} {'max err':>9} {'enc GB/s':>9} {'%copy':>6} {'dec+acc GB/s':>12}"
          f" {'%copy':>6} {'enc x hm':>8} {'dec x hm':>8}")
    for a in arms:
        row = {k: v for k, v in asdict(a).items() if k not in ("encode", "decode_acc")}
        row.update(encode_gbs=gbs / a.encode_s, decode_acc_gbs=gbs / a.decode_acc_s,
                   encode_pct_copy=100 * gbs / a.encode_s / copy_gbs,
                   decode_acc_pct_copy=100 * gbs / a.decode_acc_s / copy_gbs)
        if hm is not None:
            row.update(encode_x_hivemind=hm.encode_s / a.encode_s,
                       decode_acc_x_hivemind=hm.decode_acc_s / a.decode_acc_s)
        rows.append(row)
        hmx = (f"{row['encode_x_hivemind']:8.1f} {row['decode_acc_x_hivemind']:8.1f}" if hm else "")
        print(f"{a.name:34} {a.bytes_per_element:7.3f} {a.rel_l2:9.2e} {a.max_err:9.2e} {row['encode_gbs']:9.2f} "
              f"{row['encode_pct_copy']:6.0f} {row['decode_acc_gbs']:12.2f} {row['decode_acc_pct_copy']:6.0f} {hmx}")
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)).to(device)
    out = torch.zeros_like(x)
    notes: list[str] = []
    arms = build_arms(x, out, args, notes)
    rounds = time_arms(arms, rounds=args.rounds, max_seconds=args.max_seconds, min_round_s=args.min_round_s,
                       sync=sync)
    label = device_label(device)
    print(f"\n{label}, {args.numel} fp32 elements N(0,1), block {args.block_size}, {args.threads} thread(s), "
          f"{rounds} round(s), best single call; GB/s = input fp32 bytes / s; %copy vs dst.copy_(src) in this run")
    rows = report(arms, numel=args.numel)
    for note in notes:
        print("note:", note)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"codecs-{label}.json"
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path.write_text(json.dumps({"device": label, "args": meta, "rounds": rounds, "torch": torch.__version__,
                                "notes": notes, "arms": rows}, indent=2) + "\n", encoding="utf-8")
    print("wrote", path)


if __name__ == "__main__":
    main()

"""The GPU machine's runs, in order of value, as one command that fits a short slice of device time.

Each step writes its results under `--out` (benchmarks/results/ by default) named with the GPU, and the
session's summary (which steps ran, passed, and how long each took) goes to `gpu-session-<GPU>.json`. A step
that fails is recorded and the next one runs; a step that would start with less than its stated need of the
`--budget-s` left is recorded as not run. Try it on a CPU machine with `--on-cpu` (tiny settings, CPU
device: the GPU tests skip themselves, the benchmarks run small).

  python benchmarks/gpu_session.py --budget-s 540            # on the GPU machine
  python benchmarks/gpu_session.py --on-cpu --budget-s 300   # on a CPU machine, first

Steps: `tests`: tests/gpu in full (the kernels' parity, the GPU-resident round against the CPU's);
`round`: benchmarks/round_device.py on the gpt2-124m preset (the round on the GPU against on the host);
`codecs`: benchmarks/codecs.py --device cuda at 16M values (the kernels against a device-to-device copy).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _gpu_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name(0)).strip("-")


def _steps(out: Path, gpu: str, on_cpu: bool) -> list[tuple[str, float, list[str]]]:
    """(name, seconds it needs at least, command) in order of value."""
    py = sys.executable
    preset = "tiny" if on_cpu else "gpt2-124m"
    device = "cpu" if on_cpu else "cuda"
    return [
        ("tests", 60.0, [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu",
                         f"--junitxml={out / f'gpu-tests-{gpu}.xml'}"]),
        ("round", 90.0, [py, "benchmarks/round_device.py", "--device", device, "--rounds", "2" if on_cpu else "6",
                         "--set", f"model.preset={preset}", "--json", str(out / f"round-device-{gpu}.json")]),
        ("codecs", 120.0, [py, "benchmarks/codecs.py", "--device", device, "--rounds", "1" if on_cpu else "5",
                           "--max-seconds", "20" if on_cpu else "240",
                           *(["--numel", str(1 << 18)] if on_cpu else []),
                           "--out", str(out)]),  # it names its file by the device
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=540.0, help="wall seconds the whole session may take")
    p.add_argument("--on-cpu", action="store_true", help="tiny settings on the CPU (every step run small)")
    p.add_argument("--only", nargs="+", choices=["tests", "round", "codecs"], help="run these steps alone")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = _gpu_name()
    if gpu == "cpu" and not args.on_cpu:
        print("gpu_session: no CUDA device here; run with --on-cpu on a CPU machine", file=sys.stderr)
        return 2
    started = time.monotonic()
    record: dict[str, object] = {"gpu": gpu, "on_cpu": args.on_cpu, "budget_s": args.budget_s, "steps": []}
    steps: list[dict[str, object]] = []
    for name, need_s, command in _steps(args.out, gpu, args.on_cpu):
        if args.only and name not in args.only:
            continue
        left = args.budget_s - (time.monotonic() - started)
        if left < need_s:
            steps.append({"step": name, "ran": False, "why": f"{left:.0f} s left, needs {need_s:.0f} s"})
            continue
        print(f"gpu_session: {name}: {' '.join(command)}", flush=True)
        t0 = time.monotonic()
        try:
            done = subprocess.run(command, cwd=ROOT, timeout=left, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
            rc, tail = done.returncode, (done.stdout + done.stderr)[-3000:]
        except subprocess.TimeoutExpired as e:
            rc, tail = 124, f"timed out after {left:.0f} s: {str(e.stdout or '')[-2000:]}"
        steps.append({"step": name, "ran": True, "rc": rc, "seconds": round(time.monotonic() - t0, 1),
                      "output_tail": tail})
        print(f"gpu_session: {name}: exit {rc} in {time.monotonic() - t0:.0f} s\n{tail[-1500:]}", flush=True)
    record["steps"] = steps
    record["seconds"] = round(time.monotonic() - started, 1)
    path = args.out / f"gpu-session-{gpu}{'-on-cpu' if args.on_cpu else ''}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"gpu_session: wrote {path}")
    return 0 if all(s.get("rc", 0) == 0 for s in steps if s["ran"]) else 1


if __name__ == "__main__":
    sys.exit(main())

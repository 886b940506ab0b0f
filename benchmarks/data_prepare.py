"""`swarmtrain data prepare` on generated jsonl of two sizes: peak memory, and tokens/s against the tokenizer.

Generates jsonl documents (random runs of tinyshakespeare lines, seeded) of each `--sizes-gb`, prepares each
with a byte-level BPE trained on tinyshakespeare, and samples the RSS of the whole process tree (the main
process and its tokenizer processes) every 0.1 s. In the same run it times the tokenizer library's own
`encode_batch` (all cores, the library's threads) on the first `--reference-mb` of the same documents:
preparation's tokens/s over that is the cost of reading, splitting, ordering and writing. Inputs and shards
are deleted after each size.

    python benchmarks/data_prepare.py                       # 0.5 GB and 2 GB -> benchmarks/results/data-prepare.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


def generate(path: Path, *, size_bytes: int, lines: list[str], seed: int) -> int:
    """jsonl documents of 5-60 random lines each until `size_bytes`; returns the documents written."""
    rng = random.Random(seed)
    written = docs = 0
    with path.open("w", encoding="utf-8") as f:
        while written < size_bytes:
            chunk = []
            for _ in range(1000):
                text = "\n".join(rng.choices(lines, k=rng.randint(5, 60)))
                chunk.append(json.dumps({"text": text}) + "\n")
            data = "".join(chunk)
            f.write(data)
            written += len(data.encode())
            docs += len(chunk)
    return docs


class TreePeak:
    """Samples the summed RSS of a process and its descendants until stopped."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.proc = psutil.Process(pid)
        self.peak_total = self.peak_main = 0
        self._stop = threading.Event()
        self._interval = interval_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                main = self.proc.memory_info().rss
                kids = sum(c.memory_info().rss for c in self.proc.children(recursive=True))
            except psutil.Error:
                break
            self.peak_main = max(self.peak_main, main)
            self.peak_total = max(self.peak_total, main + kids)
            self._stop.wait(self._interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def reference_speed(tokenizer: Path, jsonl: Path, *, mb: int) -> dict[str, float]:
    """The tokenizer library's own batch encode (all its threads) on the first `mb` MB of documents."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    texts, size = [], 0
    with jsonl.open(encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(line)
            if size >= mb << 20:
                break
    start = time.perf_counter()
    tokens = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    seconds = time.perf_counter() - start
    return {"bytes": size, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def prepare(jsonl: Path, out: Path, *, tokenizer: Path, workers: int) -> dict[str, Any]:
    argv = [sys.executable, "-m", "swarmtrain", "data", "prepare", str(jsonl), "--out", str(out),
            "--tokenizer", str(tokenizer), "--workers", str(workers)]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    peak = TreePeak(proc.pid)
    stdout, _ = proc.communicate()
    peak.stop()
    if proc.returncode:
        raise SystemExit(f"data prepare failed with status {proc.returncode}")
    result = json.loads(stdout.strip().splitlines()[-1])
    result.update(wall_s=time.perf_counter() - start, peak_rss_tree_mb=peak.peak_total / 2**20,
                  peak_rss_main_mb=peak.peak_main / 2**20)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-gb", type=float, nargs="+", default=[0.5, 2.0])
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--reference-mb", type=int, default=64)
    p.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "data-prepare.json")
    args = p.parse_args()
    from swarmtrain.data.readers import iter_texts
    from swarmtrain.data.tokenizer_train import train_bpe

    work = Path(tempfile.mkdtemp(prefix="swarmtrain-prepare-", dir=args.tmp))
    try:
        tokenizer = work / "tokenizer.json"
        train_bpe(iter_texts([str(SHAKESPEARE)]), vocab_size=args.vocab_size, out=tokenizer)
        lines = [x for x in SHAKESPEARE.read_text(encoding="utf-8").splitlines() if x.strip()]
        runs = []
        for gb in args.sizes_gb:
            jsonl = work / f"docs-{gb:g}gb.jsonl"
            docs = generate(jsonl, size_bytes=int(gb * 2**30), lines=lines, seed=1)
            ref = reference_speed(tokenizer, jsonl, mb=args.reference_mb)
            run = prepare(jsonl, work / f"shards-{gb:g}gb", tokenizer=tokenizer, workers=args.workers)
            run.update(input_gb=jsonl.stat().st_size / 2**30, documents=docs, reference=ref,
                       prepare_over_encode_batch=run["tokens_per_s"] / ref["tokens_per_s"])
            runs.append(run)
            print(f"{run['input_gb']:.2f} GB: {run['train_tokens'] + run['val_tokens']:,} tokens "
                  f"in {run['seconds']:.0f} s "
                  f"({run['tokens_per_s']:,.0f} tok/s; encode_batch alone {ref['tokens_per_s']:,.0f} tok/s: "
                  f"{run['prepare_over_encode_batch']:.2f}x); peak RSS {run['peak_rss_tree_mb']:.0f} MB "
                  f"(main process {run['peak_rss_main_mb']:.0f} MB)", flush=True)
            jsonl.unlink()
            shutil.rmtree(work / f"shards-{gb:g}gb")
        summary = {"rss_ratio_largest_over_smallest": runs[-1]["peak_rss_tree_mb"] / runs[0]["peak_rss_tree_mb"],
                   "max_peak_rss_mb": max(r["peak_rss_tree_mb"] for r in runs)}
        print(f"peak RSS {args.sizes_gb[-1]:g} GB / {args.sizes_gb[0]:g} GB: "
              f"{summary['rss_ratio_largest_over_smallest']:.3f}x; highest {summary['max_peak_rss_mb']:.0f} MB")
        args.out.write_text(json.dumps({"machine": f"{os.cpu_count()} CPUs", "workers": args.workers,
                                        "vocab_size": args.vocab_size, "runs": runs, "summary": summary}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

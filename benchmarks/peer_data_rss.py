"""A training peer's memory against its dataset's size: shards of 20M and 200M tokens, and text read whole.

For each size, generated text (random tinyshakespeare lines, seeded) is prepared into byte-token shards;
then a real coordinator and one peer (`averaging.min_peers=1`) train the same llama for the same rounds,
and the peer's RSS is sampled every 0.1 s (its own process, and with its DHT child). A last arm trains on
the largest text file through `data.paths` (read and tokenized whole at start), the path small corpora
take, for comparison.

    python benchmarks/peer_data_rss.py        # -> benchmarks/results/peer-data-rss.json
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
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
sys.path.insert(0, str(REPO / "benchmarks"))
from data_prepare import TreePeak  # noqa: E402

RUN = ["model.arch=llama", "model.preset=small", "data.seq_len=128", "data.batch_size=8", "diloco.inner_steps=20",
       "diloco.rounds=4", "diloco.eval_batches=4", "averaging.min_peers=1", "averaging.matchmaking_timeout_s=0.5",
       "discovery.heartbeat_s=0.5", "train.threads=2"]


def text_file(path: Path, *, size_bytes: int) -> None:
    rng = random.Random(1)
    lines = [x for x in SHAKESPEARE.read_text(encoding="utf-8").splitlines() if x.strip()]
    written = 0
    with path.open("w", encoding="utf-8") as f:
        while written < size_bytes:
            chunk = "\n".join(rng.choices(lines, k=20000)) + "\n"
            f.write(chunk)
            written += len(chunk.encode())


def train(data: list[str], *, work: Path, name: str) -> dict[str, Any]:
    """Coordinator + one peer until the run's rounds are done; the peer's peak RSS."""
    sets = [x for o in [*RUN, *data] for x in ("--set", o)]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    coord = subprocess.Popen([sys.executable, "-m", "swarmtrain", "coordinator", *sets], stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        assert coord.stdout is not None
        ready = next(line for line in coord.stdout if line.startswith("READY "))
        join = json.loads(ready[len("READY "):])["maddrs"][0]
        start = time.perf_counter()
        peer = subprocess.Popen([sys.executable, "-m", "swarmtrain", "peer", "--join", join, "--no-progress",
                                 "--set", "train.threads=2"],
                                stdout=subprocess.PIPE, text=True, env=env)
        peak = TreePeak(peer.pid)
        out, _ = peer.communicate(timeout=1800)
        peak.stop()
        if peer.returncode:
            raise SystemExit(f"{name}: the peer exited with {peer.returncode}")
        rounds = [json.loads(x) for x in out.splitlines() if x.startswith('{"event": "round"')]
        return {"arm": name, "peak_rss_peer_mb": peak.peak_main / 2**20,
                "peak_rss_with_dht_mb": peak.peak_total / 2**20, "rounds": len(rounds),
                "final_val_loss": rounds[-1]["val_loss"], "wall_s": time.perf_counter() - start}
    finally:
        coord.terminate()
        coord.wait(timeout=60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[20_000_000, 200_000_000])
    p.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "peer-data-rss.json")
    args = p.parse_args()
    from swarmtrain.data.prepare import PrepareOptions, prepare

    work = Path(tempfile.mkdtemp(prefix="swarmtrain-peer-rss-", dir=args.tmp))
    try:
        arms = []
        for n in args.tokens:
            text = work / f"text-{n}.txt"
            text_file(text, size_bytes=n)
            shards = work / f"shards-{n}"
            prepare(PrepareOptions(inputs=(str(text),), out=str(shards), val_fraction=0.01, workers=1))
            arms.append(train([f"data.shards={json.dumps(str(shards))}"], work=work,
                              name=f"shards {n / 1e6:g}M tokens"))
            print(json.dumps(arms[-1]), flush=True)
        largest = work / f"text-{args.tokens[-1]}.txt"
        arms.append(train([f"data.paths={json.dumps([str(largest)])}"], work=work,
                          name=f"text read whole {args.tokens[-1] / 1e6:g}M tokens"))
        print(json.dumps(arms[-1]), flush=True)
        ratio = arms[len(args.tokens) - 1]["peak_rss_peer_mb"] / arms[0]["peak_rss_peer_mb"]
        print(f"peer peak RSS, shards {args.tokens[-1] / 1e6:g}M / {args.tokens[0] / 1e6:g}M tokens: {ratio:.3f}x")
        args.out.write_text(json.dumps({"machine": f"{os.cpu_count()} CPUs", "run": RUN, "arms": arms,
                                        "shards_rss_ratio": ratio}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The work an overlapped round puts on the training thread, against the inner steps of the round.

An overlapped peer (`diloco.overlap`) trains through its rounds: what still runs between two inner
steps is the next Δ with the eager estimate (`send_overlapped`, after the round's last step) and the
commit (`apply`: the outer step on the decoded mean, and θ_local settled on it). Every millisecond of
it is a millisecond the peer does not train, so this prints it per round next to the round's compute
(H / P inner steps), measured in the same run on one worker of the WAN testbed's model and workload
(`benchmarks/wan.py`: preset `small`, batch 4 × 128, one thread). θ_global's hash is timed too; a
peer takes it beside the steps, off the training thread.

  python benchmarks/round_work.py                      # sparse 5%, 2 fragments (the testbed's arm)
  python benchmarks/round_work.py --set compress.codec=int8 --set diloco.fragments=1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from swarmtrain.compress import codec_from_config
from swarmtrain.config import load_config
from swarmtrain.data import ShardedBatches, load_corpus
from swarmtrain.diloco import DilocoWorker
from swarmtrain.diloco.averager import AverageResult
from swarmtrain.models import build_model

ARM = ["model.preset=small", "data.seq_len=128", "data.batch_size=4", "data.max_corpus_bytes=20000000",
       "compress.codec=sparse", "compress.error_feedback=true", "compress.error_feedback_decay=0.9",
       "compress.density=0.05", "outer.lr=4", "outer.momentum=0", "outer.nesterov=false", "diloco.overlap=true",
       "diloco.fragments=2", "diloco.inner_steps=50", "train.threads=1"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=24, help="rounds timed (after 2 of warm-up)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(overrides=[*ARM, *args.set])
    tokens = load_corpus(cfg.data).train
    codec = codec_from_config(cfg.compress, seed=0)
    worker = DilocoWorker(cfg, model=build_model(cfg.model, seed=0), device=torch.device("cpu"), codec=codec,
                          batches=ShardedBatches(tokens, worker_index=0, num_workers=4, batch_size=cfg.data.batch_size,
                                                 seq_len=cfg.data.seq_len, seed=0))
    timed: dict[str, list[float]] = {"inner step": [], "send_overlapped": [], "apply": [], "hash": []}
    for r in range(args.rounds + 2):
        start = time.perf_counter()
        stats = worker.train_inner(2)
        step_s = (time.perf_counter() - start) / stats.steps
        start = time.perf_counter()
        delta, carry = worker.send_overlapped()
        send_s = time.perf_counter() - start
        mean = codec.decode(codec.encode(delta)).reshape(-1)  # a mean as a commit hands it over: decoded
        worker.train_inner(1)
        start = time.perf_counter()
        worker.apply(AverageResult(round=worker.round, committed=True, mean=mean, members=("a", "b", "c", "d")),
                     carry=carry)
        apply_s = time.perf_counter() - start
        start = time.perf_counter()
        worker.global_hash()
        hash_s = time.perf_counter() - start
        if r >= 2:
            for key, value in zip(timed, (step_s, send_s, apply_s, hash_s), strict=True):
                timed[key].append(value)
    med = {k: statistics.median(v) for k, v in timed.items()}
    round_steps = cfg.diloco.round_steps
    on_thread = med["send_overlapped"] + med["apply"]
    print(f"{worker.numel:,} parameters, {cfg.compress.codec}, {cfg.diloco.fragments} fragment(s), "
          f"{round_steps} inner steps a round; medians of {args.rounds} rounds")
    for key, value in med.items():
        print(f"  {key:16s} {1e3 * value:8.2f} ms")
    print(f"  on the training thread per round: {1e3 * on_thread:.2f} ms = "
          f"{100 * on_thread / (round_steps * med['inner step']):.2f}% of the round's compute "
          f"({round_steps} x {1e3 * med['inner step']:.1f} ms)")


if __name__ == "__main__":
    main()

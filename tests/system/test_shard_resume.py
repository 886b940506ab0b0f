"""A peer training on token shards, SIGKILLed and restarted from its checkpoint, reads the same next batches.

The child (this file run as a script) is one DiLoCo worker of the built-in llama reading shards that
`swarmtrain data prepare` wrote (slot 1 of 2, a Feistel window order, batches split into micro-batches),
checkpointing after every inner step; it prints `STEP s <digest of the batch of step s> <state hash>`.
The test kills it (SIGKILL) right after a STEP line, twice, restarts it each time from the checkpoint
directory, and requires every step's batch and state to equal those of an uninterrupted run.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmtrain.config import load_config
from swarmtrain.data import ShardedBatches, load_corpus
from swarmtrain.data.prepare import PrepareOptions, prepare
from swarmtrain.diloco import DilocoWorker
from swarmtrain.diloco.flat import flat_hash, flatten
from swarmtrain.models import build_model
from swarmtrain.sync import checkpoint as ckpt

pytestmark = pytest.mark.system

TOTAL_STEPS = 12
LINE_TIMEOUT_S = 60.0


class _Recording:
    """The worker's batch stream, remembering the digest of the last batch it handed out."""

    def __init__(self, inner: ShardedBatches) -> None:
        self.inner, self.last = inner, ""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = next(self.inner)
        self.last = hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()[:16]
        return x, y

    def state_dict(self) -> dict[str, object]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.inner.load_state_dict(state)


def _child(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--shards", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(overrides=[
        "model.arch=llama", "model.preset=tiny", "model.n_layer=1", f"data.shards={args.shards!r}",
        "data.seq_len=32", "data.batch_size=4", "data.micro_batch_size=2", "inner.warmup_steps=2",
        "diloco.inner_steps=4", "diloco.rounds=3", "train.device=cpu",
    ])
    batches = _Recording(ShardedBatches(load_corpus(cfg.data).train, worker_index=1, num_workers=2, batch_size=4,
                                        seq_len=cfg.data.seq_len, seed=cfg.train.seed))
    worker = DilocoWorker(cfg, model=build_model(cfg.model, seed=0), batches=batches, device=torch.device("cpu"),
                          rng_seed=5)
    step = 0
    loaded = ckpt.load_latest_checkpoint(args.dir)
    if loaded is not None:
        worker.load_state_dict(loaded.tensors, loaded.meta["worker"])
        step = loaded.meta["step"]
    print(f"RESUMED {step}", flush=True)
    while step < TOTAL_STEPS:
        worker.train_inner(1)
        step += 1
        tensors, meta = worker.state_dict()
        ckpt.save_checkpoint(args.dir, tensors=tensors, meta={"worker": meta, "step": step}, keep=2)
        print(f"STEP {step} {batches.last} {flat_hash(flatten(worker.params))}", flush=True)
    print("DONE", flush=True)


class _Run:
    def __init__(self, ckpt_dir: Path, shards: Path, log_path: Path) -> None:
        argv = [sys.executable, __file__, "--dir", str(ckpt_dir), "--shards", str(shards)]
        self.log = log_path.open("wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, prefix: str) -> str:
        while True:
            try:
                line = self._queue.get(timeout=LINE_TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(f"no {prefix!r} line within {LINE_TIMEOUT_S}s; got {self.lines[-5:]}") from None
            if line is None:
                raise AssertionError(f"child exited (rc={self.proc.wait()}) before {prefix!r}; got {self.lines[-5:]}")
            self.lines.append(line)
            if line.startswith(prefix):
                return line

    def close(self, *, kill: bool = False) -> None:
        if kill and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=LINE_TIMEOUT_S)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self.log.close()

    def steps(self) -> dict[int, tuple[str, str]]:
        return {int(w[1]): (w[2], w[3]) for w in (line.split() for line in self.lines) if w[0] == "STEP"}


def test_a_killed_peer_reads_the_same_next_batches_from_its_shards(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    root = Path(torch.__file__).parent.parent / "torch"
    text.write_text("".join(p.read_text(errors="replace") for p in sorted(root.glob("*.py"))[:20]), encoding="utf-8")
    shards = tmp_path / "shards"
    prepare(PrepareOptions(inputs=(str(text),), out=str(shards), val_fraction=0.1, workers=1, shard_tokens=50_000))

    reference = _Run(tmp_path / "ref", shards, tmp_path / "ref.log")
    try:
        reference.wait_for("DONE")
    finally:
        reference.close()
    want = reference.steps()
    assert sorted(want) == list(range(1, TOTAL_STEPS + 1))
    assert len({batch for batch, _ in want.values()}) == TOTAL_STEPS, "every step reads another batch"

    seen: set[int] = set()
    resume_at = 0
    for i, kill_after in enumerate((3, 8, None)):
        run = _Run(tmp_path / "ckpt", shards, tmp_path / f"run{i}.log")
        try:
            assert run.wait_for("RESUMED") == f"RESUMED {resume_at}"
            run.wait_for(f"STEP {kill_after}" if kill_after else "DONE")
        finally:
            run.close(kill=kill_after is not None)
        for step, line in run.steps().items():  # a step run again after a kill reads and makes the same
            assert line == want[step], f"run {i}, step {step}: {line} != the uninterrupted run's {want[step]}"
            seen.add(step)
        # The kill lands after the STEP line; the run may have saved a step more before it did.
        loaded = ckpt.load_latest_checkpoint(tmp_path / "ckpt")
        resume_at = int(loaded.meta["step"]) if loaded is not None else 0
        assert kill_after is None or resume_at >= kill_after
    assert seen == set(want)


if __name__ == "__main__":
    _child(sys.argv[1:])

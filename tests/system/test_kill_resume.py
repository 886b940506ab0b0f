"""A peer SIGKILLed between any two steps, or inside a checkpoint save, resumes with no loss or corruption.

The child (this file run as a script) is one DiLoCo peer: a real `DilocoWorker` on the tiny GPT and
the stdlib corpus, a stand-in swarm whose mean Δ depends only on the round, and a checkpoint after
every step (each inner step and each outer step). It prints `STEP s <hash>` after step s is saved.
With `--pause-at S:K` it stops just before the K-th durable filesystem call (fsync, rename, unlink)
of step S's save and prints `PAUSED`, so the test kills it there deterministically; no sleeps.

One run is killed five times — inside saves at every phase (payload written but not renamed,
manifest not renamed, committed but not pruned, half pruned), and once right after a STEP line —
and once its newest checkpoint is damaged before the restart. Every step's hash from every run,
and the final θ_global, must equal an uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from swarmtrain.config import load_config
from swarmtrain.data import ShardedBatches, load_corpus
from swarmtrain.diloco import DilocoWorker
from swarmtrain.diloco.averager import AverageResult
from swarmtrain.diloco.flat import flat_hash, flatten
from swarmtrain.models import build_model
from swarmtrain.sync import checkpoint as ckpt

pytestmark = pytest.mark.system

INNER_STEPS = 3
ROUNDS = 3
TOTAL_STEPS = ROUNDS * (INNER_STEPS + 1)  # each round: H inner steps, then one outer step
LINE_TIMEOUT_S = 60.0


# ---------------------------------------------------------------- the child: one checkpointing peer


class _StandInSwarm:
    """The mean of this peer's Δ and a fixed 'other peer' Δ drawn from the round number (resume-safe)."""

    def average(self, round_index: int, delta: torch.Tensor) -> AverageResult:
        other = torch.randn(delta.numel(), generator=torch.Generator().manual_seed(round_index)) * 1e-3
        return AverageResult(round=round_index, committed=True, mean=(delta + other) / 2, members=("me", "other"))


def _pause_inside_saves(step_of_save: list[int], pause_step: int, pause_op: int) -> None:
    """Block before the `pause_op`-th fsync/rename/unlink of step `pause_step`'s save, after saying so."""
    count = [0]
    real = {"fsync": os.fsync, "replace": os.replace, "unlink": Path.unlink}

    def hook(name: str):
        def wrapped(*args, **kwargs):
            if step_of_save[0] == pause_step:
                if count[0] == pause_op:
                    target = args[-1] if name != "fsync" else os.readlink(f"/proc/self/fd/{args[0]}")
                    print(f"PAUSED {pause_step} {pause_op} {name} {Path(str(target)).name}", flush=True)
                    sys.stdin.readline()  # the test SIGKILLs us here; it never writes
                    raise SystemExit("stdin closed while paused")
                count[0] += 1
            return real[name](*args, **kwargs)
        return wrapped

    os.fsync, os.replace = hook("fsync"), hook("replace")  # type: ignore[assignment]
    Path.unlink = hook("unlink")  # type: ignore[method-assign]


def _child(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--pause-at", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(overrides=[
        "model.preset=tiny", "model.n_layer=1", "data.seq_len=32", "data.batch_size=4", "data.max_corpus_bytes=300000",
        "inner.warmup_steps=2", f"diloco.inner_steps={INNER_STEPS}", f"diloco.rounds={ROUNDS}", "train.device=cpu",
    ])
    batches = ShardedBatches(load_corpus(cfg.data).train, worker_index=1, num_workers=2, batch_size=4,
                             seq_len=cfg.data.seq_len, seed=cfg.train.seed)
    worker = DilocoWorker(cfg, model=build_model(cfg.model, seed=0), batches=batches, device=torch.device("cpu"),
                          rng_seed=5)
    step_of_save = [0]
    if args.pause_at:
        step, op = map(int, args.pause_at.split(":"))
        _pause_inside_saves(step_of_save, step, op)
    step = 0
    loaded = ckpt.load_latest_checkpoint(args.dir)
    if loaded is not None:
        worker.load_state_dict(loaded.tensors, loaded.meta["worker"])
        step = loaded.meta["step"]
    print(f"RESUMED {step}", flush=True)
    swarm = _StandInSwarm()
    while step < TOTAL_STEPS:
        if (step + 1) % (INNER_STEPS + 1):
            worker.train_inner(1)
        else:
            assert worker.apply(swarm.average(worker.round, worker.delta()))
        step += 1
        step_of_save[0] = step
        tensors, meta = worker.state_dict()
        ckpt.save_checkpoint(args.dir, tensors=tensors, meta={"worker": meta, "step": step}, keep=2)
        state_hash = flat_hash(torch.cat([worker.theta_global, flatten(worker.params)]))
        print(f"STEP {step} {state_hash}", flush=True)
    print(f"DONE {worker.round} {worker.global_hash()}", flush=True)


# ---------------------------------------------------------------- the test


class _Run:
    """One child process; stdout lines arrive on a queue so every wait has a deadline."""

    def __init__(self, ckpt_dir: Path, log_path: Path, *, pause_at: str = "") -> None:
        argv = [sys.executable, __file__, "--dir", str(ckpt_dir)] + (["--pause-at", pause_at] if pause_at else [])
        self.log = log_path.open("wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
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

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=LINE_TIMEOUT_S)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self.log.close()

    def steps(self) -> dict[int, str]:
        return {int(line.split()[1]): line.split()[2] for line in self.lines if line.startswith("STEP ")}


def _newest_step(ckpt_dir: Path) -> int:
    loaded = ckpt.load_latest_checkpoint(ckpt_dir)
    return 0 if loaded is None else int(loaded.meta["step"])


def test_killed_peer_resumes_bit_exactly(tmp_path: Path) -> None:
    reference = _Run(tmp_path / "ref", tmp_path / "ref.log")
    try:
        done = reference.wait_for("DONE")
    finally:
        reference.close()
    ref_steps = reference.steps()
    assert sorted(ref_steps) == list(range(1, TOTAL_STEPS + 1))
    assert done.split()[1] == str(ROUNDS)

    ckpt_dir = tmp_path / "ckpt"
    seen: list[_Run] = []
    # (pause step:op, the step the next run must resume from). Ops of a steady-state save:
    # 0 fsync payload, 1 rename payload, 2 fsync dir, 3 fsync manifest, 4 rename manifest (the commit),
    # 5 fsync dir, 6 unlink old manifest, 7 unlink old payload, 8 fsync dir.
    kills = [("2:1", 1), ("4:4", 3), ("", None), ("9:6", 9), ("11:7", 11)]
    expected_resume = 0
    for i, (pause_at, resume_at) in enumerate(kills):
        run = _Run(ckpt_dir, tmp_path / f"run{i}.log", pause_at=pause_at)
        seen.append(run)
        try:
            assert run.wait_for("RESUMED") == f"RESUMED {expected_resume}"
            if pause_at:
                paused = run.wait_for("PAUSED")
                assert paused.split()[1:3] == pause_at.split(":"), paused
            else:
                run.wait_for("STEP 6")  # a kill at an arbitrary point of step 7 (compute or save)
        finally:
            run.kill()
        expected_resume = resume_at if resume_at is not None else _newest_step(ckpt_dir)
        assert _newest_step(ckpt_dir) == expected_resume
        if pause_at == "9:6":
            # Damage the committed newest checkpoint: the next run must reject it and use step 8's.
            newest = ckpt.list_checkpoints(ckpt_dir)[-1].with_suffix(".safetensors")
            data = bytearray(newest.read_bytes())
            data[len(data) // 2] ^= 0xFF
            newest.write_bytes(bytes(data))
            expected_resume = 8

    final = _Run(ckpt_dir, tmp_path / "final.log")
    seen.append(final)
    try:
        assert final.wait_for("RESUMED") == f"RESUMED {expected_resume}"
        assert final.wait_for("DONE") == done
    finally:
        final.close()
    assert "rejected checkpoint" in (tmp_path / "run4.log").read_text()

    # Every step any run completed has the uninterrupted run's bit-exact state.
    for run in seen:
        for step, state_hash in run.steps().items():
            assert state_hash == ref_steps[step], f"step {step} diverged after a resume"
    # Step 11's save committed while it was paused in the prune, so no run printed it; step 12 builds on it.
    assert set(range(1, TOTAL_STEPS + 1)) - {s for run in seen for s in run.steps()} == {11}


if __name__ == "__main__":
    _child(sys.argv[1:])

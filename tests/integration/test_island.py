"""A 2-rank gloo island: rank 0 leads (IslandWorker), rank 1 follows (IslandFollower); only rank 0 averages; the
ranks' θ_local are bit-identical; and the island equals a 1-rank peer with 2× the batch.

The ranks are real processes (this file run as a script), rendezvousing on a port-0 TCPStore.
What is checked against the 1-rank reference: the island reads the reference's windows (one batch of 2B
windows per step, rank r taking rows [rB, (r+1)B)), the mean of two B-batch mean losses is the 2B-batch mean
loss, and DDP averages gradients before clipping and the optimizer step; so θ_global agrees up to float
summation order (not bit for bit), to a tolerance that is tight for inner SGD and looser for AdamW (whose
g/√v amplifies rounding in tiny gradients).
"""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from swarmtrain.config import RunConfig, load_config
from swarmtrain.data import ShardedBatches, load_corpus
from swarmtrain.diloco import DilocoWorker
from swarmtrain.diloco.averager import AverageResult
from swarmtrain.diloco.flat import flatten
from swarmtrain.diloco.island import Island, IslandError, IslandLost, island_env, open_store
from swarmtrain.diloco.island_steps import IslandFollower, IslandWorker, RankSlice
from swarmtrain.models import build_model
from swarmtrain.sync.checkpoint import load_latest_checkpoint, save_checkpoint

pytestmark = pytest.mark.integration

ROUNDS = 4
RESUME_AFTER = 2  # the child checkpoints after this many rounds and replays the rest from the checkpoint
ABORTED_ROUND = 1  # the averager aborts this round's first attempt, so the abort path is covered too
TIMEOUT_S = 120.0


def _config(optimizer: str, *, batch_size: int, parallel: str = "ddp") -> RunConfig:
    return load_config(overrides=[f"train.parallel={parallel}",
        "model.preset=tiny", "model.n_layer=1", "data.seq_len=32", f"data.batch_size={batch_size}",
        "data.max_corpus_bytes=400000", f"inner.optimizer={optimizer}",
        "inner.lr=0.01" if optimizer == "sgd" else "inner.lr=0.003",
        "inner.warmup_steps=2", "diloco.inner_steps=3", f"diloco.rounds={ROUNDS + 1}", "train.device=cpu",
    ])


class _SoloAverager:
    """One peer alone in the swarm: the mean is its own Δ; the first attempt of ABORTED_ROUND aborts."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def average(self, round_index: int, delta: torch.Tensor) -> AverageResult:
        self.calls.append(round_index)
        if round_index == ABORTED_ROUND and self.calls.count(round_index) == 1:
            return AverageResult(round=round_index, committed=False, mean=None, reason="test abort")
        return AverageResult(round=round_index, committed=True, mean=delta.clone(), members=("solo",), bytes_sent=4)


def _run_rounds(worker: DilocoWorker, averager, rounds: int, tag: str) -> None:
    done = 0
    while done < rounds:
        report = worker.run_round(averager)
        done += report.committed
        print(f"{tag} {report.round} {int(report.committed)} {worker.global_hash()}", flush=True)


# ---------------------------------------------------------------- the child (one rank)


def _stream(cfg: RunConfig, tokens: torch.Tensor, island: Island) -> RankSlice:
    whole = ShardedBatches(tokens, worker_index=0, num_workers=1, batch_size=2 * cfg.data.batch_size,
                           seq_len=cfg.data.seq_len, seed=cfg.train.seed)
    return RankSlice(whole, rank=island.rank, world_size=island.world_size)


def _locals(params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """θ_local as this rank holds it: whole (DDP; rank 0 under FSDP), or its shard of each parameter."""
    return {f"p{i}": (p.to_local() if hasattr(p, "to_local") else p).detach().contiguous()
            for i, p in enumerate(params)}


def _child(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--optimizer", required=True)
    p.add_argument("--parallel", required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = _config(args.optimizer, batch_size=4, parallel=args.parallel)
    store = open_store(host="127.0.0.1", port=args.port, rank=args.rank, world_size=2, timeout_s=TIMEOUT_S)
    if args.rank == 0:
        print(f"READY port={store.port}", flush=True)
    with Island.start(rank=args.rank, world_size=2, store=store, backend="gloo", timeout_s=TIMEOUT_S) as island:
        tokens = load_corpus(cfg.data).train
        # Different init seeds per rank: DDP must hand rank 0's weights to rank 1.
        model = build_model(cfg.model, seed=island.rank)
        if not island.is_leader:
            for tag in ("first", "resumed"):
                follower = IslandFollower(cfg, island=island, model=model, batches=_stream(cfg, tokens, island))
                assert follower.run() == tag
                save_file(_locals(follower.params), str(args.out / f"local1-{tag}.safetensors"))
                model = build_model(cfg.model, seed=8)
            return
        solo = _SoloAverager()
        worker = IslandWorker(cfg, island=island, model=model, batches=_stream(cfg, tokens, island))
        _run_rounds(worker, solo, RESUME_AFTER, "ROUND")
        tensors, meta = worker.state_dict()
        save_checkpoint(args.out / "ckpt", tensors=tensors, meta=meta)
        _run_rounds(worker, solo, ROUNDS - RESUME_AFTER, "ROUND")
        save_file({"theta": worker.theta_global}, str(args.out / "theta0.safetensors"))
        print(f"CALLS {','.join(map(str, solo.calls))}", flush=True)
        worker.train_inner(2)  # after the outer step: rank 1 must first take the new θ_local
        save_file(_locals(worker.params), str(args.out / "local0-first.safetensors"))
        worker.stop_island("first")

        loaded = load_latest_checkpoint(args.out / "ckpt")
        assert loaded is not None
        fresh = IslandWorker(cfg, island=island, model=build_model(cfg.model, seed=7),
                             batches=_stream(cfg, tokens, island))
        fresh.load_state_dict(loaded.tensors, loaded.meta)
        _run_rounds(fresh, _SoloAverager(), ROUNDS - RESUME_AFTER, "RESUMED")
        save_file({"theta": fresh.theta_global}, str(args.out / "theta0-resumed.safetensors"))
        fresh.train_inner(1)
        save_file(_locals(fresh.params), str(args.out / "local0-resumed.safetensors"))
        fresh.stop_island("resumed")


# ---------------------------------------------------------------- the tests


def _spawn(rank: int, port: int, optimizer: str, out: Path, parallel: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    return subprocess.Popen(
        [sys.executable, __file__, "--rank", str(rank), "--port", str(port), "--optimizer", optimizer,
         "--out", str(out), "--parallel", parallel],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _run_island(optimizer: str, out: Path, parallel: str) -> list[list[str]]:
    """Start both ranks (rank 1 dials the port rank 0 printed), return each rank's stdout lines."""
    rank0 = _spawn(0, 0, optimizer, out, parallel)
    procs = [rank0]
    try:
        assert rank0.stdout is not None
        ready, _, _ = select.select([rank0.stdout], [], [], TIMEOUT_S)
        assert ready, f"rank 0 printed no READY line within {TIMEOUT_S}s"
        line = rank0.stdout.readline()
        assert line.startswith("READY port="), (line, rank0.stderr.read() if rank0.poll() is not None else "")
        procs.append(_spawn(1, int(line.split("=")[1]), optimizer, out, parallel))
        outputs = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
            assert proc.returncode == 0, stderr[-3000:]
            outputs.append(stdout.splitlines())
        return outputs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _reference_theta(optimizer: str, *, resume: Path | None = None) -> torch.Tensor:
    """One process, one rank, batch 2B: the data-parallel equivalent of the 2-rank island (from the island's
    checkpoint in `resume`, if given: the rounds after it)."""
    cfg = _config(optimizer, batch_size=8)
    batches = ShardedBatches(load_corpus(cfg.data).train, worker_index=0, num_workers=1, batch_size=8,
                             seq_len=cfg.data.seq_len, seed=cfg.train.seed)
    worker = DilocoWorker(cfg, model=build_model(cfg.model, seed=0), batches=batches, device=torch.device("cpu"))
    rounds = ROUNDS
    if resume is not None:
        loaded = load_latest_checkpoint(resume)
        assert loaded is not None
        worker.load_state_dict(loaded.tensors, loaded.meta)
        rounds -= RESUME_AFTER
    averager = _SoloAverager()
    done = 0
    while done < rounds:
        done += worker.run_round(averager).committed
    return worker.theta_global.clone()


def _lines(lines: list[str], tag: str) -> list[str]:
    return [line for line in lines if line.startswith(tag + " ")]


# Measured max |Δθ| against one process: 1.5e-8 (sgd, ddp), 2.4e-7 (adamw, ddp), see the FSDP row's print.
@pytest.mark.parametrize(("optimizer", "parallel", "atol"), [("sgd", "ddp", 1e-7), ("adamw", "ddp", 5e-6),
                                                             ("adamw", "fsdp", 5e-6)])
def test_two_rank_island(tmp_path: Path, optimizer: str, parallel: str, atol: float) -> None:
    rank0, rank1 = _run_island(optimizer, tmp_path, parallel)

    # Rank 0 went through the rounds (incl. the aborted attempt), the only one to talk to the stand-in swarm.
    rounds0 = _lines(rank0, "ROUND")
    assert [line.split()[1:3] for line in rounds0] == [["0", "1"], ["1", "0"], ["1", "1"], ["2", "1"], ["3", "1"]]
    assert _lines(rank0, "CALLS") == ["CALLS 0,1,1,2,3"]
    assert not _lines(rank1, "ROUND") and not _lines(rank1, "CALLS")
    # After every outer step, resync and resume, rank 1 took rank 0's θ_local: their steps stay bit-identical
    # (with FSDP, rank 1's shard of every parameter is its chunk of rank 0's whole θ_local).
    for tag in ("first", "resumed"):
        local0 = load_file(str(tmp_path / f"local0-{tag}.safetensors"))
        local1 = load_file(str(tmp_path / f"local1-{tag}.safetensors"))
        assert local0.keys() == local1.keys()
        for k, whole in local0.items():
            mine = whole if parallel == "ddp" else torch.chunk(whole, 2, dim=0)[1] if whole.shape[0] > 1 else whole[0:0]
            assert torch.equal(mine, local1[k]), (tag, k)
    # A fresh island resumed from rank 0's checkpoint replays the rest bit for bit.
    resumed = [line.replace("RESUMED", "ROUND") for line in _lines(rank0, "RESUMED")]
    assert resumed == rounds0[-(ROUNDS - RESUME_AFTER):]

    theta0 = load_file(str(tmp_path / "theta0.safetensors"))["theta"]
    reference = _reference_theta(optimizer)
    initial = flatten(build_model(_config(optimizer, batch_size=8).model, seed=0).parameters())
    assert (reference - initial).abs().max().item() > 1000 * atol  # training moved θ far beyond the tolerance
    max_diff = (theta0 - reference).abs().max().item()
    print(f"{optimizer}, {parallel}: 2-rank island vs 1-rank 2x batch, max |Δθ_global| = {max_diff:.3g}")
    assert max_diff <= atol, f"2-rank island vs 1-rank 2x batch: max |Δθ| = {max_diff:.3g} > {atol}"
    # Its checkpoint resumes on one process as well as on 2 ranks (the inner optimizer's state is whole in it).
    on_one = _reference_theta(optimizer, resume=tmp_path / "ckpt")
    on_two = load_file(str(tmp_path / "theta0-resumed.safetensors"))["theta"]
    resumed_diff = (on_one - on_two).abs().max().item()
    print(f"{optimizer}, {parallel}: resumed on 1 process vs on 2 ranks, max |Δθ_global| = {resumed_diff:.3g}")
    assert resumed_diff <= atol


def test_roles_and_the_environment_are_checked_without_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config("sgd", batch_size=4)
    follower = Island(rank=1, world_size=2, backend="gloo", device=torch.device("cpu"))
    leader = Island(rank=0, world_size=2, backend="gloo", device=torch.device("cpu"))
    batches = _stream(cfg, torch.arange(100_000) % 100, follower)
    with pytest.raises(IslandError, match="only rank 0 leads"):
        IslandWorker(cfg, island=follower, model=build_model(cfg.model, seed=0), batches=batches)
    with pytest.raises(IslandError, match="does not follow"):
        IslandFollower(cfg, island=leader, model=build_model(cfg.model, seed=0), batches=batches)
    with pytest.raises(IslandError, match="does not split over 3 ranks"):
        RankSlice(batches.stream, rank=0, world_size=3)
    with pytest.raises(IslandError, match="island rank 2"):
        Island.start(rank=2, world_size=2)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert island_env() is None
    with pytest.raises(IslandError, match="WORLD_SIZE is not set above 1"):
        Island.from_env()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(IslandError, match="RANK=2 is not in"):
        island_env()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(IslandError, match="MASTER_ADDR"):
        Island.from_env()
    with pytest.raises(IslandLost, match="an inner step failed"), leader.collective("an inner step"):
        raise RuntimeError("Connection closed by peer")


if __name__ == "__main__":
    _child(sys.argv[1:])

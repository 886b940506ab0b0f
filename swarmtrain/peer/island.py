"""A peer that is a whole machine (or a datacenter's nodes): `swarmtrain peer --nproc-per-node N` starts N
ranks of one island itself; under `torchrun … -m swarmtrain peer …` each process is one rank already.

Rank 0 runs the peer (its worker is an `IslandWorker`, diloco/island_steps.py); every other rank runs
`run_follower`: it waits for rank 0's setup (the run's config, the peer's id), builds the same model and its
slice of the data, and follows rank 0's inner steps until rank 0 stops it. The launcher forwards SIGTERM and
SIGINT to rank 0 only (it leaves gracefully and stops the others), and when any rank exits it gives the rest
a bounded time and kills what is left: the island leaves, or fails, as a whole.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from swarmtrain.config import RunConfig
from swarmtrain.data import load_corpus
from swarmtrain.diloco import resolve_device
from swarmtrain.diloco.island import Island, IslandError, island_env
from swarmtrain.diloco.island_steps import IslandFollower, RankSlice
from swarmtrain.models import build_model
from swarmtrain.peer.data import peer_batches

__all__ = ["ISLAND_TIMEOUT_S", "island_batches", "join_island", "launch_island", "run_follower", "setup_of"]

log = logging.getLogger(__name__)

ISLAND_TIMEOUT_S = 300.0  # a collective (the setup included) that gets no answer for this long fails
FOLLOWERS_GRACE_S = 30.0  # rank 0 exited: the others get this long to exit before they are killed
LEADER_GRACE_S = 180.0  # another rank exited: rank 0 gets this long to leave (its leave is bounded) first


def join_island(local: RunConfig) -> Island | None:
    """This process's island (its process group joined), or None when it runs alone. The backend is NCCL
    when the peer trains on CUDA, else gloo."""
    if island_env() is None:
        return None
    device = resolve_device(local.train.device)
    return Island.from_env(backend="nccl" if device.type == "cuda" else "gloo", timeout_s=ISLAND_TIMEOUT_S)


def setup_of(cfg: RunConfig, peer_id: str) -> dict[str, Any]:
    """What rank 0 tells the other ranks before they build anything: the run's config and the peer's id (its
    data stream's seed)."""
    return {"cfg": cfg, "peer_id": peer_id}


def island_batches(cfg: RunConfig, train: torch.Tensor, peer_id: str, island: Island) -> RankSlice:
    """This rank's slice of the peer's stream, whose batch is the island's (`data.batch_size` per rank)."""
    whole = cfg.replace(data={"batch_size": cfg.data.batch_size * island.world_size})
    return RankSlice(peer_batches(whole, train, peer_id), rank=island.rank, world_size=island.world_size)


def run_follower(island: Island) -> int:
    """A rank > 0: set up as rank 0 says, then follow its inner steps until it stops the island."""
    # Rank 0 leads the leave: a signal meant for the whole job (a terminal's Ctrl-C, torchrun's SIGTERM) must
    # not take a follower out from under an inner step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    command = island.broadcast_object(None)
    if command[0] != "setup":
        log.info("island rank %d: rank 0 stopped before the setup (%s)", island.rank, command[1:])
        return 0
    cfg: RunConfig = command[1]["cfg"]
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    batches = island_batches(cfg, load_corpus(cfg.data).train, command[1]["peer_id"], island)
    model = build_model(cfg.model, seed=cfg.train.seed, activation_checkpointing=cfg.train.activation_checkpointing)
    reason = IslandFollower(cfg, island=island, model=model, batches=batches).run()
    log.info("island rank %d: done (%s)", island.rank, reason)
    return 0


# ---------------------------------------------------------------------------------------------- the launcher

def launch_island(argv: Sequence[str], *, nproc: int) -> int:
    """Run `swarmtrain <argv>` as `nproc` ranks of one island on this machine; rank 0's exit status."""
    if nproc < 1:
        raise IslandError(f"--nproc-per-node must be >= 1, got {nproc}")
    if island_env() is not None:
        raise IslandError("--nproc-per-node inside an island (torchrun set WORLD_SIZE): use one or the other")
    base = {**os.environ, "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port())}
    procs: list[subprocess.Popen[bytes]] = []
    for rank in range(nproc):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        # Ranks > 0 print nothing a reader of the peer's JSON lines wants: their stdout goes to stderr.
        procs.append(subprocess.Popen([sys.executable, "-m", "swarmtrain", *argv], env=env,
                                      stdout=None if rank == 0 else sys.stderr, start_new_session=True))

    def forward(signum: int, _frame: object) -> None:
        if procs[0].poll() is None:
            procs[0].send_signal(signum)  # rank 0 leaves gracefully and stops the others (a second: at once)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _supervise(procs)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _supervise(procs: list[subprocess.Popen[bytes]]) -> int:
    """Until rank 0 exits (the others then get FOLLOWERS_GRACE_S), or another rank does (rank 0 then gets
    LEADER_GRACE_S to leave); what is left after that is killed."""
    leader = procs[0]
    while leader.poll() is None:
        failed = [(i, p.returncode) for i, p in enumerate(procs[1:], 1) if p.poll() is not None]
        if failed:
            rank, code = failed[0]
            log.warning("island rank %d exited with status %s; rank 0 leaves (at most %.0fs)", rank, code,
                        LEADER_GRACE_S)
            _wait(leader, LEADER_GRACE_S)
            break
        time.sleep(0.2)
    for p in procs[1:]:
        _wait(p, FOLLOWERS_GRACE_S)
    code = leader.returncode if leader.returncode is not None else 1
    others = [p.returncode for p in procs[1:]]
    if code == 0 and any(c != 0 for c in others):
        return 1  # rank 0 left cleanly, but the island did not end cleanly
    return code


def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

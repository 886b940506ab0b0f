"""A coordinator and two peers, each an island of 2 gloo ranks started by `swarmtrain peer --nproc-per-node 2`,
one with `train.parallel=ddp`, one with `fsdp`: the islands commit rounds together with one θ_global hash per
round; then one rank of an island is SIGKILLed and that island leaves as a whole (rank 0 notices at its next
collective, at most a ping interval later, leaves as a peer does on an error, and the launcher exits), while the
other peer goes on committing.
"""

from __future__ import annotations

import signal
import socket
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest

from swarmtrain.daemon.cli import LOG_LEVEL_ENV
from swarmtrain.process.children import Child
from swarmtrain.telemetry.events import LeaveEvent
from swarmtrain.testing.procs import ProcessSet, round_events, wait_round

pytestmark = [pytest.mark.system, pytest.mark.timeout(420)]

RUN = [
    "model.preset=tiny", "model.n_layer=1", "data.max_corpus_bytes=300000", "data.seq_len=32", "data.batch_size=2",
    "inner.warmup_steps=1", "diloco.inner_steps=4", "diloco.rounds=1000", "diloco.eval_every_rounds=0",
    "averaging.min_peers=1", "averaging.matchmaking_timeout_s=3.0", "discovery.heartbeat_s=0.5",
    "discovery.record_ttl_s=6.0", "rpc.call_timeout_s=3.0", "train.threads=1", "train.device=cpu",
]
START_S, ROUND_S = 150.0, 120.0
LEAVE_S = 120.0  # a rank gone: its island's launcher exits within this (a ping interval, then a bounded leave)


def _ranks(launcher_pid: int) -> dict[int, psutil.Process]:
    """The island's ranks (the launcher's children), by RANK."""
    out = {}
    for child in psutil.Process(launcher_pid).children():
        rank = child.environ().get("RANK")
        if rank is not None:
            out[int(rank)] = child
    return out


def test_two_islands_commit_together_and_one_that_loses_a_rank_leaves_as_a_whole(procs: ProcessSet) -> None:
    _, join = procs.coordinator(RUN, timeout_s=START_S)
    a = procs.peer("a", join, "--nproc-per-node", "2")
    b = procs.peer("b", join, "--nproc-per-node", "2", "--set", "train.parallel=fsdp")
    for p in (a, b):
        p.wait_ready(timeout_s=START_S)
    # Both islands in one committed round (the run's min_peers is 1: a lone island may commit alone first).
    wait_round(a, lambda e: e.committed and len(e.members) == 2, timeout_s=ROUND_S * 2, what="a round of both")
    assert sorted(_ranks(a.proc.pid)) == [0, 1] and sorted(_ranks(b.proc.pid)) == [0, 1]

    ranks = _ranks(a.proc.pid)
    killed = ranks[1]
    killed.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    _, leave = a.wait_for(lambda x: isinstance(x, LeaveEvent), timeout_s=LEAVE_S, what="island a's leave")
    assert isinstance(leave, LeaveEvent) and leave.reason.startswith("error") and "island" in leave.reason, leave
    a.proc.wait(timeout=max(1.0, LEAVE_S - (time.monotonic() - t0)))
    assert a.proc.returncode != 0
    left_s = time.monotonic() - t0
    print(f"island a left {left_s:.1f}s after its rank 1 was killed: {leave.reason[:160]}")
    assert left_s < LEAVE_S, left_s
    assert not any(_running(r) for r in ranks.values())  # the launcher left no rank behind

    after = len(b.snapshot())
    for _ in range(2):  # b goes on alone: two more commits after a left
        after, _ = wait_round(b, lambda e: e.committed, timeout_s=ROUND_S, start=after, what="b commits on")
        after += 1
    hashes: dict[int, set[str]] = defaultdict(set)
    for p in (a, b):
        for e in round_events(p):
            if e.committed:
                hashes[e.round].add(e.hash)
    assert all(len(h) == 1 for h in hashes.values()), dict(hashes)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_an_island_runs_time_paced_overlapped_rounds_in_fragments(procs: ProcessSet, parallel: str) -> None:
    """What a single-process peer runs, an island runs: rank 0 decides when a time-paced round's steps end and
    lands the overlapped mean of a fragment between two steps; the other rank follows and takes θ_local. With
    FSDP rank 0 gathers θ_local whole before the landing reads it (and at the end of the steps), not per step."""
    run = [*RUN, "model.n_layer=2", "diloco.pace=time", "diloco.overlap=true", "diloco.fragments=2", "diloco.rounds=4"]
    _, join = procs.coordinator(run, timeout_s=START_S)
    a = procs.peer("a", join, "--nproc-per-node", "2", "--set", f"train.parallel={parallel}")
    a.wait_ready(timeout_s=START_S)
    _, leave = a.wait_for(lambda x: isinstance(x, LeaveEvent), timeout_s=ROUND_S * 2, what="a's rounds done")
    assert isinstance(leave, LeaveEvent) and leave.reason == "done", a.diagnostics()
    a.proc.wait(timeout=60)
    assert a.proc.returncode == 0, a.diagnostics()
    assert [e.round for e in round_events(a) if e.committed] == [0, 1, 2, 3]


def test_an_island_stopped_by_a_signal_leaves_gracefully_and_resumes_from_its_checkpoint(
        procs: ProcessSet, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM to the launcher reaches rank 0 only: it leaves at the round's end (checkpoint, leave line, exit 0)
    and stops the other rank; restarted with the same directory, the island resumes at the round it left."""
    _, join = procs.coordinator(RUN, timeout_s=START_S)
    a = procs.peer("a", join, "--nproc-per-node", "2", checkpoint_dir=tmp_path / "a")
    a.wait_ready(timeout_s=START_S)
    wait_round(a, lambda e: e.committed and e.round >= 1, timeout_s=ROUND_S, what="two rounds")
    ranks = _ranks(a.proc.pid)
    a.proc.send_signal(signal.SIGTERM)
    _, leave = a.wait_for(lambda x: isinstance(x, LeaveEvent), timeout_s=LEAVE_S, what="a's leave")
    assert isinstance(leave, LeaveEvent) and leave.reason == "signal" and leave.checkpoint, leave
    a.proc.wait(timeout=60)
    assert a.proc.returncode == 0, a.diagnostics()
    assert not any(_running(r) for r in ranks.values())
    again = procs.peer("a", join, "--nproc-per-node", "2", checkpoint_dir=tmp_path / "a")
    info = again.wait_ready(timeout_s=START_S)
    assert (info["round"], info["hash"]) == (leave.round, leave.hash), (info, leave)
    wait_round(again, lambda e: e.committed and e.round == leave.round, timeout_s=ROUND_S, what="the next round")


def test_an_island_under_torchrun_trains_and_leaves_on_torchruns_sigterm(procs: ProcessSet, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`torchrun --nproc-per-node 2 -m swarmtrain peer …`: each of torchrun's processes is one rank (its RANK,
    WORLD_SIZE, MASTER_ADDR/PORT). torchrun's SIGTERM reaches every rank: rank 0 leaves gracefully and the
    other waits to be stopped by it (torchrun itself then exits non-zero, as it does whenever signalled)."""
    _, join = procs.coordinator(RUN, timeout_s=START_S)
    torchrun = Path(sys.executable).with_name("torchrun")
    argv = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(_free_port()), "-m", "swarmtrain",
            "peer", "--join", join]
    a = Child("a", argv, log_path=tmp_path / "logs" / "a.log", env={LOG_LEVEL_ENV: "INFO"})
    procs.children.append(a)
    a.wait_ready(timeout_s=START_S)
    wait_round(a, lambda e: e.committed and e.round >= 1, timeout_s=ROUND_S, what="two rounds")
    a.proc.send_signal(signal.SIGTERM)
    _, leave = a.wait_for(lambda x: isinstance(x, LeaveEvent), timeout_s=LEAVE_S, what="a's leave")
    assert isinstance(leave, LeaveEvent) and leave.reason == "signal", leave
    a.proc.wait(timeout=60)
    assert "island rank 1: rank 0 stopped the island (signal)" in (tmp_path / "logs" / "a.log").read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

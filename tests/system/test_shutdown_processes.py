"""`swarmtrain coordinator` and `swarmtrain peer` leave within their stated bounds when their DHT hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from swarmtrain.daemon.cmd_coordinator import SHUTDOWN_MARGIN_S
from swarmtrain.process.children import Child, swarmtrain_argv
from swarmtrain.proctree import descendants, running
from swarmtrain.testing.procs import ProcessSet
from swarmtrain.testing.wait import wait_until

pytestmark = pytest.mark.system

SHUTDOWN_TIMEOUT_S = 1.0
SETS = [f"discovery.shutdown_timeout_s={SHUTDOWN_TIMEOUT_S}", "discovery.heartbeat_s=0.3",
        "discovery.record_ttl_s=5"]
BOUND_S = SHUTDOWN_TIMEOUT_S + SHUTDOWN_MARGIN_S  # what `swarmtrain coordinator --help` promises



def _hang_children(child: Child) -> list[int]:
    """SIGSTOP every process below `child` (its DHT process, p2pd): sockets open, nothing answers."""
    pids = descendants(child.proc.pid)
    assert len(pids) >= 2, f"expected a DHT process and its p2pd below {child.name}, found {pids}"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def _assert_gone(pids: list[int]) -> None:
    wait_until(lambda: not any(running(p) for p in pids), timeout_s=5, what=f"processes {pids} gone")


def test_sigterm_stops_a_coordinator_whose_dht_hangs_within_the_bound(procs: ProcessSet) -> None:
    coord, _ = procs.coordinator(SETS, timeout_s=90.0)
    pids = _hang_children(coord)
    t0 = time.monotonic()
    coord.proc.send_signal(signal.SIGTERM)
    assert coord.proc.wait(timeout=BOUND_S + 10) == 0
    elapsed = time.monotonic() - t0
    assert SHUTDOWN_TIMEOUT_S <= elapsed < BOUND_S, f"left {elapsed:.1f}s after SIGTERM, bound {BOUND_S:.0f}s"
    _assert_gone(pids)
    log = coord.log_path.read_text()
    assert "forced SIGTERM, SIGKILL, SIGKILL to p2pd" in log and "Traceback" not in log


def test_a_second_sigterm_exits_the_coordinator_at_once(procs: ProcessSet) -> None:
    coord, _ = procs.coordinator([*SETS[1:], "discovery.shutdown_timeout_s=60"], timeout_s=90.0)
    pids = _hang_children(coord)
    _second_sigterm_exits_at_once(coord, first_line="SIGTERM: stopping the coordinator")
    _assert_gone(pids)
    assert "SIGTERM again: exiting now" in coord.log_path.read_text()


def test_a_second_sigterm_exits_a_peer_at_once_and_kills_its_dht(procs: ProcessSet, tmp_path: Path) -> None:
    run = ["model.preset=tiny", "data.seq_len=32", "data.batch_size=2", "data.max_corpus_bytes=200000",
           "diloco.inner_steps=1000000", "train.threads=1"]
    _, join = procs.coordinator([*run, *SETS], timeout_s=90.0)
    peer = procs.peer("peer", join, "--set", "discovery.shutdown_timeout_s=60")
    peer.wait_ready(timeout_s=90.0)
    pids = _hang_children(peer)
    _second_sigterm_exits_at_once(peer, first_line="SIGTERM: leaving gracefully")
    _assert_gone(pids)


def _second_sigterm_exits_at_once(child: Child, *, first_line: str) -> None:
    """SIGTERM, wait until `child` logged `first_line`, SIGTERM again: it must exit 128+15 within 2 s."""
    child.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: first_line in child.log_path.read_text(), timeout_s=10, what="the first SIGTERM handled")
    t0 = time.monotonic()
    child.proc.send_signal(signal.SIGTERM)
    assert child.proc.wait(timeout=10) == 128 + signal.SIGTERM
    assert time.monotonic() - t0 < 2.0


def test_a_peer_whose_stdout_reader_went_away_still_leaves_on_sigterm(procs: ProcessSet, tmp_path: Path) -> None:
    """A closed log pipe (`| head`, a supervisor that died): the peer's next line gets EPIPE. It used to hang
    for good on SIGTERM, in multiprocessing's exit handler joining its DHT child; it must leave in its bound."""
    run = ["model.preset=tiny", "data.seq_len=32", "data.batch_size=2", "data.max_corpus_bytes=200000",
           "diloco.inner_steps=2", "train.threads=1"]
    _, join = procs.coordinator([*run, *SETS], timeout_s=90.0)
    log_path = tmp_path / "peer.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(swarmtrain_argv("peer", "--join", join, "--checkpoint-dir", str(tmp_path / "ckpt")),
                                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 90
        while not proc.stdout.readline().startswith(b"READY"):
            assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()
        children = descendants(proc.pid)
        proc.stdout.close()  # the reader goes away: the peer's next line (its leave line) hits a closed pipe
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=SHUTDOWN_TIMEOUT_S + SHUTDOWN_MARGIN_S + 30) == 0, log_path.read_text()[-3000:]
        _assert_gone(children)
        assert "Traceback" not in log_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

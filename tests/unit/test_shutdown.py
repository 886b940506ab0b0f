"""Every way out is bounded: a second signal or an overrun deadline exits at once and kills the children."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarmtrain.process.children import Child
from swarmtrain.process.signals import OVERRUN_STATUS
from swarmtrain.proctree import ProcessRef, descendants, open_tree, running
from swarmtrain.telemetry.events import ReadyLine
from swarmtrain.testing.wait import wait_until

pytestmark = pytest.mark.unit

# A daemon in miniature: StopSignals installed, then a forked child (as the DHT process is), READY, and on
# the first signal a second READY line; with "hang", a shutdown step that never returns and holds the loop,
# else an orderly stop of the child.
DAEMON = """
import asyncio, json, os, signal, sys, threading
from swarmtrain.process.signals import StopSignals

async def main() -> None:
    stop = asyncio.Event()
    deadline_s = None if sys.argv[1] == "none" else float(sys.argv[1])
    StopSignals(leaving="test leave", deadline_s=deadline_s).install(stop)
    child = os.fork()
    if child == 0:
        threading.Event().wait(120)
        os._exit(0)
    print("READY " + json.dumps({"child": child}), flush=True)
    await stop.wait()
    print("READY " + json.dumps({"stopping": True}), flush=True)
    if sys.argv[2] == "stuck":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    if sys.argv[2] in ("hang", "stuck"):
        threading.Event().wait(120)
    os.kill(child, 9)  # the daemon's own orderly stop of its child
    os.waitpid(child, 0)

asyncio.run(main())
"""



def _start(tmp_path: Path, deadline: str, mode: str) -> tuple[Child, int]:
    child = Child("daemon", [sys.executable, "-c", DAEMON, deadline, mode], log_path=tmp_path / "daemon.log")
    forked = child.wait_ready(timeout_s=30)["child"]
    assert isinstance(forked, int) and running(forked)
    return child, forked


def _signal_and_wait_stopping(child: Child) -> None:
    child.proc.send_signal(signal.SIGTERM)
    child.wait_for(lambda x: isinstance(x, ReadyLine) and bool(x.info.get("stopping")), start=1, timeout_s=10,
                   what="the first signal handled")


@pytest.mark.parametrize("mode", ["hang", "stuck"])
def test_second_signal_exits_at_once_and_kills_the_children(tmp_path: Path, mode: str) -> None:
    child, forked = _start(tmp_path, "none", mode)
    try:
        _signal_and_wait_stopping(child)
        t0 = time.monotonic()
        child.proc.send_signal(signal.SIGTERM)
        assert child.proc.wait(timeout=10) == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 2.0
        wait_until(lambda: not running(forked), timeout_s=5, what="the forked child killed")
        log = child.log_path.read_text()
        assert "SIGTERM: test leave" in log and "SIGTERM again: exiting now" in log
    finally:
        child.kill()


def test_shutdown_past_its_deadline_is_cut_short(tmp_path: Path) -> None:
    child, forked = _start(tmp_path, "0.5", "hang")
    try:
        t0 = time.monotonic()
        _signal_and_wait_stopping(child)
        assert child.proc.wait(timeout=10) == OVERRUN_STATUS
        assert 0.5 <= time.monotonic() - t0 < 3.0
        wait_until(lambda: not running(forked), timeout_s=5, what="the forked child killed")
        assert "shutdown did not finish within 0.5s of SIGTERM" in child.log_path.read_text()
    finally:
        child.kill()


def test_a_finished_shutdown_exits_before_its_deadline(tmp_path: Path) -> None:
    child, forked = _start(tmp_path, "30", "finish")
    try:
        _signal_and_wait_stopping(child)
        assert child.proc.wait(timeout=10) == 0
        assert not running(forked)
        assert "exiting now" not in child.log_path.read_text()
    finally:
        child.kill()


def test_open_tree_pins_a_grandchild_and_waits_with_a_deadline() -> None:
    code = ("import subprocess, sys, time; subprocess.Popen(['sleep', '120']); print('up', flush=True); "
            "time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    tree: list[ProcessRef] = []
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        grandchild = descendants(proc.pid)
        assert len(grandchild) == 1
        tree += open_tree(proc.pid)
        assert [r.pid for r in tree] == [proc.pid, *grandchild]

        async def main() -> None:
            assert not await tree[1].wait(0.05)
            for ref in tree:
                ref.send(signal.SIGKILL)
            for ref in tree:
                assert await ref.wait(5.0)

        asyncio.run(main())
        assert all(r.exited() for r in tree)
        assert proc.wait(timeout=5) == -signal.SIGKILL
        tree[1].send(signal.SIGKILL)  # a signal to an exited process is a no-op, never an error
    finally:
        for ref in tree:
            ref.send(signal.SIGKILL)
            ref.close()
        proc.kill()
        proc.wait(timeout=5)
        assert proc.stdout is not None
        proc.stdout.close()


def test_open_tree_of_a_gone_process_is_empty() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=10)
    assert open_tree(proc.pid) == []
    with pytest.raises(ProcessLookupError):
        ProcessRef(proc.pid)

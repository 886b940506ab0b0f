"""Child processes leave nothing behind: the whole process group is gone when kill/terminate return."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from swarmtrain.process.children import Child, group_alive

pytestmark = pytest.mark.unit

# The leader forks a grandchild that outlives its parent (an orphan in the same process group, like a
# peer's DHT process and p2pd), prints a line, then stays until signalled.
ORPHANING = ("import os, subprocess, sys, time; "
             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
             "print('READY {}', flush=True); time.sleep(120)")
IGNORES_TERM = ("import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)']); "
                "print('READY {}', flush=True); time.sleep(120)")


def _child(tmp_path: Path, code: str) -> Child:
    child = Child("c", [sys.executable, "-c", code], log_path=tmp_path / "c.log")
    child.wait_ready(timeout_s=30)
    return child


def test_kill_returns_once_the_whole_group_is_gone(tmp_path: Path) -> None:
    child = _child(tmp_path, ORPHANING)
    assert group_alive(child.pgid)
    child.kill()
    assert not group_alive(child.pgid)


def test_terminate_falls_back_to_sigkill_and_leaves_no_process(tmp_path: Path) -> None:
    child = _child(tmp_path, IGNORES_TERM)
    child.terminate(timeout_s=0.5)
    assert not child.alive and not group_alive(child.pgid)

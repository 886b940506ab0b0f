"""`swarmtrain` child processes for the demo and the tests: spawn, read READY/event lines with deadlines, kill.

Each child runs in its own session (process group), so a signal reaches the whole peer: its
hivemind DHT process and that process's `p2pd` too, like a machine that crashes or hangs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from swarmtrain.telemetry.events import EventError, Line, ReadyLine, parse_line

__all__ = ["Child", "ChildExitedError", "group_alive", "swarmtrain_argv"]

log = logging.getLogger(__name__)
RAW_TAIL_LINES = 200
GROUP_EXIT_S = 10.0  # how long a SIGKILLed process group may take to disappear


class ChildExitedError(RuntimeError):
    """A child exited while someone was waiting for a line from it."""


def swarmtrain_argv(*args: str) -> list[str]:
    """The argv that runs `swarmtrain ARGS` with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "swarmtrain", *args]


class Child:
    """One `swarmtrain` subprocess: stdout parsed into `lines` on a reader thread, stderr to `log_path`."""

    def __init__(self, name: str, argv: Sequence[str], *, log_path: Path, env: dict[str, str] | None = None,
                 on_line: Callable[[str, Line], None] | None = None) -> None:
        self.name = name
        self._on_line = on_line  # called on the reader thread with (name, line) for each parsed line
        self.argv = list(argv)
        self.log_path = log_path
        self.lines: list[Line] = []  # every parsed READY/event line, in order
        self.raw_tail: list[str] = []  # the last RAW_TAIL_LINES unparsed stdout lines
        self._cond = threading.Condition()
        self._eof = False
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file: IO[bytes] = log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=self._log_file, stdin=subprocess.DEVNULL,
            env=child_env, start_new_session=True, text=True, bufsize=1,
        )
        self.pgid = self.proc.pid  # start_new_session: the child leads its own process group
        self._reader = threading.Thread(target=self._read, name=f"stdout-{name}", daemon=True)
        self._reader.start()
        log.info("started %s (pid %d): %s", name, self.proc.pid, " ".join(self.argv))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                parsed = parse_line(raw)
            except EventError as e:
                log.warning("%s: %s", self.name, e)
                parsed = None
            with self._cond:
                if parsed is None:
                    self.raw_tail = [*self.raw_tail[-(RAW_TAIL_LINES - 1):], raw.rstrip("\n")]
                else:
                    self.lines.append(parsed)
                self._cond.notify_all()
            if parsed is not None and self._on_line is not None:
                self._on_line(self.name, parsed)
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ waiting

    def wait_for(self, predicate: Callable[[Line], bool], *, timeout_s: float, start: int = 0,
                 what: str = "a matching line") -> tuple[int, Line]:
        """The first line at index >= `start` that satisfies `predicate`, with its index.

        Raises TimeoutError after `timeout_s`, ChildExitedError if stdout closes first.
        """
        deadline = time.monotonic() + timeout_s
        i = start
        with self._cond:
            while True:
                while i < len(self.lines):
                    if predicate(self.lines[i]):
                        return i, self.lines[i]
                    i += 1
                if self._eof:
                    raise ChildExitedError(f"{self.name} exited (rc={self.proc.poll()}) before {what}; "
                                           f"{self.diagnostics()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name}: {what} not seen within {timeout_s:.1f}s; {self.diagnostics()}")
                self._cond.wait(left)

    def wait_eof(self, *, timeout_s: float) -> None:
        """Until the child's stdout has closed and every line of it is read (TimeoutError after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._eof:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name}: stdout still open after {timeout_s:.1f}s")
                self._cond.wait(left)

    def wait_ready(self, *, timeout_s: float) -> dict[str, object]:
        """The JSON payload of the child's READY line."""
        _, line = self.wait_for(lambda x: isinstance(x, ReadyLine), timeout_s=timeout_s, what="READY")
        assert isinstance(line, ReadyLine)
        return line.info

    def snapshot(self) -> list[Line]:
        with self._cond:
            return list(self.lines)

    def diagnostics(self, *, tail_lines: int = 25) -> str:
        """The tail of stderr (the child's log) and of unparsed stdout, for failure messages."""
        try:
            err = self.log_path.read_text(errors="replace").splitlines()[-tail_lines:]
        except OSError:
            err = []
        out = self.raw_tail[-5:]
        return f"stdout tail: {out}; stderr tail ({self.log_path}):\n" + "\n".join(err)

    # ------------------------------------------------------------------ lifecycle

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal_group(self, sig: signal.Signals) -> None:
        """Send `sig` to the child's whole process group (its DHT and p2pd included)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, sig)

    def terminate(self, *, timeout_s: float) -> int:
        """SIGTERM (graceful leave) and wait; SIGKILL the group if it outlives `timeout_s`."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not exit within %.1fs of SIGTERM; killing it", self.name, timeout_s)
            self.kill()
            return self.proc.wait()
        self._reap_group()
        return rc

    def kill(self) -> None:
        """SIGKILL the whole process group, reap the child and wait for the rest of the group to go
        (a crash, or cleanup)."""
        self.signal_group(signal.SIGCONT)  # a stopped group must run to die cleanly under wait()
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=GROUP_EXIT_S)
        self._wait_group_gone()
        self.close()

    def _reap_group(self) -> None:
        # The group outlives its leader when the DHT process or p2pd lingers: never leave them behind.
        if group_alive(self.pgid):
            self.signal_group(signal.SIGKILL)
            self._wait_group_gone()
        self.close()

    def _wait_group_gone(self, timeout_s: float = GROUP_EXIT_S) -> None:
        """SIGKILL is delivered asynchronously, and the group's other members (the DHT process, p2pd)
        are orphans reaped by init, not by us: the group exists for a moment after the leader's wait()
        returns. Wait (bounded) until it is gone, so "stopped" means no process is left."""
        deadline = time.monotonic() + timeout_s
        while group_alive(self.pgid):
            if time.monotonic() >= deadline:
                log.warning("%s: process group %d still exists %.1fs after SIGKILL", self.name, self.pgid, timeout_s)
                return
            time.sleep(0.02)

    def close(self) -> None:
        self._reader.join(timeout=5.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log_file.close()


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still exists (zombies of other parents included)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_coordinator(overrides: Sequence[str], config_args: Sequence[str], *, log_dir: Path, timeout_s: float,
                      children: list[Child], dashboard: bool = False) -> tuple[str, str]:
    """Start `swarmtrain coordinator` with `--set` overrides (appended to `children` at once, so the caller
    stops it whatever happens next); returns the first multiaddr of its READY line, which peers join, and
    with `dashboard` the URL of its dashboard on 127.0.0.1 (history in `log_dir`), else ""."""
    sets = [x for o in overrides for x in ("--set", o)]
    extra = ["--dashboard-port", "0", "--set", f"dashboard.db={json.dumps(str(log_dir / 'dashboard.sqlite'))}"] \
        if dashboard else []
    coord = Child("coordinator", swarmtrain_argv("coordinator", *config_args, *sets, *extra),
                  log_path=log_dir / "coordinator.log")
    children.append(coord)
    info = coord.wait_ready(timeout_s=timeout_s)
    maddrs = info.get("maddrs")
    if not isinstance(maddrs, list) or not maddrs:
        raise ChildExitedError(f"the coordinator's READY line has no 'maddrs' list: {maddrs!r}")
    return str(maddrs[0]), str(info.get("dashboard", ""))


def stop_all(children: Sequence[Child], *, timeout_s: float = 10.0) -> None:
    """Stop `children` newest first: SIGTERM (then SIGKILL after `timeout_s`) the live ones, reap the rest."""
    for child in reversed(children):
        if child.alive:
            child.terminate(timeout_s=timeout_s)
        else:
            child.close()

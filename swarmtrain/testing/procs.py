"""Real `swarmtrain` subprocesses for system tests: spawn, READY with deadlines, SIGKILL/SIGSTOP, cleanup."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from swarmtrain.daemon.cli import LOG_LEVEL_ENV
from swarmtrain.process.children import Child, group_alive, swarmtrain_argv
from swarmtrain.telemetry.events import Line, RoundEvent
from swarmtrain.testing.wait import wait_until

__all__ = ["ProcessSet", "round_events", "sigcont", "sigkill", "sigstop", "wait_round"]

log = logging.getLogger(__name__)

STACK_DUMP_S = 2.0  # how long diagnostics() waits for a live child's stack dump to start


class ProcessSet:
    """Every process a test starts; `close()` kills them all (their process groups included).

    Use as a context manager or through a fixture, so nothing outlives the test even when it fails.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []
        self._starts: dict[str, int] = {}

    def __enter__(self) -> ProcessSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> Child:
        """Start `swarmtrain ARGS`; a restarted name gets a fresh log file (name.1.log, ...)."""
        n = self._starts.get(name, 0)
        self._starts[name] = n + 1
        log_path = self.log_dir / (f"{name}.log" if n == 0 else f"{name}.{n}.log")
        # INFO logs: a failed system test leaves each process's account of what it was doing.
        child = Child(name, swarmtrain_argv(*args), log_path=log_path, env={LOG_LEVEL_ENV: "INFO", **(env or {})})
        self.children.append(child)
        return child

    def coordinator(self, overrides: Sequence[str], *, timeout_s: float = 90.0) -> tuple[Child, str]:
        """Start a coordinator with `--set` overrides; return it and the multiaddr peers join."""
        sets = [x for o in overrides for x in ("--set", o)]
        child = self.spawn("coordinator", "coordinator", *sets)
        info = child.wait_ready(timeout_s=timeout_s)
        maddrs = info.get("maddrs")
        if not isinstance(maddrs, list) or not maddrs:
            raise AssertionError(f"coordinator READY has no maddrs: {info}")
        return child, str(maddrs[0])

    def peer(self, name: str, join: str, *extra: str, checkpoint_dir: Path | None = None) -> Child:
        """Start `swarmtrain peer --join JOIN` (not waiting for READY)."""
        args = ["peer", "--join", join, *extra]
        if checkpoint_dir is not None:
            args += ["--checkpoint-dir", str(checkpoint_dir)]
        return self.spawn(name, *args)

    def close(self, *, grace_s: float = 15.0) -> None:
        """SIGTERM every live child at once (a stopped one is continued first), SIGKILL what outlives `grace_s`."""
        live = [c for c in self.children if c.alive]
        for child in live:
            child.signal_group(signal.SIGCONT)
            child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for child in reversed(self.children):
            child.kill()
        leftovers = [c.name for c in self.children if _group_has_live_process(c.pgid)]
        if leftovers:
            raise AssertionError(f"processes left behind by: {leftovers}")

    def diagnostics(self) -> str:
        """Per child: its events in short form, then its stderr tail.

        A child still running is asked for its threads' stacks first (SIGUSR1, see `swarmtrain.daemon.cli`):
        after a timeout they say what it was waiting on.
        """
        live = [c for c in self.children if c.alive]
        for child in live:
            before = _log_size(child)
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGUSR1)
            with contextlib.suppress(TimeoutError):  # a child too stuck to dump still gets its log tail
                wait_until(lambda c=child, n=before: _log_size(c) > n, timeout_s=STACK_DUMP_S,  # type: ignore[misc]
                           what=f"{child.name}'s stack dump")
        return "\n\n".join(
            f"== {c.name} (rc={c.proc.poll()}) ==\nevents: {_brief(c)}\n"
            f"{c.diagnostics(tail_lines=150 if c in live else 25)}" for c in self.children)


def _log_size(child: Child) -> int:
    try:
        return child.log_path.stat().st_size
    except OSError:
        return 0


def _brief(child: Child) -> str:
    out = []
    for x in child.snapshot():
        if isinstance(x, RoundEvent):
            out.append(f"r{x.round}:{'C' if x.committed else 'A'}{len(x.members)}:{x.hash[:6]}")
        else:
            out.append(type(x).__name__)
    return " ".join(out)


def sigkill(child: Child) -> None:
    """A crash: SIGKILL the peer's whole process group and reap it."""
    child.kill()


def sigstop(child: Child) -> None:
    """A hang: freeze the peer's whole process group (sockets stay open, nothing answers)."""
    child.signal_group(signal.SIGSTOP)


def sigcont(child: Child) -> None:
    child.signal_group(signal.SIGCONT)


def round_events(child: Child, *, start: int = 0) -> list[RoundEvent]:
    return [x for x in child.snapshot()[start:] if isinstance(x, RoundEvent)]


def wait_round(child: Child, predicate: Callable[[RoundEvent], bool], *, timeout_s: float, start: int = 0,
               what: str = "a matching round") -> tuple[int, RoundEvent]:
    """The first round event (from line index `start`) that satisfies `predicate`."""

    def match(line: Line) -> bool:
        return isinstance(line, RoundEvent) and predicate(line)

    i, line = child.wait_for(match, timeout_s=timeout_s, start=start, what=what)
    assert isinstance(line, RoundEvent)
    return i, line


def _group_has_live_process(pgid: int, *, timeout_s: float = 5.0) -> bool:
    """Whether group `pgid` still has a non-zombie process after `timeout_s` of grace."""
    try:
        wait_until(lambda: not group_alive(pgid) or not _live_members(pgid), timeout_s=timeout_s,
                   interval_s=0.05, what=f"process group {pgid} gone")
    except TimeoutError:
        return True
    return False


def _live_members(pgid: int) -> list[int]:
    pids: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # after "(comm)": state, ppid, pgrp, ...
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry.name))
    if pids:
        log.debug("group %d still has %s (this process is %d)", pgid, pids, os.getpid())
    return pids

"""SIGTERM/SIGINT for a daemon: the first asks its event loop to stop, a second kills its children, exits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from types import FrameType

from swarmtrain.proctree import kill_descendants_now

__all__ = ["StopSignals"]

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGTERM, signal.SIGINT)
OVERRUN_STATUS = 1  # the exit status when the shutdown outlives its deadline


class StopSignals:
    """The first SIGTERM/SIGINT sets `stop` (on the event loop); a second one, or a shutdown that outlives
    `deadline_s` after the first, SIGKILLs every process below this one (its DHT, p2pd) and exits at once:
    status 128 + signal for a second signal, OVERRUN_STATUS past the deadline. One log line each.

    The handlers are `signal.signal` ones, not the event loop's: they run whenever the main thread runs
    Python, so a second signal works while the loop is busy or already closed (as when the interpreter
    joins child processes at exit). A process forked after `install` inherits them and ignores both
    signals: its parent stops it.
    """

    def __init__(self, *, leaving: str, deadline_s: float | None = None) -> None:
        self.leaving = leaving  # the first signal's log line, after "SIGTERM: "
        self.deadline_s = deadline_s
        self._owner_pid = os.getpid()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._first: signal.Signals | None = None

    def install(self, stop: asyncio.Event) -> None:
        """Handle SIGTERM and SIGINT for the rest of the process's life; `stop` is set on the running loop
        at the first one. Call it from the main thread."""
        self._stop = stop
        self._loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if os.getpid() != self._owner_pid:
            return  # a forked child (the DHT process): its parent decides when it stops
        sig = signal.Signals(signum)
        if self._first is not None:
            log.error("%s again: exiting now", sig.name)
            _exit_now(128 + sig)
        self._first = sig
        log.warning("%s: %s", sig.name, self.leaving)
        if self.deadline_s is not None:
            threading.Thread(target=self._watchdog, args=(self.deadline_s,), name="shutdown-deadline",
                             daemon=True).start()
        assert self._loop is not None and self._stop is not None
        with contextlib.suppress(RuntimeError):  # the loop is already closed: the process is leaving anyway
            self._loop.call_soon_threadsafe(self._stop.set)

    def _watchdog(self, deadline_s: float) -> None:
        # A daemon thread: it dies with the process when the shutdown finishes first.
        threading.Event().wait(deadline_s)
        log.error("shutdown did not finish within %.1fs of %s: exiting now", deadline_s,
                  self._first.name if self._first else "the signal")
        _exit_now(OVERRUN_STATUS)


def _exit_now(status: int) -> None:
    kill_descendants_now()
    os._exit(status)

"""SIGTERM/SIGINT for a daemon: the first asks its event loop to stop, a second kills its children, exits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
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

    The signals are acted on by a thread of their own, woken through `signal.set_wakeup_fd`, not by a
    Python signal handler: such a handler runs only when the main thread next runs Python, and a signal
    that lands just before the main thread blocks (in a lock, a `select`, a long wait of a shutdown step)
    waits for that block to end. The watcher thread wakes on the byte the interpreter writes at once, in
    whichever thread the signal landed, so a second signal exits while the main thread is stuck, the loop
    busy or already closed. A process forked after `install` ignores both signals (its parent stops it)
    and writes nothing to this process's wakeup socket.
    """

    def __init__(self, *, leaving: str, deadline_s: float | None = None) -> None:
        self.leaving = leaving  # the first signal's log line, after "SIGTERM: "
        self.deadline_s = deadline_s
        self._owner_pid = os.getpid()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._first: signal.Signals | None = None
        self._sockets: tuple[socket.socket, socket.socket] | None = None

    def install(self, stop: asyncio.Event) -> None:
        """Handle SIGTERM and SIGINT for the rest of the process's life; `stop` is set on the running loop
        at the first one. Call it once, from the main thread (`signal.set_wakeup_fd` needs it)."""
        if self._sockets is not None:
            raise RuntimeError("StopSignals.install was called twice")
        self._stop = stop
        self._loop = asyncio.get_running_loop()
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # the interpreter's signal handler must never block on it
        self._sockets = (reader, writer)
        os.register_at_fork(after_in_child=self._after_fork_in_child)
        threading.Thread(target=self._watch, args=(reader,), name="stop-signals", daemon=True).start()
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        for sig in SIGNALS:
            signal.signal(sig, _leave_to_the_watcher)

    def _watch(self, reader: socket.socket) -> None:
        # A daemon thread: it dies with the process. Bytes of other signals with Python handlers are skipped.
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in SIGNALS:
                    self._on_signal(signal.Signals(signum))

    def _on_signal(self, sig: signal.Signals) -> None:
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

    def _after_fork_in_child(self) -> None:
        # The child keeps the no-op Python handlers (it ignores both signals until it execs) but must not
        # report its own signals to its parent's watcher through the inherited socket.
        if os.getpid() == self._owner_pid or self._sockets is None:
            return
        try:
            signal.set_wakeup_fd(-1)  # the forking thread is the child's main thread: this is allowed
        except ValueError:
            log.warning("a forked child could not drop its parent's signal wakeup socket")
            return  # its fd must stay open: closed, the number could be reused by a file signals would write to
        for sock in self._sockets:
            sock.close()
        self._sockets = None


def _leave_to_the_watcher(_signum: int, _frame: FrameType | None) -> None:
    """The Python-level handler: it does nothing, its C side has already woken the watcher thread."""


def _exit_now(status: int) -> None:
    kill_descendants_now()
    os._exit(status)

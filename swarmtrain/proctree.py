"""Process trees on Linux: a process's descendants read from /proc, signalled and awaited through pidfds."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal

__all__ = ["ProcessRef", "descendants", "kill_descendants_now", "open_tree", "running"]


def _parent_of(pid: int) -> int | None:
    """The parent pid of `pid` as /proc shows it now; None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])  # after "(comm)": state, ppid, ...
    except (OSError, ValueError, IndexError):
        return None


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a killed orphan waits a moment for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return not stat[stat.rindex(b")") + 2:].startswith(b"Z")  # after "(comm)": the state


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children before grandchildren), as /proc shows them now."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (parent := _parent_of(int(entry.name))) is not None:
            children.setdefault(parent, []).append(int(entry.name))
    out: list[int] = []
    frontier = [pid]
    while frontier:
        frontier = [c for p in frontier for c in children.get(p, [])]
        out += frontier
    return out


def kill_descendants_now(pid: int | None = None) -> list[int]:
    """SIGKILL every process below `pid` (default: this process) without waiting; the pids signalled."""
    killed = []
    for child in descendants(os.getpid() if pid is None else pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)
            killed.append(child)
    return killed


class ProcessRef:
    """One process pinned by a pidfd: a signal can never reach another process that reused its pid, and
    its exit can be awaited even when it is not our child (a grandchild orphaned by its parent's death)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd = os.pidfd_open(pid)  # ProcessLookupError if it is gone

    def exited(self) -> bool:
        """Whether the process has exited (a zombie counts: it runs no more)."""
        readable, _, _ = select.select([self._fd], [], [], 0)
        return bool(readable)

    def send(self, sig: signal.Signals) -> None:
        """Send `sig`; nothing happens if the process is already gone."""
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._fd, sig)

    async def wait(self, timeout_s: float) -> bool:
        """Whether the process exited within `timeout_s` (the event loop runs meanwhile)."""
        if self.exited():
            return True
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not gone.done():
                gone.set_result(None)

        loop.add_reader(self._fd, readable)
        try:
            await asyncio.wait_for(gone, timeout=max(timeout_s, 0.0))
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(self._fd)
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def open_tree(pid: int) -> list[ProcessRef]:
    """`pid` and every process below it, each pinned by a pidfd ([] if `pid` is gone).

    A pid that left the tree between the /proc scan and its pidfd (it exited and was reused) is left out.
    """
    try:
        refs = [ProcessRef(pid)]
    except ProcessLookupError:
        return []
    below = descendants(pid)
    tree = {pid, *below}
    for p in below:
        try:
            ref = ProcessRef(p)
        except ProcessLookupError:
            continue
        if _parent_of(p) in tree:
            refs.append(ref)
        else:
            ref.close()
    return refs

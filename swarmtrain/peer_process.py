"""`swarmtrain peer` as a process: one Peer on uvloop, SIGTERM/SIGINT leave at the next round boundary."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

from swarmtrain.config import RunConfig
from swarmtrain.peer import Peer
from swarmtrain.telemetry import EventWriter
from swarmtrain.telemetry.console import ConsoleEventWriter, ConsoleProgress

__all__ = ["run_peer_process"]

log = logging.getLogger(__name__)


def run_peer_process(local: RunConfig, *, local_overrides: Sequence[str] = (), coordinator_id: str | None = None,
                     progress: ConsoleProgress | None = None) -> int:
    """`swarmtrain peer`: one peer on uvloop until its rounds are done or it is signalled; 0 on a clean leave.

    With `progress`, the peer's events and inner steps are also rendered there (stdout is unchanged).
    """
    import uvloop

    from swarmtrain.peer_network import NetworkServices

    writer = EventWriter(sys.stdout) if progress is None else ConsoleEventWriter(sys.stdout, progress)
    peer = Peer(local, writer=writer, services=NetworkServices(), local_overrides=local_overrides,
                coordinator_id=coordinator_id, on_step=None if progress is None else progress.on_step)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_main(peer))


async def _main(peer: Peer) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig, stop)
    reason = "error"
    try:
        await peer.start()
        reason = await peer.run(stop)
    except Exception as e:
        reason = f"error: {e}"
        raise
    finally:
        await peer.aclose(reason)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return 0


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    if stop.is_set():
        # A second signal: the operator does not want to wait for the round to finish.
        log.error("%s again: exiting now without a checkpoint", sig.name)
        os._exit(128 + sig)
    log.warning("%s: leaving gracefully at the next round boundary", sig.name)
    stop.set()

"""`swarmtrain peer` as a process: one Peer on uvloop, SIGTERM/SIGINT leave at the next round boundary.

The leave then checkpoints and closes the DHT node within `discovery.shutdown_timeout_s` + 3 s (killed
if it does not answer). A second signal kills this process's children (DHT, p2pd) and exits at once with
128 + the signal number, without a checkpoint.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from swarmtrain.config import RunConfig
from swarmtrain.daemon.signals import StopSignals
from swarmtrain.peer.root import Peer
from swarmtrain.telemetry import EventWriter
from swarmtrain.telemetry.console import ConsoleEventWriter, ConsoleProgress

__all__ = ["run_peer_process"]


def run_peer_process(local: RunConfig, *, local_overrides: Sequence[str] = (), coordinator_id: str | None = None,
                     progress: ConsoleProgress | None = None) -> int:
    """`swarmtrain peer`: one peer on uvloop until its rounds are done or it is signalled; 0 on a clean leave.

    With `progress`, the peer's events and inner steps are also rendered there (stdout is unchanged).
    """
    import uvloop

    from swarmtrain.peer.network import NetworkServices

    writer = EventWriter(sys.stdout) if progress is None else ConsoleEventWriter(sys.stdout, progress)
    peer = Peer(local, writer=writer, services=NetworkServices(), local_overrides=local_overrides,
                coordinator_id=coordinator_id, on_step=None if progress is None else progress.on_step)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_main(peer))


async def _main(peer: Peer) -> int:
    stop = asyncio.Event()
    # Never uninstalled: a second signal must work until the process is gone (interpreter exit included).
    StopSignals(leaving="leaving gracefully at the next round boundary").install(stop)
    reason = "error"
    try:
        await peer.start()
        reason = await peer.run(stop)
    except Exception as e:
        reason = f"error: {e}"
        raise
    finally:
        await peer.aclose(reason)
    return 0

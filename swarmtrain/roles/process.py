"""`swarmtrain peer` as a process: one role on uvloop (a DiLoCo Peer, a stage server or a trainer), SIGTERM/SIGINT
leave (a Peer at the next round boundary).

A Peer's leave then checkpoints and closes the DHT node within `discovery.shutdown_timeout_s` + 3 s (killed
if it does not answer). A second signal kills this process's children (DHT, p2pd) and exits at once with
128 + the signal number, without a checkpoint.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence

from swarmtrain.config import RunConfig
from swarmtrain.process.signals import StopSignals
from swarmtrain.roles.base import RoleBase
from swarmtrain.roles.stage_server import StageServerRole
from swarmtrain.roles.trainer import TrainerRole
from swarmtrain.roles.worker import Peer
from swarmtrain.telemetry import EventWriter
from swarmtrain.telemetry.console import ConsoleEventWriter, ConsoleProgress
from swarmtrain.telemetry.prometheus import serve_metrics

__all__ = ["run_peer_process", "run_pipeline_process", "run_role", "serve_role_metrics"]


def run_peer_process(local: RunConfig, *, local_overrides: Sequence[str] = (), coordinator_id: str | None = None,
                     progress: ConsoleProgress | None = None, metrics: tuple[str, int] | None = None,
                     after_leave: Callable[[Peer], None] | None = None) -> int:
    """`swarmtrain peer`: one peer on uvloop until its rounds are done or it is signalled; 0 on a clean leave.

    With `progress`, the peer's events and inner steps are also rendered there (stdout is unchanged); with
    `metrics` (host, port), its Prometheus metrics are served there; `after_leave(peer)` runs once it has left,
    if it trained a DiLoCo worker (the CLI's `--export-dir` writes its θ_global there).
    """
    import uvloop

    from swarmtrain.peer.island import join_island, run_follower
    from swarmtrain.peer.network import NetworkServices

    island = join_island(local)  # one rank of a local island (torchrun, --nproc-per-node), or None
    if island is not None and not island.is_leader:
        with island:
            return run_follower(island)
    writer = EventWriter(sys.stdout) if progress is None else ConsoleEventWriter(sys.stdout, progress)
    peer = Peer(local, writer=writer, services=NetworkServices(), local_overrides=local_overrides,
                coordinator_id=coordinator_id, on_step=None if progress is None else progress.on_step, island=island)
    serve_role_metrics(peer, metrics)
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            status = runner.run(run_role(peer, leaving="leaving gracefully at the next round boundary"))
    finally:
        if island is not None:
            island.close()
    if after_leave is not None and peer.worker is not None:
        after_leave(peer)
    return status


def run_pipeline_process(local: RunConfig, *, role: str, stage: int | None = None,
                         local_overrides: Sequence[str] = (), coordinator_id: str | None = None,
                         metrics: tuple[str, int] | None = None) -> int:
    """`swarmtrain peer --role server|trainer`: a stage server (`role="server"`) or a trainer until done or
    signalled; 0 on a clean leave."""
    import uvloop

    from swarmtrain.peer.network import NetworkServices

    writer = EventWriter(sys.stdout)
    kw = {"writer": writer, "services": NetworkServices(), "local_overrides": local_overrides,
          "coordinator_id": coordinator_id}
    runner_role = StageServerRole(local, stage=stage, **kw) if role == "server" else TrainerRole(local, **kw)
    serve_role_metrics(runner_role, metrics)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(run_role(runner_role, leaving="leaving"))


def serve_role_metrics(role: RoleBase, metrics: tuple[str, int] | None) -> None:
    """Serve `role`'s tally as Prometheus metrics at `metrics` (host, port), before it starts (its READY line
    then names the endpoint)."""
    if metrics is not None:
        host, port = metrics
        role.metrics = f"{host}:{serve_metrics(role.tally, port=port, host=host)}"


async def run_role(role: RoleBase, *, leaving: str) -> int:
    """Start `role`, run it until it ends or a signal sets its stop (`leaving` is logged), always close it."""
    stop = asyncio.Event()
    # Never uninstalled: a second signal must work until the process is gone (interpreter exit included).
    StopSignals(leaving=leaving).install(stop)
    reason = "error"
    try:
        await role.start()
        reason = await role.run(stop)
    except Exception as e:
        reason = f"error: {e}"
        raise
    finally:
        await role.aclose(reason)
    return 0

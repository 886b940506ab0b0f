"""`swarmtrain peer --role server|trainer` as a process: one role on uvloop; SIGTERM/SIGINT leave."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from swarmtrain.config import RunConfig
from swarmtrain.peer.process import run_role, serve_role_metrics
from swarmtrain.pipeline.roles import StageServerRole, TrainerRole
from swarmtrain.telemetry import EventWriter

__all__ = ["run_pipeline_process"]


def run_pipeline_process(local: RunConfig, *, role: str, stage: int | None = None,
                         local_overrides: Sequence[str] = (), coordinator_id: str | None = None,
                         metrics: tuple[str, int] | None = None) -> int:
    """Run a stage server (`role="server"`) or a trainer until done or signalled; 0 on a clean leave."""
    import uvloop

    from swarmtrain.peer.network import NetworkServices

    writer = EventWriter(sys.stdout)
    kw = {"writer": writer, "services": NetworkServices(), "local_overrides": local_overrides,
          "coordinator_id": coordinator_id}
    runner_role = StageServerRole(local, stage=stage, **kw) if role == "server" else TrainerRole(local, **kw)
    serve_role_metrics(runner_role, metrics)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(run_role(runner_role, leaving="leaving"))

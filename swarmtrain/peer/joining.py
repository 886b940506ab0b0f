"""Finding the run a process joins: its record in the DHT, from the coordinator `--join` names."""

from __future__ import annotations

import asyncio
import logging
import time

from swarmtrain.config import RunConfig
from swarmtrain.discovery import Discovery
from swarmtrain.peer.services import PeerError

__all__ = ["RUN_FETCH_TIMEOUT_S", "fetch_run_config"]

log = logging.getLogger(__name__)

RUN_FETCH_TIMEOUT_S = 60.0


async def fetch_run_config(discovery: Discovery, local: RunConfig, *, coordinator_id: str | None,
                           timeout_s: float = RUN_FETCH_TIMEOUT_S) -> RunConfig:
    """The run config the coordinator published (the one `--coordinator-id`, else the `/p2p/` id of
    `--join`, names when several key holders published one); PeerError when none shows up in time."""
    deadline = time.monotonic() + timeout_s
    join_ids = [m.rsplit("/p2p/", 1)[1] for m in local.discovery.initial_peers if "/p2p/" in m]
    while True:
        record = await discovery.fetch_run(coordinator_id=coordinator_id, join_ids=join_ids,
                                           timeout_s=local.rpc.call_timeout_s)
        if record is not None:
            log.info("run %s from coordinator %s at round %d", record.run_id, record.coordinator_id, record.round)
            return record.run_config()
        if time.monotonic() > deadline:
            raise PeerError(f"no run record for run {local.train.run_id!r} found in the swarm within "
                            f"{timeout_s:.0f}s (is --join a live coordinator, is train.run_id right?)")
        await asyncio.sleep(0.5)

"""Finding the run a process joins: its record in the DHT, from the coordinator `--join` names."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

from swarmtrain.config import RunConfig
from swarmtrain.config_sections import DiscoveryConfig
from swarmtrain.discovery import Discovery, DiscoveryError, RunRecord
from swarmtrain.peer.services import PeerError
from swarmtrain.round.ballots import Genesis
from swarmtrain.sync.checkpoint import DirectoryClaim, claim_directory

__all__ = ["RUN_FETCH_TIMEOUT_S", "GenesisReader", "claim_peer_directory", "fetch_run_record"]

log = logging.getLogger(__name__)

RUN_FETCH_TIMEOUT_S = 60.0


def claim_peer_directory(local: RunConfig) -> tuple[DirectoryClaim | None, DiscoveryConfig]:
    """The process's claim on `checkpoint.dir` (one live peer per directory: it holds that peer's state, its
    votes and its identity key) and the discovery settings that keep its identity there: a restarted peer,
    worker or stage server, keeps its peer id and so resumes as the same voter, not a new one that leaves the
    old one's vote missing from every round it was a voter of. (None, settings as given) without a directory."""
    dcfg = local.discovery
    if not local.checkpoint.dir:
        return None, dcfg
    claim = claim_directory(local.checkpoint.dir)
    if not dcfg.identity_path:
        dcfg = dataclasses.replace(dcfg, identity_path=str(Path(local.checkpoint.dir) / "identity.key"))
    return claim, dcfg


async def fetch_run_record(discovery: Discovery, local: RunConfig, *, coordinator_id: str | None,
                           timeout_s: float = RUN_FETCH_TIMEOUT_S) -> RunRecord:
    """The run record the coordinator published and signed (the one `--coordinator-id`, else the `/p2p/` id of
    `--join`, names when several key holders published one); PeerError when none shows up in time."""
    deadline = time.monotonic() + timeout_s
    join_ids = [m.rsplit("/p2p/", 1)[1] for m in local.discovery.initial_peers if "/p2p/" in m]
    while True:
        record = await discovery.fetch_run(coordinator_id=coordinator_id, join_ids=join_ids,
                                           timeout_s=local.rpc.call_timeout_s)
        if record is not None:
            log.info("run %s from coordinator %s at round %d", record.run_id, record.coordinator_id, record.round)
            return record
        if time.monotonic() > deadline:
            raise PeerError(f"no run record for run {local.train.run_id!r} found in the swarm within "
                            f"{timeout_s:.0f}s (is --join a live coordinator, is train.run_id right?)")
        await asyncio.sleep(0.5)


class GenesisReader:
    """A scope's genesis (round/ballots.py) from the run record of `coordinator_id`, read when a round needs it
    and kept once found: the coordinator fixes a scope's genesis once."""

    def __init__(self, discovery: Discovery, *, coordinator_id: str, scope: str, timeout_s: float) -> None:
        self.discovery = discovery
        self.coordinator_id = coordinator_id
        self.scope = scope
        self.timeout_s = timeout_s
        self.found: Genesis | None = None

    async def __call__(self) -> Genesis | None:
        if self.found is None:
            try:
                record = await self.discovery.fetch_run(coordinator_id=self.coordinator_id, timeout_s=self.timeout_s)
            except (DiscoveryError, TimeoutError) as e:
                log.info("could not read the run record for the genesis of scope %r: %s", self.scope, e)
                return None
            if record is not None:
                self.found = record.genesis.get(self.scope)
        return self.found

"""What every role shares: joining the run, its tally and metrics, and closing what it opened in reverse.

A role (a DiLoCo worker, a pipeline stage server or trainer) runs as `await start()`, `await run(stop)`,
`await aclose(reason)` (process.py runs one as a process). `_join` claims the peer's directory, opens the DHT,
reads the run record of the coordinator it joins and merges the run's config with the peer's own sections;
whatever a role opens goes on its exit stack (`_opened`), which `aclose` unwinds last, also after a start
that failed half-way.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from swarmtrain.config import RunConfig
from swarmtrain.discovery import Discovery, RunRecord
from swarmtrain.models.spec import check_run
from swarmtrain.peer.config import merge_run_config
from swarmtrain.peer.joining import RUN_FETCH_TIMEOUT_S, claim_peer_directory, fetch_run_record
from swarmtrain.peer.services import PeerServices
from swarmtrain.telemetry import EventWriter
from swarmtrain.telemetry.tally import Tally
from swarmtrain.trust import resolve_run_key

__all__ = ["RoleBase"]


class RoleBase(abc.ABC):
    """A role of a peer process: the peer's own config (`local`) until `_join` merged the run's (`cfg`)."""

    role: ClassVar[str] = ""

    def __init__(self, local: RunConfig, *, writer: EventWriter, services: PeerServices,
                 local_overrides: Sequence[str] = (), coordinator_id: str | None = None) -> None:
        self.local = local
        self.cfg: RunConfig = local
        self.writer = writer
        self.services = services
        self.local_overrides = tuple(local_overrides)
        self.coordinator_id = coordinator_id
        self._opened = contextlib.AsyncExitStack()  # what the role opened, closed in reverse on leaving
        self._peer_id = ""
        self.tally, self.metrics = Tally(), ""  # its work so far (record stats, /metrics at `metrics`: host:port)
        writer.listeners.append(self.tally.observe)

    async def _join(self) -> tuple[Discovery, RunRecord]:
        """Claim the directory, open the DHT, read the run record and take the run's config (refused when the
        peer's own model or tokenizer differs from the run's)."""
        claim, dcfg = claim_peer_directory(self.local)
        if claim is not None:
            self._opened.callback(claim.release)
        discovery = await self.services.open_discovery(dcfg, run_id=self.local.train.run_id,
                                                       run_key=resolve_run_key(self.local.rpc.run_key))
        # The DHT is stopped whatever fails later: a process whose DHT child outlives it never exits
        # (multiprocessing joins it).
        self._opened.push_async_callback(discovery.aclose)
        self._peer_id = discovery.peer_id
        record = await fetch_run_record(discovery, self.local, coordinator_id=self.coordinator_id,
                                        timeout_s=RUN_FETCH_TIMEOUT_S)
        self.cfg = check_run(merge_run_config(record.run_config(), self.local, local_overrides=self.local_overrides))
        if self.cfg.train.threads:
            torch.set_num_threads(self.cfg.train.threads)
        self.tally.peer, self.tally.role = discovery.peer_id, self.role
        return discovery, record

    @abc.abstractmethod
    async def start(self) -> dict[str, Any]:
        """Bring the role up; returns the READY payload (also printed)."""

    @abc.abstractmethod
    async def run(self, stop: asyncio.Event) -> str:
        """Run until the role's work is done or `stop` is set; returns why it ended."""

    @abc.abstractmethod
    async def aclose(self, reason: str) -> None:
        """Leave (the role's own steps), then `await self._opened.aclose()`."""

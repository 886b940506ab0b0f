"""The coordinator's control-plane duty: publish the signed run record and keep its round current."""

from __future__ import annotations

import asyncio
import logging
import secrets

from swarmtrain.config import RunConfig, public_dict
from swarmtrain.discovery.protocol import Discovery, DiscoveryError, RunConflictError
from swarmtrain.discovery.records import RunRecord

__all__ = ["RunPublisher", "with_run_nonce"]

log = logging.getLogger(__name__)


async def with_run_nonce(discovery: Discovery, cfg: RunConfig, *, timeout_s: float) -> RunConfig:
    """`cfg` with its `train.run_nonce`: the configured one; else that of the run record already in the
    DHT (a restarted coordinator continues its run); else a fresh random one (a new run)."""
    if cfg.train.run_nonce:
        return cfg
    try:
        existing = await discovery.fetch_run(timeout_s=timeout_s)
    except RunConflictError as e:
        log.warning("several run records for run %s (%s): starting it with a new nonce", discovery.run_id, e)
        existing = None
    nonce = existing.run_config().train.run_nonce if existing is not None else ""
    if nonce:
        log.info("run %s continues with nonce %s from %s's run record", discovery.run_id, nonce,
                 existing.coordinator_id if existing is not None else "?")
    else:
        nonce = secrets.token_hex(8)
        log.info("run %s starts with nonce %s", discovery.run_id, nonce)
    return cfg.replace(train={"run_nonce": nonce})


class RunPublisher:
    """Publishes `cfg` as the run record, then every `heartbeat_s` sets its round to the live peers' newest.

    Only the round moves: the config of a run never changes once published. The coordinator is
    not on the data path: if it dies, peers keep training and the record ages out after an hour.
    """

    def __init__(self, discovery: Discovery, cfg: RunConfig) -> None:
        if cfg.train.run_id != discovery.run_id:
            raise ValueError(f"train.run_id {cfg.train.run_id!r} is not the discovery's run {discovery.run_id!r}")
        self._d = discovery
        self._cfg = cfg
        self._interval_s = cfg.discovery.heartbeat_s
        self.record = self._record(0)

    def _record(self, round_index: int) -> RunRecord:
        return RunRecord(run_id=self._d.run_id, coordinator_id=self._d.peer_id, config=public_dict(self._cfg),
                         round=round_index, updated_at=self._d.now())

    async def publish(self) -> RunRecord:
        self.record = self._record(self.record.round)
        await self._d.publish_run(self.record, timeout_s=self._interval_s * 5)
        return self.record

    async def refresh(self) -> RunRecord:
        """One tick: read live peers; republish when the newest round moved (or to keep the record fresh)."""
        peers = await self._d.live_peers(timeout_s=self._interval_s * 2)
        newest = max((p.round for p in peers), default=self.record.round)
        if newest != self.record.round:
            log.info("run %s: round %d -> %d (%d live peers)", self._d.run_id, self.record.round, newest, len(peers))
        self.record = self._record(max(newest, self.record.round))
        await self._d.publish_run(self.record, timeout_s=self._interval_s * 5)
        return self.record

    async def serve(self, stop: asyncio.Event) -> None:
        """Refresh every `heartbeat_s` until `stop` is set; a failed tick is logged and retried."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self._interval_s)
                return
            except TimeoutError:
                pass
            try:
                await self.refresh()
            except (DiscoveryError, TimeoutError) as e:
                log.warning("run record refresh failed: %s", e)

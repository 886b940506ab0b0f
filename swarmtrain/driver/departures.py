"""A peer's departure record: its voters' retirements, announced so the others count rounds without them
(stored again at a start when an earlier leave did not get to announce them)."""

from __future__ import annotations

import asyncio
import logging

from swarmtrain.config import RunConfig
from swarmtrain.discovery import DepartureRecord, Discovery, DiscoveryError
from swarmtrain.round.certificate import Retirement

__all__ = ["announce_departure", "announce_stored_retirements", "departure_record"]

log = logging.getLogger(__name__)


def departure_record(*, run_id: str, peer_id: str, retirements: dict[str, list[Retirement]],
                     now: float) -> DepartureRecord:
    """The departure record announcing `retirements` (per scope) of this peer's voters."""
    newest = max((r.from_round for rs in retirements.values() for r in rs), default=0)
    return DepartureRecord(run_id=run_id, peer_id=peer_id, from_round=newest, left_at=now,
                           retirements={s: tuple(rs[-4:]) for s, rs in retirements.items()})


async def announce_stored_retirements(discovery: Discovery, retirements: dict[str, list[Retirement]], *,
                                      cfg: RunConfig) -> bool:
    """At start: announce the retirements this peer's vote books hold from an earlier run (per scope), if any.

    A leave retires the voter (stored) before it announces the departure; a process killed between the two
    comes back as its next incarnation while the others still count the retired one, which grants nothing
    more: a round it was needed for would wait for it for good. False when there was nothing to announce or
    every try failed."""
    if not any(retirements.values()):
        return False
    record = departure_record(run_id=cfg.train.run_id, peer_id=discovery.peer_id, retirements=retirements,
                              now=discovery.now())
    log.info("announcing %d retirement(s) an earlier run of this peer stored",
             sum(len(rs) for rs in retirements.values()))
    return await announce_departure(discovery, record, cfg=cfg)


async def announce_departure(discovery: Discovery, record: DepartureRecord, *, cfg: RunConfig) -> bool:
    """Store `record` in the DHT, retrying every heartbeat for up to a record TTL: a retirement nobody reads
    leaves its voter counted in the rounds it was a voter of, so a leaver stopped or cut off for a few seconds
    at that moment tries again. False (logged) when every try failed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.discovery.record_ttl_s
    while True:
        try:
            await discovery.announce_departure(record, timeout_s=cfg.rpc.call_timeout_s)
            return True
        except (DiscoveryError, TimeoutError) as e:
            if loop.time() + cfg.discovery.heartbeat_s > deadline:
                log.warning("could not announce this peer's departure: %s", e)
                return False
            await asyncio.sleep(cfg.discovery.heartbeat_s)

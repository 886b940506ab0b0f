"""Heartbeat: re-announce this peer's PeerRecord every `heartbeat_s` so it stays live; withdraw on close."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable

from swarmtrain.discovery.protocol import Discovery, DiscoveryError
from swarmtrain.discovery.records import PeerRecord

__all__ = ["Heartbeat"]

log = logging.getLogger(__name__)


class Heartbeat:
    """Announces `current()` (stamped with the discovery clock) now and then every `heartbeat_s`.

    A failed beat is logged and retried on the next tick: the record only vanishes if beats
    keep failing for `record_ttl_s`, which is exactly what "dead" means to the others.
    """

    def __init__(self, discovery: Discovery, *, current: Callable[[], PeerRecord], heartbeat_s: float,
                 now: Callable[[], float], timeout_s: float | None = None) -> None:
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self._discovery = discovery
        self._current = current
        self._heartbeat_s = heartbeat_s
        self._now = now
        self._timeout_s = timeout_s if timeout_s is not None else heartbeat_s
        self._task: asyncio.Task[None] | None = None
        self.beats = 0

    async def beat(self) -> PeerRecord:
        """Announce once (raises DiscoveryError/TimeoutError if the store fails)."""
        record = dataclasses.replace(self._current(), heartbeat_at=self._now())
        await self._discovery.announce(record, timeout_s=self._timeout_s)
        self.beats += 1
        return record

    async def start(self) -> PeerRecord:
        """The first beat is awaited so a peer knows it is visible before it proceeds."""
        if self._task is not None:
            raise RuntimeError("Heartbeat already started")
        record = await self.beat()
        self._task = asyncio.create_task(self.loop(), name=f"heartbeat-{self._discovery.peer_id}")
        return record

    async def loop(self) -> None:
        """Beat every `heartbeat_s` until cancelled (what `start` runs as a task)."""
        while True:
            await asyncio.sleep(self._heartbeat_s)
            try:
                await self.beat()
            except (DiscoveryError, TimeoutError) as e:
                log.warning("heartbeat of %s failed: %s", self._discovery.peer_id, e)

    async def aclose(self, *, withdraw: bool = True) -> None:
        """Stop beating; `withdraw` removes the record now instead of letting it expire."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if withdraw:
            try:
                await self._discovery.withdraw(timeout_s=self._timeout_s)
            except (DiscoveryError, TimeoutError) as e:
                log.warning("withdraw of %s failed (the record expires by itself): %s", self._discovery.peer_id, e)

"""InMemoryDiscovery: the Discovery twin over a shared in-process registry, for unit and fast integration tests."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from swarmtrain.discovery.protocol import DiscoveryError, RawSlot, RecordDirectory

__all__ = ["InMemoryDiscovery", "InMemoryRegistry"]


@dataclass
class InMemoryRegistry:
    """A shared DHT stand-in: `key -> owner -> (value, expires_at)`; thread-safe, expiry by `clock`.

    `latency_s` delays every read and write so tests can mimic a slow control plane.
    """

    clock: Callable[[], float] = time.time
    latency_s: float = 0.0
    _slots: dict[str, dict[str | None, tuple[object, float]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def put(self, key: str, owner: str | None, value: object, *, expires_at: float) -> None:
        """Write `owner`'s slot; `owner=None` models an unsigned record injected by a hostile peer."""
        with self._lock:
            self._slots.setdefault(key, {})[owner] = (value, expires_at)

    def get(self, key: str) -> list[RawSlot]:
        now = self.clock()
        with self._lock:
            slots = self._slots.get(key, {})
            for owner in [o for o, (_, exp) in slots.items() if exp <= now]:
                del slots[owner]
            return [RawSlot(signer_id=o, value=v, expires_at=exp) for o, (v, exp) in slots.items()]

    def delete(self, key: str, owner: str) -> None:
        with self._lock:
            self._slots.get(key, {}).pop(owner, None)

    def new_peer_id(self) -> str:
        return f"mem-{next(self._ids):04d}"


class InMemoryDiscovery(RecordDirectory):
    """One peer's view of an `InMemoryRegistry`; it can write only its own slots."""

    def __init__(self, registry: InMemoryRegistry, *, run_id: str, record_ttl_s: float,
                 peer_id: str | None = None) -> None:
        super().__init__(run_id=run_id, record_ttl_s=record_ttl_s, clock=registry.clock)
        self._registry = registry
        self._peer_id = peer_id or registry.new_peer_id()
        self._closed = False

    @property
    def peer_id(self) -> str:
        return self._peer_id

    async def _io(self, timeout_s: float) -> None:
        if self._closed:
            raise DiscoveryError(f"discovery of {self._peer_id} is closed")
        if self._registry.latency_s > 0:
            if self._registry.latency_s > timeout_s:
                await asyncio.sleep(timeout_s)
                raise DiscoveryError(f"control plane did not answer within {timeout_s:.2f}s")
            await asyncio.sleep(self._registry.latency_s)

    async def _put(self, key: str, value: bytes, *, expires_at: float, timeout_s: float) -> None:
        await self._io(timeout_s)
        self._registry.put(key, self._peer_id, value, expires_at=expires_at)

    async def _get(self, key: str, *, timeout_s: float) -> Sequence[RawSlot]:
        await self._io(timeout_s)
        return self._registry.get(key)

    async def _delete(self, key: str, *, timeout_s: float) -> None:
        await self._io(timeout_s)
        self._registry.delete(key, self._peer_id)

    async def aclose(self) -> None:
        self._closed = True

"""InMemoryDiscovery: the Discovery twin over a shared in-process registry, for unit and fast integration tests."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from swarmtrain.discovery.protocol import DiscoveryError, RawSlot, RecordDirectory
from swarmtrain.trust.identity import Ed25519Identity, Identity, KeyBinding, registry_binding

__all__ = ["InMemoryDiscovery", "InMemoryRegistry"]


@dataclass
class InMemoryRegistry:
    """A shared DHT stand-in: `key -> owner -> (value, expires_at)`; thread-safe, expiry by `clock`.

    `latency_s` delays every read and write so tests can mimic a slow control plane. `partition()`
    splits it as a network partition splits a DHT: each side reads and writes its own copy of what was
    stored before, until `heal()` merges the copies (the later expiry of each slot wins, as in hivemind).
    """

    clock: Callable[[], float] = time.time
    latency_s: float = 0.0
    _slots: dict[str, dict[str | None, tuple[object, float]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _side_of: dict[str, int] = field(default_factory=dict)  # peer id -> side, while partitioned
    _sides: list[dict[str, dict[str | None, tuple[object, float]]]] = field(default_factory=list)
    # The identity key of every peer id (a real DHT derives ids from keys; this twin vouches for them instead:
    # a restarted peer reopens its id with the same key). `key_seed` derives the keys (a simulation replays them).
    identities: dict[str, Ed25519Identity] = field(default_factory=dict)
    keys: dict[str, bytes] = field(default_factory=dict)
    key_seed: bytes | None = None

    def partition(self, *sides: Sequence[str]) -> None:
        """Split the registry: the peers of each side see only what their side stores from now on.
        A peer on no side (a coordinator) reads side 0 and writes to every side."""
        with self._lock:
            if self._sides:
                raise RuntimeError("InMemoryRegistry.partition: already partitioned; heal() first")
            self._side_of = {p: i for i, side in enumerate(sides) for p in side}
            self._sides = [{k: dict(v) for k, v in self._slots.items()} for _ in sides]

    def heal(self) -> None:
        """End the partition: every slot keeps the copy with the later expiry."""
        with self._lock:
            merged: dict[str, dict[str | None, tuple[object, float]]] = {}
            for side in self._sides:
                for key, slots in side.items():
                    into = merged.setdefault(key, {})
                    for owner, item in slots.items():
                        if owner not in into or item[1] > into[owner][1]:
                            into[owner] = item
            if self._sides:
                self._slots = merged
            self._sides, self._side_of = [], {}

    def _stores(self, peer: str | None) -> list[dict[str, dict[str | None, tuple[object, float]]]]:
        if not self._sides:
            return [self._slots]
        side = self._side_of.get(peer or "")
        return self._sides if side is None else [self._sides[side]]

    def put(self, key: str, owner: str | None, value: object, *, expires_at: float) -> None:
        """Write `owner`'s slot; `owner=None` models an unsigned record injected by a hostile peer."""
        with self._lock:
            for store in self._stores(owner):
                store.setdefault(key, {})[owner] = (value, expires_at)

    def get(self, key: str, *, reader: str | None = None) -> list[RawSlot]:
        """The live slots of `key` as `reader` sees them (its side's copy while partitioned)."""
        now = self.clock()
        with self._lock:
            slots = self._stores(reader)[0].get(key, {})
            for owner in [o for o, (_, exp) in slots.items() if exp <= now]:
                del slots[owner]
            return [RawSlot(signer_id=o, value=v, expires_at=exp) for o, (v, exp) in slots.items()]

    def delete(self, key: str, owner: str) -> None:
        with self._lock:
            for store in self._stores(owner):
                store.get(key, {}).pop(owner, None)

    def new_peer_id(self) -> str:
        return f"mem-{next(self._ids):04d}"

    def identity(self, peer_id: str) -> Ed25519Identity:
        """The signing key of `peer_id` (made and registered at its first use)."""
        with self._lock:
            ident = self.identities.get(peer_id)
            if ident is None:
                ident = (Ed25519Identity.from_seed(peer_id, self.key_seed + peer_id.encode())
                         if self.key_seed is not None else Ed25519Identity.generate(peer_id))
                self.identities[peer_id], self.keys[peer_id] = ident, ident.public_key
            return ident


class InMemoryDiscovery(RecordDirectory):
    """One peer's view of an `InMemoryRegistry`; it can write only its own slots."""

    def __init__(self, registry: InMemoryRegistry, *, run_id: str, record_ttl_s: float,
                 peer_id: str | None = None, skew_s: float = 0.0, run_key: str = "") -> None:
        """`skew_s`: this peer's machine clock runs that far ahead of the registry's (behind when < 0)."""
        super().__init__(run_id=run_id, record_ttl_s=record_ttl_s,
                         clock=registry.clock if not skew_s else lambda: registry.clock() + skew_s, run_key=run_key)
        self._registry = registry
        self._peer_id = peer_id or registry.new_peer_id()
        self._closed = False
        self._identity = registry.identity(self._peer_id)

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def identity(self) -> Identity:
        return self._identity

    @property
    def key_binding(self) -> KeyBinding:
        return registry_binding(self._registry.keys)

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
        return self._registry.get(key, reader=self._peer_id)

    async def _delete(self, key: str, *, timeout_s: float) -> None:
        await self._io(timeout_s)
        self._registry.delete(key, self._peer_id)

    async def aclose(self) -> None:
        self._closed = True


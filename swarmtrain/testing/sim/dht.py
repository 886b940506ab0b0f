"""The simulated control plane: the in-memory DHT twin on the simulation's clock, partitioned by sides as the
real one splits, and serving *stale reads* (a read that misses the writes of the last seconds, as an eventually
consistent DHT does) with a seeded probability; and each peer's view of it, which a frozen peer cannot use."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from swarmtrain.discovery import InMemoryDiscovery, InMemoryRegistry
from swarmtrain.discovery.protocol import DiscoveryError, RawSlot

__all__ = ["SimDiscovery", "SimRegistry"]


class SimRegistry(InMemoryRegistry):
    """An InMemoryRegistry whose reads are stale with probability `stale`, by up to `stale_s` seconds."""

    def __init__(self, *, clock: Callable[[], float], rng: random.Random, stale: float = 0.0, stale_s: float = 0.0,
                 key_seed: bytes = b"sim") -> None:
        super().__init__(clock=clock)
        self.key_seed = key_seed
        self.rng = rng
        self.stale = stale
        self.stale_s = stale_s
        self._history: dict[str, list[tuple[float, str | None, object | None, float]]] = {}
        self.stale_reads = 0

    def put(self, key: str, owner: str | None, value: object, *, expires_at: float) -> None:
        super().put(key, owner, value, expires_at=expires_at)
        self._remember(key, owner, value, expires_at)

    def delete(self, key: str, owner: str) -> None:
        super().delete(key, owner)
        self._remember(key, owner, None, 0.0)

    def _remember(self, key: str, owner: str | None, value: object | None, expires_at: float) -> None:
        entries = self._history.setdefault(key, [])
        entries.append((self.clock(), owner, value, expires_at))
        if len(entries) > 256:
            del entries[:64]

    def get(self, key: str, *, reader: str | None = None) -> list[RawSlot]:
        fresh = super().get(key, reader=reader)
        if not self.stale or self.rng.random() >= self.stale:
            return fresh
        self.stale_reads += 1
        as_of = self.clock() - self.stale_s * self.rng.random()
        now, out = self.clock(), []
        for slot in fresh:
            older = [e for e in self._history.get(key, ()) if e[1] == slot.signer_id and e[0] <= as_of]
            if older and older[-1][2] is not None and older[-1][3] > now:
                out.append(RawSlot(signer_id=slot.signer_id, value=older[-1][2], expires_at=older[-1][3]))
        return out


class SimDiscovery(InMemoryDiscovery):
    """A peer's view of a SimRegistry: its calls take `latency_s` and wait while the peer is frozen."""

    def __init__(self, registry: SimRegistry, *, run_id: str, record_ttl_s: float, peer_id: str, skew_s: float,
                 run_key: str, latency_s: float, thawed: Callable[[str], object]) -> None:
        super().__init__(registry, run_id=run_id, record_ttl_s=record_ttl_s, peer_id=peer_id, skew_s=skew_s,
                         run_key=run_key)
        self.latency_s = latency_s
        self._thawed = thawed

    async def _io(self, timeout_s: float) -> None:
        if self._closed:
            raise DiscoveryError(f"discovery of {self.peer_id} is closed")
        try:
            await asyncio.wait_for(self._thawed(self.peer_id), timeout=timeout_s)  # type: ignore[arg-type]
        except TimeoutError:
            raise DiscoveryError(f"control plane did not answer within {timeout_s:.2f}s") from None
        await asyncio.sleep(self.latency_s)


"""The simulated control plane: the in-memory DHT twin on the simulation's clock, partitioned by sides as the
real one splits, and serving *stale reads* (a read that misses the writes of the last seconds, as an eventually
consistent DHT does) with a seeded probability; and each peer's view of it, which a frozen peer cannot use.

The peers' views share one cache of decoded records (a record is a pure function of its key, signer and sealed
bytes, the run and the run key, all of which the peers of a run share): every peer reads every peer's record
each heartbeat, and each opening and checking all of them, one peer after another on the simulation's one
core, cost the simulation a time that grows with the square of the swarm. What a peer reads is unchanged; its
`io.decoded` counts only the records it was the first of the swarm to decode. And a key's live slots, as a read
returned them, serve its next reads until a write to the key or the earliest of their expiries (not while
partitioned): the same slots those reads would have found."""

from __future__ import annotations

import asyncio
import collections
import math
import random
from collections.abc import Callable, Sequence

from swarmtrain.discovery import InMemoryDiscovery, InMemoryRegistry
from swarmtrain.discovery.protocol import DiscoveryError, RawSlot
from swarmtrain.discovery.records import Record

DecodedCache = collections.OrderedDict[tuple[str, str, str, bytes], Record]

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
        self._decoded: dict[tuple[str, str], DecodedCache] = {}
        self._live: dict[str, tuple[list[RawSlot], float]] = {}  # key -> its live slots, the earliest expiry

    def decoded_cache(self, run_id: str, run_key: str) -> DecodedCache:
        """The decoded records that the readers of run `run_id` with run key `run_key` share (module docstring)."""
        return self._decoded.setdefault((run_id, run_key), collections.OrderedDict())

    def partition(self, *sides: Sequence[str]) -> None:
        self._live.clear()
        super().partition(*sides)

    def heal(self) -> None:
        self._live.clear()
        super().heal()

    def put(self, key: str, owner: str | None, value: object, *, expires_at: float) -> None:
        self._live.pop(key, None)
        super().put(key, owner, value, expires_at=expires_at)
        self._remember(key, owner, value, expires_at)

    def delete(self, key: str, owner: str) -> None:
        self._live.pop(key, None)
        super().delete(key, owner)
        self._remember(key, owner, None, 0.0)

    def _fresh(self, key: str, reader: str | None) -> list[RawSlot]:
        """`InMemoryRegistry.get`, from the key's last read while no slot of it was written or expired since."""
        if self._sides:
            return super().get(key, reader=reader)
        known = self._live.get(key)
        if known is not None and self.clock() < known[1]:
            return list(known[0])
        fresh = super().get(key, reader=reader)
        self._live[key] = (fresh, min((slot.expires_at for slot in fresh), default=math.inf))
        return list(fresh)

    def _remember(self, key: str, owner: str | None, value: object | None, expires_at: float) -> None:
        entries = self._history.setdefault(key, [])
        entries.append((self.clock(), owner, value, expires_at))
        if len(entries) > 256:
            del entries[:64]

    def get(self, key: str, *, reader: str | None = None) -> list[RawSlot]:
        fresh = self._fresh(key, reader)
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
        self._decoded_cache = registry.decoded_cache(run_id, run_key)
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


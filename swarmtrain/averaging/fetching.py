"""Fetching a value's material from the peers that hold it: the shards this peer misses, each checked against
the digest the value names and by the codec (it decodes, to finite values), from the first holder that
serves it. Used by a voter asked to accept a value it does not hold in full, a proposer carrying another
session's value forward, and a learner applying a round it missed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from swarmtrain.averaging.material import Material, MaterialError, MaterialStore
from swarmtrain.round.ballots import MaterialLayout
from swarmtrain.round.messages import ConsensusTransport, Contact
from swarmtrain.rpc.errors import RpcError

__all__ = ["FETCHES_AT_ONCE", "MaterialFetcher"]

log = logging.getLogger(__name__)

FETCHES_AT_ONCE = 8  # shards of one value's material fetched at the same time

CheckShard = Callable[[MaterialLayout, int, bytes | bytearray | memoryview], None]
"""Raise (CodecError, MaterialError) unless a shard's blob decodes, to finite values, as `layout` says."""


class MaterialFetcher:
    """Completes material in `store` from holders (see the module docstring); one fetch per layout at a time."""

    def __init__(self, *, transport: ConsensusTransport, store: MaterialStore, scope: str, self_id: str,
                 check: CheckShard, max_bytes: int) -> None:
        self.transport = transport
        self.store = store
        self.scope = scope
        self.self_id = self_id
        self.check = check
        self.max_bytes = max_bytes  # the most a value's material may hold (the model's size, encoded at fp32)
        self._locks: dict[str, asyncio.Lock] = {}

    async def complete(self, round_index: int, layout: MaterialLayout, holders: Sequence[Contact], *,
                       timeout_s: float) -> Material:
        """The whole material of `layout`, fetching the shards missing here; MaterialError when no holder
        served one of them in time."""
        if layout.size_bytes > self.max_bytes:
            raise MaterialError(f"a value's material of {layout.size_bytes} bytes; this part holds at most "
                                f"{self.max_bytes}")
        key = ",".join(s.digest for s in layout.shards)
        if len(self._locks) > 64:  # fetches of rounds long decided
            self._locks = {k: v for k, v in self._locks.items() if v.locked()}
        lock = self._locks.setdefault(key, asyncio.Lock())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                async with lock:
                    held = self.store.get(layout)
                    material = held if held is not None else Material(layout)
                    await self._missing(material, holders, deadline)
                    self.store.put(round_index, material)
                    return material
        except TimeoutError:
            raise MaterialError(f"no holder served the material in {timeout_s:.1f}s") from None

    async def _missing(self, material: Material, holders: Sequence[Contact], deadline: float) -> None:
        """The shards `material` misses, `FETCHES_AT_ONCE` at a time (one after another would cost a round trip per
        shard, and a value has one shard per reducer), spread over the holders: each shard asks first the holder
        with the fewest of these calls in flight (from the i-th on for shard i where they tie), so a holder that
        does not answer stops being asked once its calls pile up, and one that failed is asked last (a dead or
        stopped holder costs the fetch the shards that were waiting on it, not one timeout per shard). The first
        failure is raised once the fetches under way ended."""
        layout = material.layout
        slots = asyncio.Semaphore(FETCHES_AT_ONCE)
        usable = [h for h in holders if h.peer_id != self.self_id and h.endpoint]
        asking = _Asking()

        async def fetch(i: int, shard: int) -> None:
            order = usable[i % len(usable):] + usable[:i % len(usable)] if usable else []
            async with slots:
                material.put(shard, await self._one(layout, shard, order, deadline, asking))

        done = await asyncio.gather(*(fetch(i, shard) for i, shard in enumerate(material.missing())),
                                    return_exceptions=True)
        for result in done:
            if isinstance(result, BaseException):
                raise result

    async def _one(self, layout: MaterialLayout, shard: int, holders: Sequence[Contact], deadline: float,
                   asking: _Asking) -> bytes | bytearray | memoryview:
        """Shard `shard` from one of `holders` that serves it, asked in `asking`'s order."""
        loop = asyncio.get_running_loop()
        problems: list[str] = []
        left_to_ask = list(holders)
        while left_to_ask:
            holder = asking.pick(left_to_ask)
            left_to_ask.remove(holder)
            left = deadline - loop.time()
            if left <= 0:
                break
            asking.in_flight[holder.peer_id] = asking.in_flight.get(holder.peer_id, 0) + 1
            try:
                blob = await self.transport.material(holder, scope=self.scope, layout=layout, shard=shard,
                                                     timeout_s=left)
                if len(blob) != layout.shards[shard].size_bytes:
                    raise MaterialError(f"{len(blob)} bytes, the value names {layout.shards[shard].size_bytes}")
                Material(layout).put(shard, blob)  # the digest
                await asyncio.to_thread(self.check, layout, shard, blob)
                return blob
            except (RpcError, ValueError, TimeoutError) as e:  # dead, refused, or bytes that do not check out
                asking.failed.add(holder.peer_id)
                problems.append(f"{holder.peer_id}: {type(e).__name__}: {e}")
            finally:
                asking.in_flight[holder.peer_id] -= 1
        raise MaterialError(f"shard {shard} of the value: no holder served it ({'; '.join(problems) or 'none asked'})")


class _Asking:
    """The holders' state across the shard fetches of one value: calls in flight to each, and those that failed."""

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}
        self.failed: set[str] = set()

    def pick(self, holders: Sequence[Contact]) -> Contact:
        """The holder to ask next: not failed before failed, then the fewest calls in flight, then `holders`' order."""
        return min(holders, key=lambda h: (h.peer_id in self.failed, self.in_flight.get(h.peer_id, 0)))

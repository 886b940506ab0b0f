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

__all__ = ["MaterialFetcher"]

log = logging.getLogger(__name__)

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
                    for shard in material.missing():
                        blob = await self._one(layout, shard, holders, deadline)
                        material.put(shard, blob)
                    self.store.put(round_index, material)
                    return material
        except TimeoutError:
            raise MaterialError(f"no holder served the material in {timeout_s:.1f}s") from None

    async def _one(self, layout: MaterialLayout, shard: int, holders: Sequence[Contact],
                   deadline: float) -> bytes | bytearray | memoryview:
        loop = asyncio.get_running_loop()
        problems: list[str] = []
        for holder in holders:
            if holder.peer_id == self.self_id or not holder.endpoint:
                continue
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                blob = await self.transport.material(holder, scope=self.scope, layout=layout, shard=shard,
                                                     timeout_s=left)
                if len(blob) != layout.shards[shard].size_bytes:
                    raise MaterialError(f"{len(blob)} bytes, the value names {layout.shards[shard].size_bytes}")
                Material(layout).put(shard, blob)  # the digest
                await asyncio.to_thread(self.check, layout, shard, blob)
                return blob
            except (RpcError, ValueError, TimeoutError) as e:  # dead, refused, or bytes that do not check out
                problems.append(f"{holder.peer_id}: {type(e).__name__}: {e}")
        raise MaterialError(f"shard {shard} of the value: no holder served it ({'; '.join(problems) or 'none asked'})")

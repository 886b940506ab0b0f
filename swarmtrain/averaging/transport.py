"""The all-reduce's transport: how a member reaches a reducer (itself included) to push a shard, ask for the
contributors and fetch a mean. `GrpcReduceTransport` is the real one (rpc/averaging_client.py, this peer's
own reducer called directly); tests and the simulation put their own in its place, or wrap it with faults
(swarmtrain/testing/), so that no fault branch lives in the production code.

Deadlines are on the running event loop's clock (`loop.time()`), like every wait of the round.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol

from swarmtrain.round.group import Member
from swarmtrain.rpc.averaging_wire import PushHeader, ReducerSink, SessionKey
from swarmtrain.rpc.errors import Rejected, RpcRejected

__all__ = ["Fetched", "GrpcReduceTransport", "Payload", "ReduceTransport"]

Payload = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Fetched:
    """A fetched mean: its bytes, which are the caller's (pooled memory goes back by itself once nothing refers
    to it), and their digest as a round's material names it (averaging/material.blob_digest) where the
    transport took it on the way ("" where not: the caller takes it)."""

    data: Payload
    digest: str = ""


class ReduceTransport(Protocol):
    """A member's calls to the reducers of its round; errors are the rpc layer's (RpcUnavailable, RpcTimeout,
    RpcRejected) or `Rejected` from its own reducer."""

    async def push(self, reducer: Member, header: PushHeader, payload: Payload, *, deadline: float) -> None: ...

    async def contributors(self, reducer: Member, key: SessionKey, shard: int, *,
                           deadline: float) -> tuple[str, ...]: ...

    async def fetch(self, reducer: Member, key: SessionKey, shard: int, contributors: tuple[str, ...], *,
                    max_bytes: int, deadline: float) -> Fetched: ...


def _monotonic(deadline: float) -> float:
    """A loop-clock deadline as a `time.monotonic()` one (the rpc client's clock)."""
    return time.monotonic() + (deadline - asyncio.get_running_loop().time())


def _left(deadline: float) -> float:
    return max(deadline - asyncio.get_running_loop().time(), 1e-3)


class GrpcReduceTransport:
    """Calls over gRPC and the bulk port (`client`, an AveragingClient), and to `local` (this peer's own
    ReducerRegistry) directly when the reducer is this peer."""

    def __init__(self, client: object, local: ReducerSink, *, peer_id: str) -> None:
        self.client = client  # rpc.averaging_client.AveragingClient (no import: averaging stays off grpc types)
        self.local = local
        self.peer_id = peer_id

    async def push(self, reducer: Member, header: PushHeader, payload: Payload, *, deadline: float) -> None:
        if reducer.peer_id == self.peer_id:
            await asyncio.wait_for(self.local.check_push(header, peer=self.peer_id), timeout=_left(deadline))
            if len(payload) != header.total_bytes:
                raise Rejected(f"truncated push: got {len(payload)} of {header.total_bytes} bytes")
            await self.local.accept_push(header, payload, peer=self.peer_id)
            return
        await self.client.push(reducer.endpoint, reducer.peer_id, header, payload,  # type: ignore[attr-defined]
                               deadline=_monotonic(deadline))

    async def contributors(self, reducer: Member, key: SessionKey, shard: int, *,
                           deadline: float) -> tuple[str, ...]:
        if reducer.peer_id == self.peer_id:
            return await asyncio.wait_for(self.local.contributors(key, shard, peer=self.peer_id),
                                          timeout=_left(deadline))
        return await self.client.contributors(reducer.endpoint, reducer.peer_id, key,  # type: ignore[attr-defined]
                                              shard, deadline=_monotonic(deadline))

    async def fetch(self, reducer: Member, key: SessionKey, shard: int, contributors: tuple[str, ...], *,
                    max_bytes: int, deadline: float) -> Fetched:
        if reducer.peer_id == self.peer_id:
            data = await asyncio.wait_for(self.local.mean(key, shard, contributors, peer=self.peer_id),
                                          timeout=_left(deadline))
            if len(data) > max_bytes:
                raise RpcRejected("INVALID_REPLY", f"own mean of shard {shard} has {len(data)} bytes, max {max_bytes}")
            await self.local.delivered(key, shard, peer=self.peer_id)
            return Fetched(data)
        data, digest = await self.client.fetch(reducer.endpoint, reducer.peer_id,  # type: ignore[attr-defined]
                                               key, shard, contributors, max_bytes=max_bytes,
                                               deadline=_monotonic(deadline))
        return Fetched(data, digest.hex())

"""The all-reduce over gRPC: the Averaging servicer (adapts a ReducerSink) and its client calls."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from grpc import aio

from swarmtrain.rpc.node import Rejected, RpcNode, RpcRejected, peer_of, remaining_s, status_of, translate
from swarmtrain.wire import averaging_pb2 as pb
from swarmtrain.wire import averaging_pb2_grpc as pb_grpc

__all__ = ["AveragingClient", "PushHeader", "ReducerSink", "SessionKey", "serve_averaging"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionKey:
    """One attempt of one round's all-reduce, as every message of the attempt names it."""

    run_id: str
    round: int
    group_id: str
    attempt: int
    reducers: tuple[str, ...]

    @property
    def session_id(self) -> str:
        h = hashlib.sha256(f"{self.run_id}|{self.round}|{self.group_id}|{self.attempt}|".encode())
        h.update("|".join(self.reducers).encode())
        return h.hexdigest()[:24]

    def to_wire(self) -> pb.SessionKey:
        return pb.SessionKey(run_id=self.run_id, round=self.round, group_id=self.group_id, attempt=self.attempt,
                             reducers=list(self.reducers))

    @classmethod
    def from_wire(cls, msg: pb.SessionKey) -> SessionKey:
        return cls(msg.run_id, msg.round, msg.group_id, msg.attempt, tuple(msg.reducers))


@dataclass(frozen=True)
class PushHeader:
    """What a pushed shard claims to be; the reducer checks every field before accepting bytes."""

    session: SessionKey
    sender: str
    shard: int
    numel: int
    total_bytes: int
    codec: str


class ReducerSink(Protocol):
    """The reducer side of the all-reduce (implemented in swarmtrain.averaging). Raise `Rejected` to refuse."""

    async def check_push(self, header: PushHeader, *, peer: str) -> int:
        """Validate a push header (may wait for the session to open); return the max payload bytes."""
        ...

    async def accept_push(self, header: PushHeader, payload: bytearray, *, peer: str) -> None: ...

    async def contributors(self, key: SessionKey, shard: int, *, peer: str) -> tuple[str, ...]: ...

    async def mean(self, key: SessionKey, shard: int, contributors: tuple[str, ...], *, peer: str) -> bytes: ...


class _Servicer(pb_grpc.AveragingServicer):
    def __init__(self, node: RpcNode, sink: ReducerSink) -> None:
        self.node = node
        self.sink = sink

    async def _reject(self, context: aio.ServicerContext, method: str, peer: str, err: Rejected) -> None:
        log.warning("%s rejected %s from %s: %s", self.node.peer_id, method, peer, err)
        await context.abort(status_of(err), str(err))

    async def Push(self, request_iterator: AsyncIterator[pb.PushChunk], context: aio.ServicerContext) -> pb.PushReply:
        peer = peer_of(context)
        header: PushHeader | None = None
        buf = bytearray()
        received = 0
        try:
            async for chunk in request_iterator:
                if header is None:
                    if not chunk.HasField("header"):
                        raise Rejected("the first chunk of a push carries no header")
                    h = chunk.header
                    header = PushHeader(SessionKey.from_wire(h.session), h.sender, h.shard, h.numel,
                                        h.total_bytes, h.codec)
                    limit = await self.sink.check_push(header, peer=peer)
                    if not 0 <= header.total_bytes <= limit:
                        raise Rejected(f"push declares {header.total_bytes} bytes; at most {limit} allowed for "
                                       f"{header.numel} values", kind="too_large")
                    buf = bytearray(header.total_bytes)
                n = len(chunk.data)
                if received + n > header.total_bytes:
                    raise Rejected(f"push carries more than the {header.total_bytes} bytes it declared",
                                   kind="too_large")
                buf[received:received + n] = chunk.data
                received += n
            if header is None:
                raise Rejected("empty push stream")
            self.node.counters.add_received(peer, received)
            if received != header.total_bytes:
                raise Rejected(f"truncated push: got {received} of {header.total_bytes} bytes")
            await self.sink.accept_push(header, buf, peer=peer)
        except Rejected as e:
            await self._reject(context, "Push", peer, e)
        return pb.PushReply(received_bytes=received)

    async def Contributors(self, request: pb.ContributorsRequest,
                           context: aio.ServicerContext) -> pb.ContributorsReply:
        peer = peer_of(context)
        try:
            names = await self.sink.contributors(SessionKey.from_wire(request.session), request.shard, peer=peer)
        except Rejected as e:
            await self._reject(context, "Contributors", peer, e)
            raise AssertionError("unreachable") from e
        return pb.ContributorsReply(contributors=list(names))

    async def Fetch(self, request: pb.FetchRequest, context: aio.ServicerContext) -> AsyncIterator[pb.FetchChunk]:
        peer = peer_of(context)
        try:
            data = await self.sink.mean(SessionKey.from_wire(request.session), request.shard,
                                        tuple(request.contributors), peer=peer)
        except Rejected as e:
            await self._reject(context, "Fetch", peer, e)
            return
        step, view = self.node.cfg.chunk_bytes, memoryview(data)
        yield pb.FetchChunk(total_bytes=len(data), data=bytes(view[:step]))
        for start in range(step, len(data), step):
            yield pb.FetchChunk(data=bytes(view[start:start + step]))
        self.node.counters.add_sent(peer, len(data))


def serve_averaging(node: RpcNode, sink: ReducerSink) -> None:
    """Register the Averaging service backed by `sink` on `node` (before `node.start()`)."""
    servicer = _Servicer(node, sink)
    node.add_service(lambda server: pb_grpc.add_AveragingServicer_to_server(servicer, server))


class AveragingClient:
    """Client calls of the all-reduce; run them on the node's loop. Every call has a deadline; errors are
    RpcUnavailable / RpcTimeout / RpcRejected."""

    def __init__(self, node: RpcNode) -> None:
        self.node = node
        self._stubs: dict[str, pb_grpc.AveragingStub] = {}

    def _stub(self, endpoint: str) -> pb_grpc.AveragingStub:
        stub = self._stubs.get(endpoint)
        if stub is None:
            stub = self._stubs[endpoint] = pb_grpc.AveragingStub(self.node.channel(endpoint))
        return stub

    async def push(self, endpoint: str, target: str, header: PushHeader, payload: bytes, *, deadline: float) -> None:
        """Stream `payload` (its size may differ from header.total_bytes only under fault injection)."""
        h = header
        wire_header = pb.PushHeader(session=h.session.to_wire(), sender=h.sender, shard=h.shard, numel=h.numel,
                                    total_bytes=h.total_bytes, codec=h.codec)
        step = self.node.cfg.chunk_bytes

        async def gen() -> AsyncIterator[pb.PushChunk]:
            view = memoryview(payload)
            yield pb.PushChunk(header=wire_header, data=bytes(view[:step]))
            for i in range(step, len(payload), step):
                yield pb.PushChunk(data=bytes(view[i:i + step]))

        async def once() -> None:
            try:
                await self._stub(endpoint).Push(gen(), timeout=remaining_s(deadline), metadata=self.node.metadata())
            except aio.AioRpcError as e:
                raise translate(e) from None
            self.node.counters.add_sent(target, len(payload))

        await self.node.retrying(once, deadline=deadline, what=f"push shard {h.shard} to {target}")

    async def contributors(self, endpoint: str, target: str, key: SessionKey, shard: int, *,
                           deadline: float) -> tuple[str, ...]:
        async def once() -> tuple[str, ...]:
            try:
                reply = await self._stub(endpoint).Contributors(
                    pb.ContributorsRequest(session=key.to_wire(), shard=shard), timeout=remaining_s(deadline),
                    metadata=self.node.metadata())
            except aio.AioRpcError as e:
                raise translate(e) from None
            return tuple(reply.contributors)

        return await self.node.retrying(once, deadline=deadline, what=f"contributors of shard {shard} from {target}")

    async def fetch(self, endpoint: str, target: str, key: SessionKey, shard: int, contributors: tuple[str, ...], *,
                    max_bytes: int, deadline: float) -> bytearray:
        """The encoded mean of `shard` over `contributors`; RpcRejected if it is bigger than `max_bytes`
        or does not add up to the size it declared."""
        request = pb.FetchRequest(session=key.to_wire(), shard=shard, contributors=list(contributors))

        async def once() -> bytearray:
            buf, received, total = bytearray(), 0, -1
            try:
                call = self._stub(endpoint).Fetch(request, timeout=remaining_s(deadline), metadata=self.node.metadata())
                async for chunk in call:
                    if total < 0:
                        total = chunk.total_bytes
                        if not 0 <= total <= max_bytes:
                            call.cancel()
                            raise _bad_reply(target, f"mean of shard {shard} declares {total} bytes, max {max_bytes}")
                        buf = bytearray(total)
                    if received + len(chunk.data) > total:
                        call.cancel()
                        raise _bad_reply(target, f"mean of shard {shard} exceeds its declared {total} bytes")
                    buf[received:received + len(chunk.data)] = chunk.data
                    received += len(chunk.data)
            except aio.AioRpcError as e:
                raise translate(e) from None
            self.node.counters.add_received(target, received)
            if received != total:
                raise _bad_reply(target, f"truncated mean of shard {shard}: {received} of {total} bytes")
            return buf

        return await self.node.retrying(once, deadline=deadline, what=f"fetch shard {shard} from {target}")


def _bad_reply(target: str, what: str) -> RpcRejected:
    log.warning("bad reply from %s: %s", target, what)
    return RpcRejected("INVALID_REPLY", what)

"""The all-reduce over gRPC: the Averaging servicer (adapts a ReducerSink) and its client calls."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from swarmtrain.rpc import frames
from swarmtrain.rpc.node import Rejected, RpcNode, RpcRejected, peer_of, remaining_s, status_of, translate
from swarmtrain.wire import averaging_pb2 as pb
from swarmtrain.wire import averaging_pb2_grpc as pb_grpc

_SERVICE = "swarmtrain.wire.Averaging"

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

    async def Push(self, request_iterator: AsyncIterator[bytes], context: aio.ServicerContext) -> pb.PushReply:
        """Chunks arrive as raw PushChunk bytes (see frames.py): the payload is copied once, into `buf`."""
        peer = peer_of(context)
        header: PushHeader | None = None
        buf = bytearray()
        received = 0
        try:
            async for raw in request_iterator:
                wire_header, data = _push_fields(raw)
                if header is None:
                    if wire_header is None:
                        raise Rejected("the first chunk of a push carries no header")
                    h = wire_header
                    header = PushHeader(SessionKey.from_wire(h.session), h.sender, h.shard, h.numel,
                                        h.total_bytes, h.codec)
                    limit = await self.sink.check_push(header, peer=peer)
                    if not 0 <= header.total_bytes <= limit:
                        raise Rejected(f"push declares {header.total_bytes} bytes; at most {limit} allowed for "
                                       f"{header.numel} values", kind="too_large")
                    buf = bytearray(header.total_bytes)
                elif wire_header is not None:
                    raise Rejected("a push carries a second header")
                n = len(data)
                if received + n > header.total_bytes:
                    raise Rejected(f"push carries more than the {header.total_bytes} bytes it declared",
                                   kind="too_large")
                buf[received:received + n] = data
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

    async def Fetch(self, request: pb.FetchRequest, context: aio.ServicerContext) -> AsyncIterator[bytes]:
        peer = peer_of(context)
        try:
            data = await self.sink.mean(SessionKey.from_wire(request.session), request.shard,
                                        tuple(request.contributors), peer=peer)
        except Rejected as e:
            await self._reject(context, "Fetch", peer, e)
            return
        step, view = self.node.cfg.chunk_bytes, memoryview(data)
        yield frames.frame(frames.encode_varint_field(1, len(data)), 2, view[:step])  # FetchChunk
        for start in range(step, len(data), step):
            yield frames.frame(b"", 2, view[start:start + step])
        self.node.counters.add_sent(peer, len(data))


def _push_fields(raw: bytes) -> tuple[pb.PushHeader | None, memoryview]:
    header, data = None, memoryview(b"")
    try:
        for number, value in frames.fields(raw):
            if number == 1 and isinstance(value, memoryview):
                header = pb.PushHeader.FromString(value)
            elif number == 2 and isinstance(value, memoryview):
                data = value
            else:
                raise Rejected(f"unexpected field {number} in a push chunk")
    except (frames.FrameError, DecodeError) as e:
        raise Rejected(f"malformed push chunk: {e}") from None
    return header, data


def serve_averaging(node: RpcNode, sink: ReducerSink) -> None:
    """Register the Averaging service backed by `sink` on `node` (before `node.start()`).

    Same service and messages as averaging.proto; Push requests and Fetch replies bypass the
    protobuf runtime (raw bytes, frames.py) to save two payload copies per side."""
    servicer = _Servicer(node, sink)
    handler = grpc.method_handlers_generic_handler(_SERVICE, {
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push, request_deserializer=None, response_serializer=pb.PushReply.SerializeToString),
        "Contributors": grpc.unary_unary_rpc_method_handler(
            servicer.Contributors, request_deserializer=pb.ContributorsRequest.FromString,
            response_serializer=pb.ContributorsReply.SerializeToString),
        "Fetch": grpc.unary_stream_rpc_method_handler(
            servicer.Fetch, request_deserializer=pb.FetchRequest.FromString, response_serializer=None),
    })
    node.add_service(lambda server: server.add_generic_rpc_handlers((handler,)))


class AveragingClient:
    """Client calls of the all-reduce; run them on the node's loop. Every call has a deadline; errors are
    RpcUnavailable / RpcTimeout / RpcRejected."""

    def __init__(self, node: RpcNode) -> None:
        self.node = node
        self._stubs: dict[str, _Stub] = {}

    def _stub(self, endpoint: str) -> _Stub:
        stub = self._stubs.get(endpoint)
        if stub is None:
            stub = self._stubs[endpoint] = _Stub(self.node.channel(endpoint))
        return stub

    async def push(self, endpoint: str, target: str, header: PushHeader, payload: bytes, *, deadline: float) -> None:
        """Stream `payload` (its size may differ from header.total_bytes only under fault injection)."""
        h = header
        wire_header = pb.PushHeader(session=h.session.to_wire(), sender=h.sender, shard=h.shard, numel=h.numel,
                                    total_bytes=h.total_bytes, codec=h.codec).SerializeToString()
        first_prefix = frames.encode_bytes_field(1, len(wire_header)) + wire_header
        step = self.node.cfg.chunk_bytes

        async def gen() -> AsyncIterator[bytes]:  # raw PushChunk messages (frames.py)
            view = memoryview(payload)
            yield frames.frame(first_prefix, 2, view[:step])
            for i in range(step, len(payload), step):
                yield frames.frame(b"", 2, view[i:i + step])

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
                async for raw in call:
                    chunk_total, data = _fetch_fields(raw, target)
                    if total < 0:
                        total = chunk_total
                        if not 0 <= total <= max_bytes:
                            call.cancel()
                            raise _bad_reply(target, f"mean of shard {shard} declares {total} bytes, max {max_bytes}")
                        buf = bytearray(total)
                    if received + len(data) > total:
                        call.cancel()
                        raise _bad_reply(target, f"mean of shard {shard} exceeds its declared {total} bytes")
                    buf[received:received + len(data)] = data
                    received += len(data)
            except aio.AioRpcError as e:
                raise translate(e) from None
            self.node.counters.add_received(target, received)
            if received != total:
                raise _bad_reply(target, f"truncated mean of shard {shard}: {received} of {total} bytes")
            return buf

        return await self.node.retrying(once, deadline=deadline, what=f"fetch shard {shard} from {target}")


class _Stub:
    """Multi-callables of the Averaging service; Push requests and Fetch replies travel as raw bytes."""

    def __init__(self, channel: aio.Channel) -> None:
        self.Push = channel.stream_unary(f"/{_SERVICE}/Push", request_serializer=None,
                                         response_deserializer=pb.PushReply.FromString)
        self.Contributors = channel.unary_unary(f"/{_SERVICE}/Contributors",
                                                request_serializer=pb.ContributorsRequest.SerializeToString,
                                                response_deserializer=pb.ContributorsReply.FromString)
        self.Fetch = channel.unary_stream(f"/{_SERVICE}/Fetch", request_serializer=pb.FetchRequest.SerializeToString,
                                          response_deserializer=None)


def _fetch_fields(raw: bytes, target: str) -> tuple[int, memoryview]:
    total, data = -1, memoryview(b"")
    try:
        for number, value in frames.fields(raw):
            if number == 1 and isinstance(value, int):
                total = value
            elif number == 2 and isinstance(value, memoryview):
                data = value
            else:
                raise frames.FrameError(f"unexpected field {number}")
    except frames.FrameError as e:
        raise _bad_reply(target, f"malformed fetch chunk: {e}") from None
    return total, data


def _bad_reply(target: str, what: str) -> RpcRejected:
    log.warning("bad reply from %s: %s", target, what)
    return RpcRejected("INVALID_REPLY", what)

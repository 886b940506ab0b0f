"""The all-reduce's service: session and push types, the ReducerSink protocol, and the Averaging servicer.

Push and Fetch stream the payload through gRPC; PushTicket and FetchTicket validate the same
requests and hand out tickets for the bulk port (bulk.py), which moves the bytes without gRPC's copies.
The client calls are in averaging_client.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc import aio

from swarmtrain.rpc import frames
from swarmtrain.rpc.node import Rejected, RpcNode, peer_of, status_of
from swarmtrain.rpc.payload_macs import mac_of, mac_ok
from swarmtrain.trust.payloads import MAC_BYTES
from swarmtrain.wire import averaging_pb2 as pb
from swarmtrain.wire import averaging_pb2_grpc as pb_grpc

SERVICE = "swarmtrain.wire.Averaging"

__all__ = ["SERVICE", "PushHeader", "ReducerSink", "SessionKey", "serve_averaging"]

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

    async def accept_push(self, header: PushHeader, payload: bytes | bytearray | memoryview, *, peer: str) -> None:
        """Take a checked push's bytes: `payload` is the sink's to keep (memory nobody else writes; pooled memory
        goes back by itself once dropped)."""
        ...

    async def contributors(self, key: SessionKey, shard: int, *, peer: str) -> tuple[str, ...]: ...

    async def mean(self, key: SessionKey, shard: int, contributors: tuple[str, ...], *,
                   peer: str) -> bytes | bytearray | memoryview: ...

    async def delivered(self, key: SessionKey, shard: int, *, peer: str) -> None:
        """`peer` has received the whole mean of `shard` (a leaving reducer waits for this)."""
        ...


class _Servicer(pb_grpc.AveragingServicer):
    def __init__(self, node: RpcNode, sink: ReducerSink) -> None:
        self.node = node
        self.sink = sink

    def _deadline(self, context: aio.ServicerContext) -> float:
        """The asking call's deadline (time.monotonic()): a ticket is good for as long as its caller waits."""
        left_s = context.time_remaining()
        return time.monotonic() + (left_s if left_s is not None else self.node.cfg.call_timeout_s)

    async def _reject(self, context: aio.ServicerContext, method: str, peer: str, err: Rejected) -> None:
        log.warning("%s rejected %s from %s: %s", self.node.peer_id, method, peer, err)
        await context.abort(status_of(err), str(err))

    async def Push(self, request_iterator: AsyncIterator[bytes], context: aio.ServicerContext) -> pb.PushReply:
        """Chunks arrive as raw PushChunk bytes (see frames.py): the payload is copied once, into `buf`."""
        peer = peer_of(context)
        header: PushHeader | None = None
        header_bytes, mac = b"", b""
        buf = bytearray()
        received = 0
        try:
            async for raw in request_iterator:
                if mac:
                    raise Rejected("a push goes on after its MAC")
                wire_header, data, mac = _push_fields(raw)
                if header is None:
                    if wire_header is None:
                        raise Rejected("the first chunk of a push carries no header")
                    header_bytes = wire_header
                    h = _parsed(pb.PushHeader, wire_header)
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
            if not mac or not await mac_ok(self.node.secret.payloads, mac, b"push", header_bytes, buf):
                raise Rejected("the push's MAC is missing or wrong (altered on the way?)")
            await self.sink.accept_push(header, buf, peer=peer)
        except Rejected as e:
            await self._reject(context, "Push", peer, e)
        return pb.PushReply(received_bytes=received)

    async def Contributors(self, raw: bytes, context: aio.ServicerContext) -> pb.ContributorsReply:
        peer = peer_of(context)
        try:
            request = _parsed(pb.ContributorsRequest, raw)
            names = await self.sink.contributors(SessionKey.from_wire(request.session), request.shard, peer=peer)
        except Rejected as e:
            await self._reject(context, "Contributors", peer, e)
            raise AssertionError("unreachable") from e
        return pb.ContributorsReply(contributors=list(names))

    async def Fetch(self, raw: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
        peer = peer_of(context)
        try:
            request = _parsed(pb.FetchRequest, raw)
            data = await self.sink.mean(SessionKey.from_wire(request.session), request.shard,
                                        tuple(request.contributors), peer=peer)
        except Rejected as e:
            await self._reject(context, "Fetch", peer, e)
            return
        mac = asyncio.ensure_future(mac_of(self.node.secret.payloads, b"mean", raw, data))  # hashed while it streams
        step, view = self.node.cfg.chunk_bytes, memoryview(data)
        starts = range(0, max(len(data), 1), step)
        try:
            for start in starts:  # FetchChunk messages: the total in the first, the MAC in the last
                prefix = frames.encode_varint_field(1, len(data)) if start == 0 else b""
                if start == starts[-1]:
                    prefix += frames.encode_bytes_field(3, MAC_BYTES) + await mac
                yield frames.frame(prefix, 2, view[start:start + step])
        finally:
            await asyncio.wait({mac})
        self.node.counters.add_sent(peer, len(data))
        await self.sink.delivered(SessionKey.from_wire(request.session), request.shard, peer=peer)

    async def PushTicket(self, raw: bytes, context: aio.ServicerContext) -> pb.BulkTicket:
        """Push's checks up front, then a ticket to send exactly the declared bytes to the bulk port."""
        peer = peer_of(context)
        try:
            r = _parsed(pb.PushHeader, raw)
            header = PushHeader(SessionKey.from_wire(r.session), r.sender, r.shard, r.numel, r.total_bytes, r.codec)
            limit = await self.sink.check_push(header, peer=peer)
            if not 0 <= header.total_bytes <= limit:
                raise Rejected(f"push declares {header.total_bytes} bytes; at most {limit} allowed for "
                               f"{header.numel} values", kind="too_large")
            if self.node.bulk is None:
                return pb.BulkTicket(port=0, total_bytes=header.total_bytes)  # this peer takes Push only

            async def consume(payload: memoryview) -> None:
                await self.sink.accept_push(header, payload, peer=peer)

            token = self.node.bulk.expect_upload(peer=peer, what=f"push of shard {header.shard}", consume=consume,
                                                 size_bytes=header.total_bytes, deadline=self._deadline(context))
        except Rejected as e:
            await self._reject(context, "PushTicket", peer, e)
            raise AssertionError("unreachable") from e
        return pb.BulkTicket(token=token, port=self.node.bulk.port, total_bytes=header.total_bytes)

    async def FetchTicket(self, raw: bytes, context: aio.ServicerContext) -> pb.BulkTicket:
        """Fetch's mean, offered once on the bulk port."""
        peer = peer_of(context)
        try:
            request = _parsed(pb.FetchRequest, raw)
            key = SessionKey.from_wire(request.session)
            data = await self.sink.mean(key, request.shard, tuple(request.contributors), peer=peer)
            if self.node.bulk is None:
                return pb.BulkTicket(port=0, total_bytes=len(data))  # this peer serves Fetch only

            async def sent() -> None:
                await self.sink.delivered(key, request.shard, peer=peer)

            token = self.node.bulk.offer_download(peer=peer, what=f"mean of shard {request.shard}", data=data,
                                                  deadline=self._deadline(context), on_sent=sent)
        except Rejected as e:
            await self._reject(context, "FetchTicket", peer, e)
            raise AssertionError("unreachable") from e
        return pb.BulkTicket(token=token, port=self.node.bulk.port, total_bytes=len(data))


M = TypeVar("M", bound=Message)


def _parsed(cls: type[M], raw: bytes) -> M:
    """A request message from its bytes, or Rejected (INVALID_ARGUMENT) naming what is malformed: the
    handlers take raw bytes so that garbage is refused like any bad request, not by gRPC's runtime (an
    UNKNOWN status and a traceback in the log per request)."""
    try:
        return cls.FromString(raw)
    except DecodeError as e:
        raise Rejected(f"malformed {cls.DESCRIPTOR.name}: {e}") from None


def _push_fields(raw: bytes) -> tuple[bytes | None, memoryview, bytes]:
    """(the header's bytes if this chunk has one, its data, its MAC if it is the last chunk)."""
    header, data, mac = None, memoryview(b""), b""
    try:
        for number, value in frames.fields(raw):
            if number == 1 and isinstance(value, memoryview):
                header = bytes(value)
            elif number == 2 and isinstance(value, memoryview):
                data = value
            elif number == 3 and isinstance(value, memoryview) and len(value) == MAC_BYTES:
                mac = bytes(value)
            else:
                raise Rejected(f"unexpected field {number} in a push chunk")
    except frames.FrameError as e:
        raise Rejected(f"malformed push chunk: {e}") from None
    return header, data, mac


def serve_averaging(node: RpcNode, sink: ReducerSink) -> None:
    """Register the Averaging service backed by `sink` on `node` (before `node.start()`).

    Same service and messages as averaging.proto; Push requests and Fetch replies bypass the
    protobuf runtime (raw bytes, frames.py) to save two payload copies per side."""
    servicer = _Servicer(node, sink)
    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push, request_deserializer=None, response_serializer=pb.PushReply.SerializeToString),
        "Contributors": grpc.unary_unary_rpc_method_handler(
            servicer.Contributors, request_deserializer=None,
            response_serializer=pb.ContributorsReply.SerializeToString),
        "Fetch": grpc.unary_stream_rpc_method_handler(
            servicer.Fetch, request_deserializer=None, response_serializer=None),
        "PushTicket": grpc.unary_unary_rpc_method_handler(
            servicer.PushTicket, request_deserializer=None,
            response_serializer=pb.BulkTicket.SerializeToString),
        "FetchTicket": grpc.unary_unary_rpc_method_handler(
            servicer.FetchTicket, request_deserializer=None,
            response_serializer=pb.BulkTicket.SerializeToString),
    })
    node.add_service(lambda server: server.add_generic_rpc_handlers((handler,)))

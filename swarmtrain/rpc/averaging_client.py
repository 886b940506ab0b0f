"""The all-reduce's client calls: push a shard, ask for contributors, fetch a mean (bulk port or gRPC stream)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from grpc import aio

from swarmtrain.rpc import bulk, frames
from swarmtrain.rpc.averaging_wire import SERVICE, PushHeader, SessionKey
from swarmtrain.rpc.node import RpcNode, RpcRejected, remaining_s, translate
from swarmtrain.rpc.payload_macs import mac_of, mac_ok
from swarmtrain.trust.payloads import MAC_BYTES
from swarmtrain.wire import averaging_pb2 as pb

__all__ = ["AveragingClient"]

log = logging.getLogger(__name__)


class AveragingClient:
    """Client calls of the all-reduce; run them on the node's loop. Every call has a deadline; errors are
    RpcUnavailable / RpcTimeout / RpcRejected.

    With `rpc.bulk_transport = "tcp"` a push or fetch asks the reducer for a ticket and moves the
    bytes over its bulk port; a reducer that answers port 0 (it serves gRPC only) gets the Push /
    Fetch stream instead. Either way the whole exchange is one attempt of `node.retrying`."""

    def __init__(self, node: RpcNode) -> None:
        self.node = node
        self._stubs: dict[str, _Stub] = {}

    def _stub(self, endpoint: str) -> _Stub:
        stub = self._stubs.get(endpoint)
        if stub is None:
            stub = self._stubs[endpoint] = _Stub(self.node.channel(endpoint))
        return stub

    def _meta(self, endpoint: str, method: str) -> tuple[tuple[str, str], ...]:
        return self.node.metadata(f"/{SERVICE}/{method}", endpoint)

    @property
    def _bulk(self) -> bool:
        return self.node.cfg.bulk_transport == "tcp"

    async def _ticket(self, method: str, endpoint: str, request: pb.PushHeader | pb.FetchRequest,
                      deadline: float) -> pb.BulkTicket:
        name = "PushTicket" if method == "push" else "FetchTicket"
        call = self._stub(endpoint).PushTicket if method == "push" else self._stub(endpoint).FetchTicket
        try:
            ticket: pb.BulkTicket = await call(request, timeout=remaining_s(deadline),
                                               metadata=self._meta(endpoint, name))
        except aio.AioRpcError as e:
            raise translate(e) from None
        return ticket

    async def push(self, endpoint: str, target: str, header: PushHeader, payload: bytes | bytearray | memoryview, *,
                   deadline: float) -> None:
        """Send `payload` (its size may differ from header.total_bytes only under fault injection)."""
        h = header
        wire_header = pb.PushHeader(session=h.session.to_wire(), sender=h.sender, shard=h.shard, numel=h.numel,
                                    total_bytes=h.total_bytes, codec=h.codec)

        async def once() -> None:
            if self._bulk:
                ticket = await self._ticket("push", endpoint, wire_header, deadline)
                if ticket.port:
                    proof = self.node.ticket_proof(ticket.token)
                    await bulk.upload(bulk.host_of(endpoint), ticket.port, ticket.token, proof, payload,
                                      mac_key=self.node.secret.payloads, deadline=deadline,
                                      what=f"push of shard {h.shard}", counters=self.node.counters, peer=target,
                                      tls=self.node.bulk_tls)
                    return
            await self._grpc_push(endpoint, target, wire_header.SerializeToString(), payload, deadline=deadline)

        await self.node.retrying(once, endpoint=endpoint, deadline=deadline, what=f"push shard {h.shard} to {target}")

    async def _grpc_push(self, endpoint: str, target: str, wire_header: bytes,
                         payload: bytes | bytearray | memoryview, *, deadline: float) -> None:
        first_prefix = frames.encode_bytes_field(1, len(wire_header)) + wire_header
        step = self.node.cfg.chunk_bytes
        mac = await mac_of(self.node.secret.payloads, b"push", wire_header, payload)

        async def gen() -> AsyncIterator[bytes]:  # raw PushChunk messages (frames.py); the MAC rides in the last
            view = memoryview(payload)
            starts = range(0, max(len(payload), 1), step)
            for i in starts:
                prefix = first_prefix if i == 0 else b""
                if i == starts[-1]:  # in the same message as the last bytes: no extra message to race an abort
                    prefix += frames.encode_bytes_field(3, len(mac)) + mac
                yield frames.frame(prefix, 2, view[i:i + step])

        try:
            await self._stub(endpoint).Push(gen(), timeout=remaining_s(deadline), metadata=self._meta(endpoint, "Push"))
        except aio.AioRpcError as e:
            raise translate(e) from None
        self.node.counters.add_sent(target, len(payload))

    async def contributors(self, endpoint: str, target: str, key: SessionKey, shard: int, *,
                           deadline: float) -> tuple[str, ...]:
        async def once() -> tuple[str, ...]:
            try:
                reply = await self._stub(endpoint).Contributors(
                    pb.ContributorsRequest(session=key.to_wire(), shard=shard), timeout=remaining_s(deadline),
                    metadata=self._meta(endpoint, "Contributors"))
            except aio.AioRpcError as e:
                raise translate(e) from None
            return tuple(reply.contributors)

        return await self.node.retrying(once, endpoint=endpoint, deadline=deadline,
                                        what=f"contributors of shard {shard} from {target}")

    async def fetch(self, endpoint: str, target: str, key: SessionKey, shard: int, contributors: tuple[str, ...], *,
                    max_bytes: int, deadline: float) -> tuple[bytearray | memoryview, bytes]:
        """The encoded mean of `shard` over `contributors` (the caller's memory) and, from the bulk port, its
        digest (trust/payloads.payload_digest; b"" from a gRPC stream); RpcRejected if it is bigger than
        `max_bytes` or does not add up to the size it declared."""
        request = pb.FetchRequest(session=key.to_wire(), shard=shard, contributors=list(contributors))

        async def once() -> tuple[bytearray | memoryview, bytes]:
            if self._bulk:
                ticket = await self._ticket("fetch", endpoint, request, deadline)
                if not 0 <= ticket.total_bytes <= max_bytes:
                    raise _bad_reply(target, f"mean of shard {shard} declares {ticket.total_bytes} bytes, "
                                             f"max {max_bytes}")
                if ticket.port:
                    proof = self.node.ticket_proof(ticket.token)
                    got = await bulk.download(bulk.host_of(endpoint), ticket.port, ticket.token, proof,
                                              mac_key=self.node.secret.payloads,
                                              size_bytes=ticket.total_bytes, deadline=deadline,
                                              what=f"mean of shard {shard}", counters=self.node.counters,
                                              peer=target, pool=self.node.buffers, tls=self.node.bulk_tls)
                    return got.view, got.digest
            return await self._grpc_fetch(endpoint, target, request, shard, max_bytes=max_bytes,
                                          deadline=deadline), b""

        return await self.node.retrying(once, endpoint=endpoint, deadline=deadline,
                                        what=f"fetch shard {shard} from {target}")

    async def _grpc_fetch(self, endpoint: str, target: str, request: pb.FetchRequest, shard: int, *,
                          max_bytes: int, deadline: float) -> bytearray:
        buf, received, total, mac = bytearray(), 0, -1, b""
        try:
            call = self._stub(endpoint).Fetch(request, timeout=remaining_s(deadline),
                                              metadata=self._meta(endpoint, "Fetch"))
            async for raw in call:
                if mac:
                    call.cancel()
                    raise _bad_reply(target, f"mean of shard {shard} goes on after its MAC")
                chunk_total, data, mac = _fetch_fields(raw, target)
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
        if not mac or not await mac_ok(self.node.secret.payloads, mac, b"mean", request.SerializeToString(), buf):
            raise _bad_reply(target, f"mean of shard {shard}: its MAC is missing or wrong (altered on the way?)")
        return buf


class _Stub:
    """Multi-callables of the Averaging service; Push requests and Fetch replies travel as raw bytes."""

    def __init__(self, channel: aio.Channel) -> None:
        self.Push = channel.stream_unary(f"/{SERVICE}/Push", request_serializer=None,
                                         response_deserializer=pb.PushReply.FromString)
        self.Contributors = channel.unary_unary(f"/{SERVICE}/Contributors",
                                                request_serializer=pb.ContributorsRequest.SerializeToString,
                                                response_deserializer=pb.ContributorsReply.FromString)
        self.Fetch = channel.unary_stream(f"/{SERVICE}/Fetch", request_serializer=pb.FetchRequest.SerializeToString,
                                          response_deserializer=None)
        self.PushTicket = channel.unary_unary(f"/{SERVICE}/PushTicket",
                                              request_serializer=pb.PushHeader.SerializeToString,
                                              response_deserializer=pb.BulkTicket.FromString)
        self.FetchTicket = channel.unary_unary(f"/{SERVICE}/FetchTicket",
                                               request_serializer=pb.FetchRequest.SerializeToString,
                                               response_deserializer=pb.BulkTicket.FromString)


def _fetch_fields(raw: bytes, target: str) -> tuple[int, memoryview, bytes]:
    """(the declared total, or -1 when absent; this chunk's data; the MAC, in the last chunk only)."""
    total, data, mac = -1, memoryview(b""), b""
    try:
        for number, value in frames.fields(raw):
            if number == 1 and isinstance(value, int):
                total = value
            elif number == 2 and isinstance(value, memoryview):
                data = value
            elif number == 3 and isinstance(value, memoryview) and len(value) == MAC_BYTES:
                mac = bytes(value)
            else:
                raise frames.FrameError(f"unexpected field {number}")
    except frames.FrameError as e:
        raise _bad_reply(target, f"malformed fetch chunk: {e}") from None
    return total, data, mac


def _bad_reply(target: str, what: str) -> RpcRejected:
    log.warning("bad reply from %s: %s", target, what)
    return RpcRejected("INVALID_REPLY", what)

"""The Pipeline service (proto/swarmtrain/wire/pipeline.proto): a stage server's Forward / Backward, and the
trainer's client calls. The tensors' meaning is the pipeline package's; this module moves the messages.

A tensor of at least `pipeline.bulk_min_bytes` travels over the bulk port (rpc/bulk.py) when both sides
serve one: the caller asks for an upload ticket (Upload), sends the bytes, then makes the call with
`bulk` set and no tensor; the server answers with a download ticket for the reply's tensor. The server
keeps an uploaded tensor until its call takes it or the ticket's deadline passes (at most `max_uploads`
per server); a call that names no upload is refused NOT_FOUND, and the caller sends it again."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc import aio

from swarmtrain.rpc import bulk
from swarmtrain.rpc.errors import Rejected, RpcRejected
from swarmtrain.rpc.node import RpcNode, peer_of, status_of, translate
from swarmtrain.wire import averaging_pb2 as apb
from swarmtrain.wire import pipeline_pb2 as pb

__all__ = ["SERVICE", "PipelineClient", "StageHandler", "serve_pipeline"]

log = logging.getLogger(__name__)
SERVICE = "swarmtrain.wire.Pipeline"
MAX_LOGGED_REFUSALS_PER_KIND = 1000  # past it, refusals of one kind are counted, not logged
MAX_UPLOADS = 256  # uploaded tensors a server keeps for their calls; a newer one drops the oldest
_METHODS = ("Forward", "Backward")
_MESSAGE_OVERHEAD_BYTES = 64 << 10  # a StageCall's fields besides its tensor, with room to spare
M = TypeVar("M", bound=Message)

StageHandler = Callable[[str, str, pb.StageCall], Awaitable[pb.StageReply]]
"""`handler(method, caller, call)`: method "Forward" or "Backward", the authenticated caller's peer id;
raises `Rejected` to refuse."""


class _Servicer:
    def __init__(self, node: RpcNode, handler: StageHandler, *, max_bytes: int, max_uploads: int) -> None:
        self.node = node
        self.handler = handler
        self.max_bytes = max_bytes
        self.max_uploads = max_uploads
        self.refusals: dict[str, int] = {}
        # (caller, method, micro-batch) -> (tensor, monotonic deadline): uploads waiting for their call
        self.uploads: OrderedDict[tuple[str, str, str], tuple[bytes, float]] = OrderedDict()

    def _refused(self, method: str, microbatch: str, caller: str, e: Rejected) -> None:
        n = self.refusals[e.kind] = self.refusals.get(e.kind, 0) + 1
        if n <= MAX_LOGGED_REFUSALS_PER_KIND:
            log.warning("%s refused %s of micro-batch %r from %s: %s", self.node.peer_id, method, microbatch[:128],
                        caller, e)

    async def _serve(self, method: str, raw: bytes, context: aio.ServicerContext) -> pb.StageReply:
        caller = peer_of(context)
        try:
            call = pb.StageCall.FromString(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed StageCall: {e}")
            raise  # unreachable: abort raises
        try:
            if call.bulk:
                call.tensor = self._take_upload(caller, method, call.microbatch)
            reply = await self.handler(method, caller, call)
            if call.bulk:
                data, reply.tensor = reply.tensor, b""
                deadline = time.monotonic() + max(context.time_remaining() or 0.0, 1.0)
                assert self.node.bulk is not None  # an upload needed it
                token = self.node.bulk.offer_download(peer=caller, what=f"{method} reply of {call.microbatch[:64]}",
                                                      data=data, deadline=deadline)
                reply.ticket.CopyFrom(apb.BulkTicket(token=token, port=self.node.bulk.port, total_bytes=len(data)))
            return reply
        except Rejected as e:
            self._refused(method, call.microbatch, caller, e)
            await context.abort(status_of(e), str(e))
            raise  # unreachable

    def _take_upload(self, caller: str, method: str, microbatch: str) -> bytes:
        self._expire()
        got = self.uploads.pop((caller, method, microbatch), None)
        if got is None:
            raise Rejected(f"no upload of {method} of micro-batch {microbatch[:64]} waits here (never sent, expired "
                           "or dropped)", kind="not_found")
        return got[0]

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, (_, deadline) in self.uploads.items() if deadline < now]:
            del self.uploads[key]

    async def Forward(self, raw: bytes, context: aio.ServicerContext) -> pb.StageReply:
        return await self._serve("Forward", raw, context)

    async def Backward(self, raw: bytes, context: aio.ServicerContext) -> pb.StageReply:
        return await self._serve("Backward", raw, context)

    async def Upload(self, raw: bytes, context: aio.ServicerContext) -> apb.BulkTicket:
        caller = peer_of(context)
        try:
            req = pb.StageUpload.FromString(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed StageUpload: {e}")
            raise
        try:
            if req.method not in _METHODS:
                raise Rejected(f"upload for {req.method[:32]!r}: not one of {_METHODS}", kind="invalid")
            if not 1 <= req.total_bytes <= self.max_bytes:
                raise Rejected(f"upload of {req.total_bytes} bytes: this stage takes 1..{self.max_bytes}",
                               kind="invalid")
            if self.node.bulk is None:
                return apb.BulkTicket(port=0)  # no bulk port here: send the tensor in the call
            key = (caller, req.method, req.microbatch)
            deadline = time.monotonic() + max(context.time_remaining() or 0.0, 1.0)

            async def keep(view: memoryview) -> None:
                self._expire()
                while len(self.uploads) >= self.max_uploads:
                    self.uploads.popitem(last=False)
                self.uploads[key] = (bytes(view), deadline + self.node.cfg.call_timeout_s)

            token = self.node.bulk.expect_upload(peer=caller, what=f"{req.method} input of {req.microbatch[:64]}",
                                                 size_bytes=req.total_bytes, deadline=deadline, consume=keep)
            return apb.BulkTicket(token=token, port=self.node.bulk.port, total_bytes=req.total_bytes)
        except Rejected as e:
            self._refused("Upload", req.microbatch, caller, e)
            await context.abort(status_of(e), str(e))
            raise


def serve_pipeline(node: RpcNode, handler: StageHandler, *, max_bytes: int, max_uploads: int = MAX_UPLOADS) -> None:
    """Register the Pipeline service backed by `handler` on `node` (before `node.start()`); `max_bytes`: the
    largest tensor an Upload may announce."""
    servicer = _Servicer(node, handler, max_bytes=max_bytes, max_uploads=max_uploads)
    handlers = {name: grpc.unary_unary_rpc_method_handler(
        getattr(servicer, name), request_deserializer=None, response_serializer=pb.StageReply.SerializeToString)
        for name in _METHODS}
    handlers["Upload"] = grpc.unary_unary_rpc_method_handler(
        servicer.Upload, request_deserializer=None, response_serializer=apb.BulkTicket.SerializeToString)
    node.add_service(lambda server: server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, handlers),)))


class PipelineClient:
    """Forward / Backward calls to stage servers (run on the node's loop); errors are RpcUnavailable,
    RpcTimeout or RpcRejected (with the server's status name). With `rpc.bulk_transport` "tcp" and a
    `max_bytes`, a tensor of at least `bulk_min_bytes`, or too large for `rpc.max_message_bytes`, goes
    over the server's bulk port."""

    def __init__(self, node: RpcNode, *, bulk_min_bytes: int = 0, max_bytes: int = 0) -> None:
        self.node = node
        self.max_bytes = max_bytes  # the largest reply tensor accepted over the bulk port (0 = no bulk)
        # Past this a call's message would exceed rpc.max_message_bytes: over the bulk port whatever the setting.
        fits = node.cfg.max_message_bytes - _MESSAGE_OVERHEAD_BYTES
        self.bulk_min_bytes = 0
        if node.cfg.bulk_transport == "tcp" and max_bytes:
            self.bulk_min_bytes = min(bulk_min_bytes, fits) if bulk_min_bytes else fits

    def _stub(self, endpoint: str, method: str, reply: type[M]) -> Callable[..., Awaitable[M]]:
        return self.node.channel(endpoint).unary_unary(
            f"/{SERVICE}/{method}", request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=reply.FromString)

    async def call(self, endpoint: str, method: str, call: pb.StageCall, *, timeout_s: float) -> pb.StageReply:
        deadline = time.monotonic() + timeout_s
        try:
            if self.bulk_min_bytes and len(call.tensor) >= self.bulk_min_bytes:
                sent = await self._upload(endpoint, method, call, deadline)
                if sent:
                    return await self._bulk_call(endpoint, method, call, deadline)
            reply: pb.StageReply = await self._stub(endpoint, method, pb.StageReply)(
                call, timeout=max(deadline - time.monotonic(), 1e-3),
                metadata=self.node.metadata(f"/{SERVICE}/{method}", endpoint))
        except aio.AioRpcError as e:
            raise translate(e) from None
        self.node.counters.add_sent(endpoint, len(call.tensor))
        self.node.counters.add_received(endpoint, len(reply.tensor))
        return reply

    async def _upload(self, endpoint: str, method: str, call: pb.StageCall, deadline: float) -> bool:
        """Send `call`'s tensor over the server's bulk port; False when it has none (send it in the call)."""
        req = pb.StageUpload(stage=call.stage, microbatch=call.microbatch, method=method, total_bytes=len(call.tensor))
        ticket: apb.BulkTicket = await self._stub(endpoint, "Upload", apb.BulkTicket)(
            req, timeout=max(deadline - time.monotonic(), 1e-3),
            metadata=self.node.metadata(f"/{SERVICE}/Upload", endpoint))
        if not ticket.port:
            return False
        await bulk.upload(bulk.host_of(endpoint), ticket.port, ticket.token, self.node.ticket_proof(ticket.token),
                          call.tensor, mac_key=self.node.secret.payloads, deadline=deadline,
                          what=f"{method} input of {call.microbatch[:64]}", counters=self.node.counters,
                          peer=endpoint, tls=self.node.bulk_tls)
        return True

    async def _bulk_call(self, endpoint: str, method: str, call: pb.StageCall, deadline: float) -> pb.StageReply:
        header = pb.StageCall()
        header.CopyFrom(call)
        header.tensor, header.bulk = b"", True
        reply: pb.StageReply = await self._stub(endpoint, method, pb.StageReply)(
            header, timeout=max(deadline - time.monotonic(), 1e-3),
            metadata=self.node.metadata(f"/{SERVICE}/{method}", endpoint))
        t = reply.ticket
        if not t.port or not 1 <= t.total_bytes <= self.max_bytes:
            raise RpcRejected("INVALID_REPLY", f"{method} reply of {endpoint} for a bulk call offers {t.total_bytes} "
                                               f"bytes on port {t.port} (at most {self.max_bytes})")
        got = await bulk.download(bulk.host_of(endpoint), t.port, t.token, self.node.ticket_proof(t.token),
                                  mac_key=self.node.secret.payloads, size_bytes=t.total_bytes, deadline=deadline,
                                  what=f"{method} reply of {call.microbatch[:64]}", counters=self.node.counters,
                                  peer=endpoint, pool=self.node.buffers, tls=self.node.bulk_tls)
        reply.tensor = bytes(got.view)  # the pooled memory goes back once `got` is dropped
        reply.ClearField("ticket")
        return reply

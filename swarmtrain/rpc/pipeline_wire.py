"""The Pipeline service (proto/swarmtrain/wire/pipeline.proto): a stage server's Forward / Backward, and the
trainer's client calls. The tensors' meaning is the pipeline package's; this module moves the messages."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from swarmtrain.rpc.errors import Rejected
from swarmtrain.rpc.node import RpcNode, peer_of, status_of, translate
from swarmtrain.wire import pipeline_pb2 as pb

__all__ = ["SERVICE", "PipelineClient", "StageHandler", "serve_pipeline"]

log = logging.getLogger(__name__)
SERVICE = "swarmtrain.wire.Pipeline"
MAX_LOGGED_REFUSALS_PER_KIND = 1000  # past it, refusals of one kind are counted, not logged

StageHandler = Callable[[str, str, pb.StageCall], Awaitable[pb.StageReply]]
"""`handler(method, caller, call)`: method "Forward" or "Backward", the authenticated caller's peer id;
raises `Rejected` to refuse."""


class _Servicer:
    def __init__(self, node: RpcNode, handler: StageHandler) -> None:
        self.node = node
        self.handler = handler
        self.refusals: dict[str, int] = {}

    async def _serve(self, method: str, raw: bytes, context: aio.ServicerContext) -> pb.StageReply:
        caller = peer_of(context)
        try:
            call = pb.StageCall.FromString(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed StageCall: {e}")
            raise  # unreachable: abort raises
        try:
            return await self.handler(method, caller, call)
        except Rejected as e:
            n = self.refusals[e.kind] = self.refusals.get(e.kind, 0) + 1
            if n <= MAX_LOGGED_REFUSALS_PER_KIND:
                log.warning("%s refused %s of micro-batch %r from %s: %s", self.node.peer_id, method,
                            call.microbatch[:128], caller, e)
            await context.abort(status_of(e), str(e))
            raise  # unreachable

    async def Forward(self, raw: bytes, context: aio.ServicerContext) -> pb.StageReply:
        return await self._serve("Forward", raw, context)

    async def Backward(self, raw: bytes, context: aio.ServicerContext) -> pb.StageReply:
        return await self._serve("Backward", raw, context)


def serve_pipeline(node: RpcNode, handler: StageHandler) -> None:
    """Register the Pipeline service backed by `handler` on `node` (before `node.start()`)."""
    servicer = _Servicer(node, handler)
    handlers = {name: grpc.unary_unary_rpc_method_handler(
        getattr(servicer, name), request_deserializer=None, response_serializer=pb.StageReply.SerializeToString)
        for name in ("Forward", "Backward")}
    node.add_service(lambda server: server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, handlers),)))


class PipelineClient:
    """Forward / Backward calls to stage servers (run on the node's loop); errors are RpcUnavailable,
    RpcTimeout or RpcRejected (with the server's status name)."""

    def __init__(self, node: RpcNode) -> None:
        self.node = node

    async def call(self, endpoint: str, method: str, call: pb.StageCall, *, timeout_s: float) -> pb.StageReply:
        rpc = self.node.channel(endpoint).unary_unary(
            f"/{SERVICE}/{method}", request_serializer=pb.StageCall.SerializeToString,
            response_deserializer=pb.StageReply.FromString)
        try:
            reply: pb.StageReply = await rpc(call, timeout=timeout_s,
                                             metadata=self.node.metadata(f"/{SERVICE}/{method}", endpoint))
        except aio.AioRpcError as e:
            raise translate(e) from None
        self.node.counters.add_sent(endpoint, len(call.tensor))
        self.node.counters.add_received(endpoint, len(reply.tensor))
        return reply

"""State transfer over gRPC: the StateTransfer servicer (serves the newest published blob) and its client."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from swarmtrain.rpc.node import RpcNode, RpcRejected, peer_of, remaining_s, translate
from swarmtrain.trust import payload_mac
from swarmtrain.wire import sync_pb2 as pb
from swarmtrain.wire import sync_pb2_grpc as pb_grpc

__all__ = ["StateBlob", "StateClient", "StateRange", "StateSource", "serve_state"]

log = logging.getLogger(__name__)
GET_STATE = "/swarmtrain.wire.StateTransfer/GetState"  # the full method name a call's proof covers


@dataclass(frozen=True)
class StateBlob:
    """An immutable, serialized committed state: what one GetState call streams."""

    run_id: str
    round: int
    config_json: str
    blob: bytes | bytearray | memoryview
    sha256: bytes


class StateSource(Protocol):
    def current(self) -> StateBlob | None:
        """The committed state to stream, or None before there is one. Blocking (it may serialize the
        state first): called off the event loop."""
        ...


class StateServicer:
    """The StateTransfer service of one node: streams `source`'s current blob, or a range of it."""

    def __init__(self, node: RpcNode, source: StateSource) -> None:
        self.node = node
        self.source = source

    async def GetState(self, raw: bytes, context: aio.ServicerContext) -> AsyncIterator[pb.StateChunk]:
        peer = peer_of(context)
        try:
            request = pb.StateRequest.FromString(raw)
        except DecodeError as e:  # refused like any bad request, not by gRPC's runtime (UNKNOWN and a traceback)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed StateRequest: {e}")
            return
        state = await asyncio.to_thread(self.source.current)  # one immutable object: never a half-updated state
        if state is None or state.run_id != request.run_id:
            why = "no committed state yet" if state is None else f"this peer is in run {state.run_id!r}"
            log.warning("%s refused GetState from %s: %s", self.node.peer_id, peer, why)
            await context.abort(grpc.StatusCode.NOT_FOUND if state is None else grpc.StatusCode.FAILED_PRECONDITION,
                                why)
            return
        blob = state.blob
        length = request.length or len(blob) - request.offset
        if request.offset < 0 or length < 0 or request.offset + length > len(blob):
            why = f"range [{request.offset}, +{request.length}) is outside the {len(blob)}-byte state"
            log.warning("%s refused GetState from %s: %s", self.node.peer_id, peer, why)
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, why)
            return
        header = pb.StateHeader(run_id=state.run_id, round=state.round, config_json=state.config_json,
                                total_bytes=len(state.blob), sha256=state.sha256)
        header.mac = _header_mac(self.node, header)
        if request.header_only:
            yield pb.StateChunk(header=header)
            return
        step, view = self.node.cfg.chunk_bytes, memoryview(blob)[request.offset:request.offset + length]
        yield pb.StateChunk(header=header, data=bytes(view[:step]))
        for start in range(step, len(view), step):
            yield pb.StateChunk(data=bytes(view[start:start + step]))
        self.node.counters.add_sent(peer, len(view))
        log.info("%s served round-%d state (%d of %d B) to %s", self.node.peer_id, state.round, len(view), len(blob),
                 peer)


def _header_mac(node: RpcNode, header: pb.StateHeader) -> bytes:
    return payload_mac(node.secret.payloads, b"state", header.run_id, header.round, header.config_json,
                       header.total_bytes, header.sha256)


def serve_state(node: RpcNode, source: StateSource) -> None:
    """Register the StateTransfer service backed by `source` on `node` (before `node.start()`)."""
    register_state_servicer(node, StateServicer(node, source))


def register_state_servicer(node: RpcNode, servicer: StateServicer) -> None:
    """Register `servicer` (a StateServicer, or one that wraps its answers: a test's faults) on `node`."""
    handler = grpc.method_handlers_generic_handler("swarmtrain.wire.StateTransfer", {
        "GetState": grpc.unary_stream_rpc_method_handler(
            servicer.GetState, request_deserializer=None, response_serializer=pb.StateChunk.SerializeToString)})
    node.add_service(lambda server: server.add_generic_rpc_handlers((handler,)))


@dataclass(frozen=True)
class StateRange:
    """Part of a donor's state: its header (of the whole blob) and `data`, bytes [offset, offset + len(data))."""

    header: pb.StateHeader
    offset: int
    data: bytes | bytearray | memoryview


class StateClient:
    """Downloads a peer's state blob, or a range of it (run on the node's loop); checks sizes, not content."""

    def __init__(self, node: RpcNode) -> None:
        self.node = node

    async def get_state(self, endpoint: str, *, run_id: str, max_bytes: int, deadline: float) -> StateBlob:
        """The whole blob `endpoint` serves."""
        part = await self.get_range(endpoint, run_id=run_id, max_bytes=max_bytes, deadline=deadline)
        h = part.header
        return StateBlob(h.run_id, h.round, h.config_json, part.data, bytes(h.sha256))

    async def get_range(self, endpoint: str, *, run_id: str, max_bytes: int, deadline: float, offset: int = 0,
                        length: int | None = None, into: memoryview | None = None,
                        header_only: bool = False) -> StateRange:
        """Bytes [offset, offset + length) of the blob `endpoint` serves (to its end when `length` is None),
        written into `into` when given (exactly `length` bytes), with the blob's header, whose MAC is
        checked. `header_only`: the header alone (data empty)."""
        stub = pb_grpc.StateTransferStub(self.node.channel(endpoint))
        request = pb.StateRequest(run_id=run_id, offset=offset, length=length or 0, header_only=header_only)

        async def once() -> StateRange:
            header: pb.StateHeader | None = None
            buf, want, received = into, 0, 0
            try:
                call = stub.GetState(request, timeout=remaining_s(deadline),
                                     metadata=self.node.metadata(GET_STATE, endpoint))
                async for chunk in call:
                    if header is None:
                        header = chunk.header
                        want = self._check_header(call, header, offset=offset, length=length, max_bytes=max_bytes)
                        if header_only:
                            call.cancel()
                            return StateRange(header, offset, b"")
                        if buf is None:
                            buf = memoryview(bytearray(want))
                        elif len(buf) != want:
                            call.cancel()
                            raise ValueError(f"get_range: {len(buf)}-byte buffer for a {want}-byte range")
                    assert buf is not None
                    if received + len(chunk.data) > want:
                        call.cancel()
                        raise RpcRejected("INVALID_REPLY", f"state range exceeds its {want} bytes")
                    buf[received:received + len(chunk.data)] = chunk.data
                    received += len(chunk.data)
            except aio.AioRpcError as e:
                raise translate(e) from None
            if header is None or received != want or buf is None:
                raise RpcRejected("INVALID_REPLY", f"truncated state: {received} of {want if header else '?'} bytes")
            self.node.counters.add_received(endpoint, received)
            return StateRange(header, offset, buf if into is not None else buf.obj)  # type: ignore[arg-type]

        return await self.node.retrying(once, endpoint=endpoint, deadline=deadline, what=f"state from {endpoint}")

    def _check_header(self, call: aio.UnaryStreamCall, header: pb.StateHeader, *, offset: int, length: int | None,
                      max_bytes: int) -> int:
        """The bytes the range will hold; RpcRejected for a header altered on the way or over the limit."""
        if not hmac.compare_digest(header.mac, _header_mac(self.node, header)):
            call.cancel()
            raise RpcRejected("INVALID_REPLY", "the state header's MAC is wrong: altered on the way, or served by a "
                                               "peer without the run key")
        if not 0 <= header.total_bytes <= max_bytes:
            call.cancel()
            raise RpcRejected("INVALID_REPLY", f"state of {header.total_bytes} bytes exceeds the "
                                               f"{max_bytes}-byte limit")
        want = header.total_bytes - offset if length is None else length
        if offset < 0 or want < 0 or offset + want > header.total_bytes:
            call.cancel()
            raise RpcRejected("INVALID_REPLY", f"range [{offset}, +{want}) is outside the {header.total_bytes}-byte "
                                               "state its donor declares")
        return want

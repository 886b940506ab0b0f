"""Gossip parts over gRPC: the Gossip servicer (a mailbox of this peer's newest rounds) and its client.

A peer publishes its part of a round (its encoded Δ and φ) once it has trained the round; a partner's
GetPart for that round streams it, MACed under the run's payload key. A call for a round this peer has
not reached waits for it, until the call's own deadline: the partner decides how long it waits
(`averaging.gossip_timeout_s`), never this peer. Rounds older than the newest `keep` are gone (NOT_FOUND).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from swarmtrain.rpc.node import RpcNode, RpcRejected, peer_of, remaining_s, translate
from swarmtrain.rpc.payload_macs import mac_of, mac_ok
from swarmtrain.wire import gossip_pb2 as pb
from swarmtrain.wire import gossip_pb2_grpc as pb_grpc

__all__ = ["GET_PART", "GossipClient", "GossipMailbox", "GossipPart", "serve_gossip"]

log = logging.getLogger(__name__)
GET_PART = "/swarmtrain.wire.Gossip/GetPart"  # the full method name a call's proof covers


@dataclass(frozen=True)
class GossipPart:
    """One peer's part of one round: its Δ and its slow weights φ, each encoded."""

    round: int
    peer_id: str
    numel: int
    delta_codec: str
    weights_codec: str
    delta: bytes
    weights: bytes


def _header(run_id: str, part: GossipPart) -> pb.GossipHeader:
    return pb.GossipHeader(run_id=run_id, round=part.round, peer_id=part.peer_id, delta_codec=part.delta_codec,
                           weights_codec=part.weights_codec, numel=part.numel, delta_bytes=len(part.delta),
                           weights_bytes=len(part.weights))


def _context(h: pb.GossipHeader) -> bytes:
    return "\0".join(str(x) for x in (h.run_id, h.round, h.peer_id, h.delta_codec, h.weights_codec, h.numel,
                                      h.delta_bytes, h.weights_bytes)).encode()


class GossipMailbox:
    """This peer's published parts (the newest `keep` rounds), served by GetPart; lives on the node's loop."""

    def __init__(self, node: RpcNode, *, run_id: str, keep: int = 4) -> None:
        if keep < 1:
            raise ValueError(f"a gossip mailbox keeps at least 1 round, got {keep}")
        self.node, self.run_id, self.keep = node, run_id, keep
        self._parts: dict[int, tuple[pb.GossipHeader, bytes]] = {}
        self._changed: asyncio.Condition | None = None
        self._served: dict[int, int] = {}  # round -> partners served its part

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def publish(self, part: GossipPart) -> None:
        """Serve `part` from now on (call on the node's loop); the oldest round beyond `keep` is dropped."""
        header = _header(self.run_id, part)
        data = part.delta + part.weights
        header.mac = await mac_of(self.node.secret.payloads, b"gossip", _context(header), data)
        cond = self._condition()
        async with cond:
            self._parts[part.round] = (header, data)
            for old in sorted(self._parts)[:-self.keep]:
                del self._parts[old]
                self._served.pop(old, None)
            cond.notify_all()

    def served_of(self, round_index: int) -> int:
        """How many calls were served `round_index`'s part so far."""
        return self._served.get(round_index, 0)

    @property
    def newest(self) -> int:
        return max(self._parts, default=-1)

    async def wait_for(self, round_index: int, *, timeout_s: float) -> tuple[pb.GossipHeader, bytes] | None:
        """The part of `round_index` once published (None if it is not within `timeout_s`); KeyError when the
        round is older than every kept one (it is gone)."""
        cond = self._condition()
        async with cond:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(cond.wait_for(lambda: round_index in self._parts
                                                     or round_index < min(self._parts, default=-1)), timeout_s)
            if round_index in self._parts:
                return self._parts[round_index]
            if self._parts and round_index < min(self._parts):
                raise KeyError(round_index)
            return None

    async def GetPart(self, raw: bytes, context: aio.ServicerContext) -> AsyncIterator[pb.GossipChunk]:
        peer = peer_of(context)
        try:
            request = pb.GossipRequest.FromString(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed GossipRequest: {e}")
            return
        if request.run_id != self.run_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this peer is in run {self.run_id!r}")
            return
        left = context.time_remaining()
        try:
            found = await self.wait_for(request.round, timeout_s=max(0.0, (left if left is not None else 60.0) - 0.05))
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"round {request.round} is gone here (this peer keeps "
                                                           f"rounds from {min(self._parts, default=-1)})")
            return
        if found is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"round {request.round} not reached here yet (at "
                                                             f"{self.newest})")
            return
        header, data = found
        step = self.node.cfg.chunk_bytes
        yield pb.GossipChunk(header=header, data=data[:step])
        for start in range(step, len(data), step):
            yield pb.GossipChunk(data=data[start:start + step])
        self.node.counters.add_sent(peer, len(data))
        self._served[header.round] = self._served.get(header.round, 0) + 1


def serve_gossip(node: RpcNode, mailbox: GossipMailbox) -> None:
    """Register the Gossip service backed by `mailbox` on `node` (before `node.start()`)."""
    handler = grpc.method_handlers_generic_handler("swarmtrain.wire.Gossip", {
        "GetPart": grpc.unary_stream_rpc_method_handler(
            mailbox.GetPart, request_deserializer=None, response_serializer=pb.GossipChunk.SerializeToString)})
    node.add_service(lambda server: server.add_generic_rpc_handlers((handler,)))


class GossipClient:
    """Fetches a partner's part of a round (run on the node's loop); checks its MAC, run, round and sizes."""

    def __init__(self, node: RpcNode, *, run_id: str) -> None:
        self.node, self.run_id = node, run_id

    async def get_part(self, endpoint: str, *, round_index: int, numel: int, max_bytes: int,
                       deadline: float) -> GossipPart:
        stub = pb_grpc.GossipStub(self.node.channel(endpoint))
        request = pb.GossipRequest(run_id=self.run_id, round=round_index, peer_id=self.node.peer_id)
        header: pb.GossipHeader | None = None
        buf = bytearray()
        want = 0
        try:
            call = stub.GetPart(request, timeout=remaining_s(deadline), metadata=self.node.metadata(GET_PART, endpoint))
            async for chunk in call:
                if header is None:
                    header = chunk.header
                    want = header.delta_bytes + header.weights_bytes
                    problem = self._problem(header, round_index=round_index, numel=numel, max_bytes=max_bytes)
                    if problem:
                        call.cancel()
                        raise RpcRejected("INVALID_REPLY", problem)
                if len(buf) + len(chunk.data) > want:
                    call.cancel()
                    raise RpcRejected("INVALID_REPLY", f"the part exceeds its {want} bytes")
                buf += chunk.data
        except aio.AioRpcError as e:
            raise translate(e) from None
        if header is None or len(buf) != want:
            raise RpcRejected("INVALID_REPLY", f"truncated part: {len(buf)} of {want if header else '?'} bytes")
        if not await mac_ok(self.node.secret.payloads, header.mac, b"gossip", _context(header), buf):
            raise RpcRejected("INVALID_REPLY", "the part's MAC is wrong: altered on the way, or served by a peer "
                                               "without the run key")
        self.node.counters.add_received(endpoint, len(buf))
        data = bytes(buf)
        return GossipPart(round=header.round, peer_id=header.peer_id, numel=header.numel,
                          delta_codec=header.delta_codec, weights_codec=header.weights_codec,
                          delta=data[:header.delta_bytes], weights=data[header.delta_bytes:])

    def _problem(self, h: pb.GossipHeader, *, round_index: int, numel: int, max_bytes: int) -> str:
        if h.run_id != self.run_id:
            return f"the part is of run {h.run_id!r}"
        if h.round != round_index:
            return f"asked for round {round_index}, got round {h.round}"
        if h.numel != numel:
            return f"the part holds {h.numel} values, this model {numel}"
        if h.delta_bytes < 0 or h.weights_bytes < 0 or h.delta_bytes + h.weights_bytes > max_bytes:
            return f"a part of {h.delta_bytes} + {h.weights_bytes} bytes exceeds the {max_bytes}-byte limit"
        return ""


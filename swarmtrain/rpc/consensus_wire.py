"""The round decision's service over gRPC (consensus.proto): the servicer in front of a peer's voters (one per
averaging scope) and the client (`GrpcConsensusTransport`, the averaging package's ConsensusTransport).

Values, grants, retirements and certificates are carried as their canonical JSON (round/ballots.py,
certificate.py) and parsed field by field; anything malformed is refused with INVALID_ARGUMENT and never
reaches a voter. Every call is authenticated like every other call of the data plane (node.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc import aio

from swarmtrain.round.ballots import ZERO_BALLOT, Ballot, BallotError, MaterialLayout, Value, Voter
from swarmtrain.round.certificate import Certificate, Retirement, SignedGrant
from swarmtrain.round.messages import AcceptReply, Contact, LearnReply, PrepareReply, VoterSink
from swarmtrain.rpc.errors import RpcTimeout, status_name
from swarmtrain.rpc.node import Rejected, RpcNode, RpcRejected, peer_of, remaining_s, status_of, translate
from swarmtrain.wire import consensus_pb2 as pb

__all__ = ["SERVICE", "GrpcConsensusTransport", "serve_consensus"]

log = logging.getLogger(__name__)

SERVICE = "swarmtrain.wire.Consensus"
MAX_JSON_BYTES = 4 << 20  # a certificate of 4096 RSA grants is about 2.5 MB
M = TypeVar("M", bound=Message)
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------- codec

def _ballot(b: Ballot) -> pb.Ballot:
    return pb.Ballot(attempt=b.attempt, retry=b.retry, bump=b.bump, session=b.session, proposer=b.proposer)


def _from_ballot(msg: pb.Ballot) -> Ballot:
    return Ballot.from_json([msg.attempt, msg.retry, msg.bump, msg.session, msg.proposer])


def _voter(v: Voter) -> pb.VoterId:
    return pb.VoterId(peer_id=v.peer_id, incarnation=v.incarnation)


def _from_voter(msg: pb.VoterId) -> Voter:
    if not msg.peer_id or len(msg.peer_id) > 128:
        raise BallotError("voter: malformed peer id")
    return Voter(msg.peer_id, int(msg.incarnation))


def _json(obj: Any) -> bytes:
    return b"" if obj is None else json.dumps(obj.to_json(), separators=(",", ":")).encode()


def _parse(raw: bytes, parse: Callable[[Any], T]) -> T | None:
    if not raw:
        return None
    if len(raw) > MAX_JSON_BYTES:
        raise BallotError(f"{len(raw)} bytes of JSON, at most {MAX_JSON_BYTES}")
    try:
        return parse(json.loads(raw))
    except (ValueError, TypeError) as e:
        if isinstance(e, BallotError):
            raise
        raise BallotError(f"malformed JSON: {e}") from None


def _parsed(cls: type[M], raw: bytes) -> M:
    try:
        return cls.FromString(raw)
    except DecodeError as e:
        raise Rejected(f"malformed {cls.DESCRIPTOR.name}: {e}") from None


# ---------------------------------------------------------------------------------------------- server

class _Servicer:
    """Routes each call to the voter of its scope (`voters`, read at each call: planes come and go)."""

    def __init__(self, node: RpcNode, voters: Callable[[], Mapping[str, VoterSink]]) -> None:
        self.node = node
        self.voters = voters

    def _sink(self, scope: str) -> VoterSink:
        sink = self.voters().get(scope)
        if sink is None:
            raise Rejected(f"this peer runs no voter of scope {scope!r}", kind="not_found")
        return sink

    async def _guard(self, context: aio.ServicerContext, method: str, work: Callable[[str], Any]) -> Any:
        peer = peer_of(context)
        try:
            return await work(peer)
        except BallotError as e:
            err = Rejected(f"malformed request: {e}")
        except Rejected as e:
            err = e
        log.info("%s refused %s from %s: %s", self.node.peer_id, method, peer, err)
        await context.abort(status_of(err), str(err))
        raise AssertionError("unreachable")

    async def Prepare(self, raw: bytes, context: aio.ServicerContext) -> pb.PrepareReply:
        async def work(peer: str) -> pb.PrepareReply:
            req = _parsed(pb.PrepareRequest, raw)
            r = await self._sink(req.scope).prepare(scope=req.scope, round_index=req.round,
                                                    ballot=_from_ballot(req.ballot), caller=peer)
            return pb.PrepareReply(voter=_voter(r.voter), granted=r.granted, promised=_ballot(r.promised),
                                   accepted=_ballot(r.accepted), value_json=_json(r.value),
                                   holds_material=r.holds_material, refusal=r.refusal, reason=r.reason[:500],
                                   retirement_json=_json(r.retirement))
        return await self._guard(context, "Prepare", work)

    async def Accept(self, raw: bytes, context: aio.ServicerContext) -> pb.AcceptReply:
        async def work(peer: str) -> pb.AcceptReply:
            req = _parsed(pb.AcceptRequest, raw)
            value = _parse(req.value_json, Value.from_json)
            if value is None:
                raise Rejected("an accept without a value")
            holders = [Contact(h.peer_id, h.endpoint) for h in req.holders[:16]]
            left = context.time_remaining()
            r = await self._sink(req.scope).accept(scope=req.scope, round_index=req.round,
                                                   ballot=_from_ballot(req.ballot), value=value, holders=holders,
                                                   caller=peer, deadline_s=0.8 * (left if left is not None else
                                                                                  self.node.cfg.call_timeout_s))
            return pb.AcceptReply(voter=_voter(r.voter), granted=r.granted, grant_json=_json(r.grant),
                                  promised=_ballot(r.promised), refusal=r.refusal, reason=r.reason[:500],
                                  retirement_json=_json(r.retirement))
        return await self._guard(context, "Accept", work)

    async def Learn(self, raw: bytes, context: aio.ServicerContext) -> pb.LearnReply:
        async def work(peer: str) -> pb.LearnReply:
            req = _parsed(pb.LearnRequest, raw)
            r = await self._sink(req.scope).learn(scope=req.scope, round_index=req.round, caller=peer)
            return pb.LearnReply(certificate_json=_json(r.certificate),
                                 voter=_voter(r.voter) if r.voter is not None else None, has_vote=r.voter is not None,
                                 accepted=_ballot(r.accepted), value_json=_json(r.value), grant_json=_json(r.grant),
                                 holds_material=r.holds_material)
        return await self._guard(context, "Learn", work)

    async def Certificates(self, raw: bytes, context: aio.ServicerContext) -> pb.CertificatesReply:
        async def work(peer: str) -> pb.CertificatesReply:
            req = _parsed(pb.CertificatesRequest, raw)
            certs = await self._sink(req.scope).certificates_from(scope=req.scope, from_round=req.from_round,
                                                                  caller=peer)
            return pb.CertificatesReply(certificate_json=[_json(c) for c in certs])
        return await self._guard(context, "Certificates", work)

    async def Material(self, raw: bytes, context: aio.ServicerContext) -> Any:
        peer = peer_of(context)
        try:
            req = _parsed(pb.MaterialRequest, raw)
            layout = _parse(req.layout_json, MaterialLayout.from_json)
            if layout is None:
                raise Rejected("a material request without a layout")
            blob = await self._sink(req.scope).material(scope=req.scope, layout=layout, shard=req.shard, caller=peer)
        except (Rejected, BallotError) as e:
            err = e if isinstance(e, Rejected) else Rejected(f"malformed request: {e}")
            await context.abort(status_of(err), str(err))
            return
        step, view = self.node.cfg.chunk_bytes, memoryview(blob)
        for start in range(0, max(len(blob), 1), step):
            yield pb.MaterialChunk(total_bytes=len(blob) if start == 0 else 0, data=bytes(view[start:start + step]))
        self.node.counters.add_sent(peer, len(blob))


def serve_consensus(node: RpcNode, voters: Callable[[], Mapping[str, VoterSink]]) -> None:
    """Register the Consensus service on `node` (before it starts), answered by the voter of each call's scope."""
    servicer = _Servicer(node, voters)
    unary: dict[str, tuple[Callable[..., Awaitable[Message]], type[Message]]] = {
        "Prepare": (servicer.Prepare, pb.PrepareReply), "Accept": (servicer.Accept, pb.AcceptReply),
        "Learn": (servicer.Learn, pb.LearnReply), "Certificates": (servicer.Certificates, pb.CertificatesReply),
    }
    handlers: dict[str, grpc.RpcMethodHandler] = {
        name: grpc.unary_unary_rpc_method_handler(fn, request_deserializer=None,
                                                  response_serializer=reply.SerializeToString)
        for name, (fn, reply) in unary.items()}
    handlers["Material"] = grpc.unary_stream_rpc_method_handler(
        servicer.Material, request_deserializer=None, response_serializer=pb.MaterialChunk.SerializeToString)
    handler = grpc.method_handlers_generic_handler(SERVICE, handlers)
    node.add_service(lambda server: server.add_generic_rpc_handlers((handler,)))


# ---------------------------------------------------------------------------------------------- client

class GrpcConsensusTransport:
    """The caller's side over gRPC; run on the node's loop. Errors are RpcUnavailable / RpcTimeout /
    RpcRejected (a reply that does not parse is RpcRejected too)."""

    def __init__(self, node: RpcNode, *, local: Callable[[], Mapping[str, VoterSink]] | None = None) -> None:
        """`local()`: this node's own voters by scope; calls to this peer itself go to them directly (a member
        asks its own voter too: no loopback round trip, no serialization)."""
        self.node = node
        self.local = local
        self._stubs: dict[str, dict[str, Any]] = {}

    def _own(self, to: Contact, scope: str) -> VoterSink | None:
        if self.local is None or to.peer_id != self.node.peer_id:
            return None
        return self.local().get(scope)

    async def _locally(self, work: Awaitable[T], timeout_s: float) -> T:
        """A call to this peer's own voter, with the remote call's deadline and refusals."""
        try:
            return await asyncio.wait_for(work, timeout=max(timeout_s, 1e-3))
        except TimeoutError:
            raise RpcTimeout(f"DEADLINE_EXCEEDED: this peer's own voter did not answer in {timeout_s:.1f}s") from None
        except Rejected as e:
            raise RpcRejected(status_name(e), str(e)) from None

    def _stub(self, endpoint: str, method: str) -> Any:
        stubs = self._stubs.get(endpoint)
        if stubs is None:
            ch = self.node.channel(endpoint)
            stubs = self._stubs[endpoint] = {
                "Prepare": ch.unary_unary(f"/{SERVICE}/Prepare", request_serializer=pb.PrepareRequest.SerializeToString,
                                          response_deserializer=pb.PrepareReply.FromString),
                "Accept": ch.unary_unary(f"/{SERVICE}/Accept", request_serializer=pb.AcceptRequest.SerializeToString,
                                         response_deserializer=pb.AcceptReply.FromString),
                "Learn": ch.unary_unary(f"/{SERVICE}/Learn", request_serializer=pb.LearnRequest.SerializeToString,
                                        response_deserializer=pb.LearnReply.FromString),
                "Certificates": ch.unary_unary(f"/{SERVICE}/Certificates",
                                               request_serializer=pb.CertificatesRequest.SerializeToString,
                                               response_deserializer=pb.CertificatesReply.FromString),
                "Material": ch.unary_stream(f"/{SERVICE}/Material",
                                            request_serializer=pb.MaterialRequest.SerializeToString,
                                            response_deserializer=pb.MaterialChunk.FromString),
            }
        return stubs[method]

    async def _unary(self, to: Contact, method: str, request: Message, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s

        async def once() -> Any:
            try:
                return await self._stub(to.endpoint, method)(
                    request, timeout=remaining_s(deadline),
                    metadata=self.node.metadata(f"/{SERVICE}/{method}", to.endpoint))
            except aio.AioRpcError as e:
                raise translate(e) from None

        return await self.node.retrying(once, endpoint=to.endpoint, deadline=deadline, what=f"{method} to {to.peer_id}")

    async def prepare(self, to: Contact, *, scope: str, round_index: int, ballot: Ballot,
                      timeout_s: float) -> PrepareReply:
        own = self._own(to, scope)
        if own is not None:
            return await self._locally(own.prepare(scope=scope, round_index=round_index, ballot=ballot,
                                                   caller=self.node.peer_id), timeout_s)
        r = await self._unary(to, "Prepare", pb.PrepareRequest(scope=scope, round=round_index, ballot=_ballot(ballot)),
                              timeout_s)
        return _reply(to, lambda: PrepareReply(
            _from_voter(r.voter), r.granted, _from_ballot(r.promised), _from_ballot(r.accepted),
            _parse(r.value_json, Value.from_json), r.holds_material, r.refusal, r.reason,
            _parse(r.retirement_json, Retirement.from_json)))

    async def accept(self, to: Contact, *, scope: str, round_index: int, ballot: Ballot, value: Value,
                     holders: Sequence[Contact], timeout_s: float) -> AcceptReply:
        own = self._own(to, scope)
        if own is not None:
            return await self._locally(own.accept(scope=scope, round_index=round_index, ballot=ballot, value=value,
                                                  holders=list(holders)[:16], caller=self.node.peer_id,
                                                  deadline_s=0.8 * timeout_s), timeout_s)
        req = pb.AcceptRequest(scope=scope, round=round_index, ballot=_ballot(ballot), value_json=_json(value),
                               holders=[pb.Contact(peer_id=h.peer_id, endpoint=h.endpoint) for h in holders])
        r = await self._unary(to, "Accept", req, timeout_s)
        return _reply(to, lambda: AcceptReply(
            _from_voter(r.voter), r.granted, _parse(r.grant_json, SignedGrant.from_json), _from_ballot(r.promised),
            r.refusal, r.reason, _parse(r.retirement_json, Retirement.from_json)))

    async def learn(self, to: Contact, *, scope: str, round_index: int, timeout_s: float) -> LearnReply:
        r = await self._unary(to, "Learn", pb.LearnRequest(scope=scope, round=round_index), timeout_s)
        return _reply(to, lambda: LearnReply(
            _parse(r.certificate_json, Certificate.from_json), _from_voter(r.voter) if r.has_vote else None,
            _from_ballot(r.accepted) if r.has_vote else ZERO_BALLOT, _parse(r.value_json, Value.from_json),
            _parse(r.grant_json, SignedGrant.from_json), r.holds_material))

    async def certificates(self, to: Contact, *, scope: str, from_round: int,
                           timeout_s: float) -> tuple[Certificate, ...]:
        r = await self._unary(to, "Certificates", pb.CertificatesRequest(scope=scope, from_round=from_round), timeout_s)
        return _reply(to, lambda: tuple(c for raw in r.certificate_json[:64]
                                        if (c := _parse(raw, Certificate.from_json)) is not None))

    async def material(self, to: Contact, *, scope: str, layout: MaterialLayout, shard: int,
                       timeout_s: float) -> bytearray:
        if not 0 <= shard < len(layout.shards):
            raise ValueError(f"material: shard {shard} of {len(layout.shards)}")
        expected = layout.shards[shard].size_bytes
        deadline = time.monotonic() + timeout_s
        request = pb.MaterialRequest(scope=scope, layout_json=_json(layout), shard=shard)

        async def once() -> bytearray:
            buf, got, total = bytearray(), 0, -1
            try:
                call = self._stub(to.endpoint, "Material")(request, timeout=remaining_s(deadline),
                                                           metadata=self.node.metadata(f"/{SERVICE}/Material",
                                                                                       to.endpoint))
                async for chunk in call:
                    if total < 0:
                        total = chunk.total_bytes
                        if total != expected:
                            call.cancel()
                            raise RpcRejected("INVALID_REPLY",
                                              f"shard {shard}: {total} bytes, the value names {expected}")
                        buf = bytearray(total)
                    if got + len(chunk.data) > total:
                        call.cancel()
                        raise RpcRejected("INVALID_REPLY", f"shard {shard} exceeds its {total} bytes")
                    buf[got:got + len(chunk.data)] = chunk.data
                    got += len(chunk.data)
            except aio.AioRpcError as e:
                raise translate(e) from None
            if got != expected:
                raise RpcRejected("INVALID_REPLY", f"shard {shard}: {got} of {expected} bytes")
            self.node.counters.add_received(to.peer_id, got)
            return buf

        return await self.node.retrying(once, endpoint=to.endpoint, deadline=deadline,
                                        what=f"material from {to.peer_id}")


def _reply(to: Contact, build: Callable[[], T]) -> T:
    try:
        return build()
    except BallotError as e:
        log.warning("bad reply from %s: %s", to.peer_id, e)
        raise RpcRejected("INVALID_REPLY", str(e)) from None

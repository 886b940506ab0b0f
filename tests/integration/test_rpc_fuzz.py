"""Property-based fuzzing of every RPC handler: an authenticated caller sends arbitrary and mutated request
bytes to each method of a serving peer (averaging, the round's decision and state transfer, with an open
round). Every reply is a typed refusal, an answer, or gRPC's own refusal to deserialize: never a handler's
unhandled error (UNKNOWN, or INTERNAL from anything but deserialization). The peer then still averages a
round exactly."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import grpc
import pytest
import torch
from allreduce_swarm import RUN_ID, Swarm, deltas_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmtrain.config import RunConfig
from swarmtrain.round.ballots import MaterialLayout, ShardDigest, Value, Voter
from swarmtrain.rpc.averaging_wire import SERVICE
from swarmtrain.rpc.consensus_wire import SERVICE as CONSENSUS
from swarmtrain.rpc.node import RpcNode
from swarmtrain.sync.transfer import StateServer, StateSnapshot
from swarmtrain.testing.fuzz import mutate
from swarmtrain.wire import averaging_pb2 as pb
from swarmtrain.wire import consensus_pb2 as cpb
from swarmtrain.wire import sync_pb2

pytestmark = pytest.mark.integration

TYPED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
         grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
KINDS = {"Push": "stream_unary", "Contributors": "unary_unary", "Fetch": "unary_stream", "PushTicket": "unary_unary",
         "FetchTicket": "unary_unary", "Prepare": "unary_unary", "Accept": "unary_unary", "Learn": "unary_unary",
         "Certificates": "unary_unary", "Material": "unary_stream"}
DECISION = {"Prepare", "Accept", "Learn", "Certificates", "Material"}


def _seeds() -> dict[str, list[bytes]]:
    session = pb.SessionKey(run_id=RUN_ID, round=0, group_id="0" * 32, attempt=0, reducers=["a", "b"])
    header = pb.PushHeader(session=session, sender="b", shard=0, numel=10, total_bytes=52, codec="fp32")
    raw = header.SerializeToString()
    push = b"\x0a" + bytes([len(raw)]) + raw + b"\x12\x04abcd"
    fetch = pb.FetchRequest(session=session, shard=0, contributors=["a", "b"]).SerializeToString()
    layout = MaterialLayout(20, "fp32", False, (ShardDigest(0, 20, 128, "0" * 64),))
    value = Value("", 0, "s" * 24, "", ("a", "b"), (Voter("a", 0), Voter("b", 0)), layout, "1" * 64)
    ballot = cpb.Ballot(attempt=0, retry=0, bump=0, session="s" * 24, proposer="")
    return {"Push": [push], "Contributors": [pb.ContributorsRequest(session=session, shard=0).SerializeToString()],
            "Fetch": [fetch], "PushTicket": [raw], "FetchTicket": [fetch],
            "Prepare": [cpb.PrepareRequest(scope="", round=0, ballot=ballot).SerializeToString()],
            "Accept": [cpb.AcceptRequest(scope="", round=0, ballot=ballot, value_json=value.canonical(),
                                         holders=[cpb.Contact(peer_id="b", endpoint="127.0.0.1:1")])
                       .SerializeToString()],
            "Learn": [cpb.LearnRequest(scope="", round=0).SerializeToString()],
            "Certificates": [cpb.CertificatesRequest(scope="", from_round=0).SerializeToString()],
            "Material": [cpb.MaterialRequest(scope="", layout_json=json.dumps(layout.to_json()).encode(),
                                             shard=0).SerializeToString()],
            "GetState": [sync_pb2.StateRequest(run_id=RUN_ID).SerializeToString()]}


SEEDS = _seeds()


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Swarm, RpcNode]]:
    with Swarm(["a", "b"]) as swarm:
        a = swarm.nodes["a"]
        a.run(swarm.averagers["a"].registry.open_round(swarm._group(0), numel=20), timeout_s=5)
        donor = RpcNode(swarm.nodes["b"].cfg, peer_id="donor")
        StateServer(donor).publish(StateSnapshot(1, {"w": torch.ones(8)}, {}, RunConfig()))
        donor.start()
        try:
            yield swarm, donor
        finally:
            donor.close()


async def _call(caller: RpcNode, endpoint: str, method: str, request: bytes) -> tuple[grpc.StatusCode, str]:
    channel = caller.channel(endpoint)
    service = CONSENSUS if method in DECISION else SERVICE
    path = "/swarmtrain.wire.StateTransfer/GetState" if method == "GetState" else f"/{service}/{method}"
    kind = "unary_stream" if method == "GetState" else KINDS[method]
    call = getattr(channel, kind)(path, request_serializer=None, response_deserializer=None)
    meta = caller.metadata(path, endpoint)
    try:
        if kind == "stream_unary":
            async def chunks() -> object:
                yield request
            await call(chunks(), timeout=5, metadata=meta)
        elif kind == "unary_stream":
            async for _ in call(request, timeout=5, metadata=meta):
                pass
        else:
            await call(request, timeout=5, metadata=meta)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _typed(code: grpc.StatusCode, details: str) -> bool:
    return code in TYPED or (code == grpc.StatusCode.INTERNAL and "deserializ" in details.lower())


@pytest.mark.parametrize("method", [*KINDS, "GetState"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300), rng_seed=st.integers(0, 2**32 - 1), mutated=st.booleans())
def test_every_handler_answers_any_request_bytes_with_a_typed_status(
        served: tuple[Swarm, RpcNode], method: str, data: bytes, rng_seed: int, mutated: bool) -> None:
    swarm, donor = served
    caller = swarm.nodes["b"]  # a member holding the key: its calls reach the handlers
    endpoint = donor.endpoint if method == "GetState" else swarm.nodes["a"].endpoint
    request = mutate(random.Random(rng_seed).choice(SEEDS[method]), random.Random(rng_seed)) if mutated else data
    code, details = caller.run(_call(caller, endpoint, method, request), timeout_s=15)
    assert _typed(code, details), (method, code, details, request.hex())


def test_after_the_fuzzing_the_peers_still_average_exactly(served: tuple[Swarm, RpcNode]) -> None:
    swarm, _ = served
    deltas = deltas_for(["a", "b"], 5000, seed=9)
    results = swarm.average(1, deltas)
    assert all(r.committed for r in results.values()), {n: r.reason for n, r in results.items()}
    expected = (deltas["a"] + deltas["b"]) / 2
    assert all(torch.allclose(r.mean_tensor(), expected) for r in results.values() if r.mean is not None)  # type: ignore[arg-type]

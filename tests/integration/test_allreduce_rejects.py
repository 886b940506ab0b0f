"""Hostile or broken pushes (wrong run key, NaN/Inf, wrong shape, oversized, truncated, stale or foreign
rounds) are refused with a status that names the problem, logged, and the swarm goes on."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest
import torch
from allreduce_swarm import RPC, RUN_ID, Swarm, deltas_for, reference_mean

from swarmtrain.averaging.reducer import shard_bounds
from swarmtrain.compress import get_codec
from swarmtrain.compress.wire import CodecId, Flags, Header, frame
from swarmtrain.rpc import averaging_client, bulk
from swarmtrain.rpc.averaging_client import AveragingClient
from swarmtrain.rpc.averaging_wire import PushHeader, SessionKey
from swarmtrain.rpc.node import RpcNode, RpcRejected

pytestmark = pytest.mark.integration

NUMEL = 1000
SHARD = 500  # a reduces [0, 500), b [500, 1000)


def _nan_payload(numel: int) -> bytes:
    """A well-framed fp32 message (valid checksum) whose values include NaN and Inf."""
    values = torch.zeros(numel)
    values[7], values[9] = float("nan"), float("inf")
    raw = memoryview(values.numpy()).cast("B")
    return frame(Header(CodecId.FP32, Flags(0), torch.float32, 0, (numel,), raw.nbytes), [raw])


def _push(intruder: RpcNode, endpoint: str, header: PushHeader, payload: bytes) -> RpcRejected:
    client = AveragingClient(intruder)
    with pytest.raises(RpcRejected) as info:
        intruder.run(client.push(endpoint, "a", header, payload, deadline=time.monotonic() + 5), timeout_s=10)
    return info.value


@pytest.mark.parametrize("transport", ["tcp", "grpc"])  # the intruder's: bulk-port tickets or gRPC Push
def test_bad_pushes_are_refused_logged_and_the_round_still_commits(caplog, monkeypatch, transport: str) -> None:
    rpc = dataclasses.replace(RPC, bulk_transport=transport)
    caplog.set_level(logging.WARNING)
    with Swarm(["a", "b"]) as swarm:
        a = swarm.nodes["a"]
        round_group = swarm._group(0)
        a.run(swarm.averagers["a"].registry.open_round(round_group, numel=NUMEL), timeout_s=5)
        key = SessionKey(RUN_ID, 0, round_group.group_id, 0, ("a", "b"))
        good = get_codec("fp32").encode(torch.ones(SHARD))

        def header(**kw: object) -> PushHeader:
            fields = {"session": key, "sender": "b", "shard": 0, "numel": SHARD, "total_bytes": len(good),
                      "codec": "fp32"} | kw
            return PushHeader(**fields)  # type: ignore[arg-type]

        big = RpcNode(dataclasses.replace(RPC, chunk_bytes=2 << 20, max_message_bytes=4 << 20, bulk_transport="grpc"),
                      peer_id="b", serve=False)
        intruder = RpcNode(rpc, peer_id="b", serve=False)  # a member (it holds the key) that misbehaves
        for n in (big, intruder):
            n.start()
        try:
            cases = {
                "nan": (header(total_bytes=len(_nan_payload(SHARD))), _nan_payload(SHARD), "INVALID_ARGUMENT",
                        "NaN or Inf"),
                "shape": (header(numel=SHARD - 1), good, "INVALID_ARGUMENT", "has 500 values"),
                "declared_oversize": (header(total_bytes=10 ** 9), good, "RESOURCE_EXHAUSTED", "at most"),
                "undeclared_oversize": (header(total_bytes=100), good, "RESOURCE_EXHAUSTED", "more than"),
                "truncated": (header(), good[: len(good) // 2], "INVALID_ARGUMENT", "truncated"),
                "foreign_group": (header(session=SessionKey(RUN_ID, 0, "f" * 32, 0, ("a", "b"))), good,
                                  "FAILED_PRECONDITION", "is not round 0's group"),
                "foreign_run": (header(session=SessionKey("other", 0, key.group_id, 0, ("a", "b"))), good,
                                "FAILED_PRECONDITION", "run 'other'"),
                "stranger": (header(sender="mallory"), good, "INVALID_ARGUMENT", "not a member"),
                "impersonation": (header(sender="a"), good, "INVALID_ARGUMENT", "is not the caller 'b'"),
                # (shard 1 from b is b's own shard, which a keeps a copy of as b's stand-in)
                "wrong_shard": (header(shard=2), good, "INVALID_ARGUMENT", "not reduced here"),
            }
            for name, (hdr, payload, code, words) in cases.items():
                err = _push(intruder, a.endpoint, hdr, payload)
                assert err.code == code and words in err.details, (name, err)
            # a push whose bytes were altered on the way: its MAC (bulk port or gRPC stream) no longer matches
            with monkeypatch.context() as patched:
                async def forged_mac(*_args: object) -> bytes:
                    return bytes(32)

                patched.setattr(bulk, "_bulk_mac", lambda *_args: bytes(32))  # the bulk port's upload
                patched.setattr(averaging_client, "mac_of", forged_mac)  # the gRPC stream's push
                err = _push(intruder, a.endpoint, header(), good)
            assert err.code == "INVALID_ARGUMENT" and "MAC" in err.details, err
            # one gRPC message above rpc.max_message_bytes is refused by the transport itself
            assert _push(big, a.endpoint, header(total_bytes=2 << 20), bytes(2 << 20)).code == "RESOURCE_EXHAUSTED"
            # the wrong run key is refused before any handler runs, and logged
            monkeypatch.setenv("SWARMTRAIN_RUN_KEY", "guess")
            guesser = RpcNode(rpc, peer_id="guesser", serve=False)
            guesser.start()
            try:
                assert _push(guesser, a.endpoint, header(), good).code == "UNAUTHENTICATED"
            finally:
                guesser.close()
                monkeypatch.delenv("SWARMTRAIN_RUN_KEY")
        finally:
            for n in (big, intruder):
                n.close()
        logged = " ".join(r.getMessage() for r in caplog.records)
        assert "wrong run key" in logged and "NaN or Inf" in logged and "truncated" in logged and "MAC" in logged

        # the swarm goes on: the next round commits exactly
        deltas = deltas_for(["a", "b"], NUMEL)
        results = swarm.average(1, deltas)
        ref = reference_mean(deltas, ["a", "b"], shard_bounds(NUMEL, (0.0, 0.0)))
        assert all(r.committed and torch.equal(r.mean_tensor(), ref) for r in results.values())

        # and a push for a round it has left behind is stale
        a.run(swarm.averagers["a"].registry.open_round(swarm._group(3), numel=NUMEL), timeout_s=5)
        intruder = RpcNode(rpc, peer_id="mallory", serve=False)
        intruder.start()
        try:
            err = _push(intruder, a.endpoint, header(), good)
            assert err.code == "FAILED_PRECONDITION" and "stale" in err.details
        finally:
            intruder.close()

"""Malformed activations, a wrong stage, an unknown, foreign or stale micro-batch: typed errors, logged;
the server and the swarm go on."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from swarmtrain.config import load_config
from swarmtrain.rpc.errors import RpcRejected
from swarmtrain.rpc.node import RpcNode
from swarmtrain.rpc.pipeline_wire import PipelineClient
from swarmtrain.testing.pipeline import PipelineSwarm
from swarmtrain.wire import pipeline_pb2 as pb

pytestmark = pytest.mark.integration

CFG = load_config(overrides=[
    "model.preset=tiny", "data.seq_len=16", "pipeline.stages=2", "pipeline.microbatch_size=2",
    "pipeline.samples_per_step=2", "pipeline.max_stale_steps=1", "rpc.run_key='k'",
])
C = 64  # tiny's width


def _call(node: RpcNode, endpoint: str, method: str, **fields) -> pb.StageReply:
    client = PipelineClient(node)
    return node.run(client.call(endpoint, method, pb.StageCall(**fields), timeout_s=10), timeout_s=15)


def _refused(node: RpcNode, endpoint: str, method: str, **fields) -> str:
    with pytest.raises(RpcRejected) as info:
        _call(node, endpoint, method, **fields)
    return info.value.code


def _tensor(swarm: PipelineSwarm, t: torch.Tensor) -> bytes:
    return swarm.pipeline_trainers[0].codec.encode(t)[1]


def test_bad_calls_are_refused_with_typed_errors_and_the_server_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="swarmtrain.rpc.pipeline_wire")
    with PipelineSwarm(CFG, servers_per_stage=1, trainers=2) as swarm:
        me, other = swarm.trainer_nodes
        s0 = next(s for s in swarm.servers if s.stage == 0)
        ep = s0.node.endpoint
        x = torch.randn(2, 16, C)
        ok = {"stage": 0, "shape": [2, 16, C], "tensor": _tensor(swarm, x), "seed": 1}
        assert list(_call(me, ep, "Forward", microbatch="m0", **ok).shape) == [2, 16, C]

        codes = {
            "wrong width": _refused(me, ep, "Forward", microbatch="a",
                                    **{**ok, "shape": [2, 16, C + 1],
                                       "tensor": _tensor(swarm, torch.randn(2, 16, C + 1))}),
            "too many sequences": _refused(me, ep, "Forward", microbatch="b",
                                           **{**ok, "shape": [3, 16, C],
                                              "tensor": _tensor(swarm, torch.randn(3, 16, C))}),
            "longer than seq_len": _refused(me, ep, "Forward", microbatch="c",
                                            **{**ok, "shape": [2, 17, C],
                                               "tensor": _tensor(swarm, torch.randn(2, 17, C))}),
            "shape and bytes disagree": _refused(me, ep, "Forward", microbatch="d", **{**ok, "shape": [1, 16, C]}),
            "garbage bytes": _refused(me, ep, "Forward", microbatch="e", **{**ok, "tensor": b"\x00" * 999}),
            "altered bytes (NaN)": _refused(me, ep, "Forward", microbatch="f",
                                            **{**ok, "tensor": ok["tensor"][:-8] + b"\xff" * 8}),
            "wrong stage": _refused(me, ep, "Forward", microbatch="g", **{**ok, "stage": 1}),
            "unknown micro-batch": _refused(me, ep, "Backward", microbatch="never", **{**ok, "samples": 2}),
            "another trainer's micro-batch": _refused(other, ep, "Backward", microbatch="m0", **{**ok, "samples": 2}),
        }
        assert codes == {
            "wrong width": "INVALID_ARGUMENT", "too many sequences": "INVALID_ARGUMENT",
            "longer than seq_len": "INVALID_ARGUMENT", "shape and bytes disagree": "INVALID_ARGUMENT",
            "garbage bytes": "INVALID_ARGUMENT", "altered bytes (NaN)": "INVALID_ARGUMENT",
            "wrong stage": "FAILED_PRECONDITION", "unknown micro-batch": "NOT_FOUND",
            "another trainer's micro-batch": "NOT_FOUND",
        }

        # Stale: m0's forward ran before two inner steps of this server (each step: one backward of 2 samples).
        for mb in ("s1", "s2"):
            _call(me, ep, "Forward", microbatch=mb, **ok)
            _call(me, ep, "Backward", microbatch=mb, **{**ok, "samples": 2})
        assert s0.server.step == 2
        assert _refused(me, ep, "Backward", microbatch="m0", **{**ok, "samples": 2}) == "ABORTED"

        # The server still trains, and so does the swarm.
        report = swarm.pipeline_trainers[0].step(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
        assert report.lost == 0 and report.rerouted == 0
    assert s0.server.refused == 4  # wrong stage, unknown, foreign, stale: the rest never reach the stage
    logged = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(logged) == 10 and any("NaN" in m or "checksum" in m for m in logged), logged


def test_stage_server_refuses_non_finite_and_non_float_inputs() -> None:
    with PipelineSwarm(CFG, servers_per_stage=1) as swarm:
        server = swarm.servers[0].server
        bad = torch.randn(2, 16, C)
        bad[0, 0, 0] = float("nan")
        with pytest.raises(ValueError, match="NaN or Inf"):
            server.forward(0, "x", bad, seed=0)
        with pytest.raises(ValueError, match="dtype"):
            server.forward(0, "y", torch.randn(2, 16, C, dtype=torch.float64), seed=0)


def test_bulk_calls_refuse_missing_oversized_and_foreign_uploads() -> None:
    """Tensors over the bulk port: a call naming no upload (or another caller's) is NOT_FOUND, an upload that
    announces more than the stage's largest tensor or names no method is refused before any byte moves, a
    payload longer than announced is refused by the bulk port; the server goes on serving bulk calls."""
    from swarmtrain.rpc import bulk

    with PipelineSwarm(CFG, servers_per_stage=1, trainers=2) as swarm:
        me, other = swarm.trainer_nodes
        ep = next(s for s in swarm.servers if s.stage == 0).node.endpoint
        x = torch.randn(2, 16, C)
        ok = {"stage": 0, "shape": [2, 16, C], "tensor": _tensor(swarm, x), "seed": 1}
        codec = swarm.pipeline_trainers[0].codec
        client = PipelineClient(me, bulk_min_bytes=1, max_bytes=codec.max_bytes)
        reply = me.run(client.call(ep, "Forward", pb.StageCall(microbatch="b0", **ok), timeout_s=10), timeout_s=15)
        inline = _call(me, ep, "Forward", microbatch="b1", **ok)
        assert reply.tensor == inline.tensor and not reply.HasField("ticket")  # the same output either way

        def upload(node: RpcNode, **fields) -> str:
            async def ask() -> object:
                stub = node.channel(ep).unary_unary("/swarmtrain.wire.Pipeline/Upload",
                                                    request_serializer=pb.StageUpload.SerializeToString,
                                                    response_deserializer=lambda b: b)
                from grpc import aio
                try:
                    await stub(pb.StageUpload(**fields), timeout=5,
                               metadata=node.metadata("/swarmtrain.wire.Pipeline/Upload", ep))
                except aio.AioRpcError as e:
                    return e.code().name
                return "OK"
            return str(node.run(ask(), timeout_s=10))

        assert upload(me, stage=0, microbatch="u", method="Forward", total_bytes=codec.max_bytes + 1) \
            == "INVALID_ARGUMENT"
        assert upload(me, stage=0, microbatch="u", method="Delete", total_bytes=100) == "INVALID_ARGUMENT"
        assert _refused(me, ep, "Forward", microbatch="never-uploaded", bulk=True, **{**ok, "tensor": b""}) \
            == "NOT_FOUND"

        # Uploaded by `other`, claimed by `me`: uploads are keyed by their caller.
        theirs = PipelineClient(other, bulk_min_bytes=1, max_bytes=codec.max_bytes)
        call = pb.StageCall(microbatch="mine", **ok)
        assert other.run(theirs._upload(ep, "Forward", call, time.monotonic() + 10), timeout_s=15)
        assert _refused(me, ep, "Forward", microbatch="mine", bulk=True, **{**ok, "tensor": b""}) == "NOT_FOUND"

        # More bytes than the ticket announced: the bulk port refuses them.
        real = bulk.upload

        async def longer(*args, **kw):
            payload = args[4]
            return await real(*args[:4], bytes(payload) + b"\0" * 64, **kw)

        bulk.upload = longer
        try:
            with pytest.raises(RpcRejected) as info:
                me.run(client.call(ep, "Forward", pb.StageCall(microbatch="b2", **ok), timeout_s=10), timeout_s=15)
        finally:
            bulk.upload = real
        assert info.value.code == "RESOURCE_EXHAUSTED"
        again = me.run(client.call(ep, "Forward", pb.StageCall(microbatch="b3", **ok), timeout_s=10), timeout_s=15)
        assert again.tensor == inline.tensor

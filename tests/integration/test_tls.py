"""`rpc.tls`: rounds over TLS (gRPC and the bulk port) equal the reference; a node of another run key, or
one without TLS, cannot take part; the bytes on the wire are ciphertext."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from pathlib import Path

import pytest
import torch
from allreduce_swarm import RPC, Swarm, check_rounds, deltas_for, reference_mean

from swarmtrain.averaging.reducer import shard_bounds
from swarmtrain.config import load_config
from swarmtrain.roles import Peer
from swarmtrain.rpc import bulk
from swarmtrain.rpc.errors import RpcError, RpcRejected
from swarmtrain.rpc.node import RpcNode
from swarmtrain.rpc.tls import TlsWithoutKeyError
from swarmtrain.telemetry import EventWriter, HealEvent
from swarmtrain.testing.cluster import (
    TINY_RUN,
    EventLog,
    LoopbackServices,
    hashes_by_round,
    publish_run,
    run_peer,
    story,
)

pytestmark = pytest.mark.integration

NAMES = ["a", "b", "c"]
NUMEL = 120_000
TLS = dataclasses.replace(RPC, tls=True)
IO_S = 10.0


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_rounds_over_tls_match_the_reference(transport: str) -> None:
    cfg = dataclasses.replace(TLS, bulk_transport=transport)
    with Swarm(NAMES, rpc=dict.fromkeys(NAMES, cfg)) as swarm:
        check_rounds(swarm, NAMES, NUMEL, 2)
        if transport == "tcp":  # the payloads took the bulk port (its receive buffers came back), none refused
            assert all(n.bulk is not None and n.bulk.refused_connections == 0 and n.buffers.idle_bytes > 0
                       for n in swarm.nodes.values())


@pytest.mark.parametrize("other", [dataclasses.replace(TLS, run_key="another"), RPC], ids=["other-key", "plain"])
def test_a_node_of_another_key_or_without_tls_cannot_take_part(other) -> None:
    """A member whose certificates come from another run key (or who speaks plain TCP to TLS peers) fails
    every call to and from the others: they commit without it, on the mean of their own two shards."""
    cfgs = {"a": TLS, "b": TLS, "c": other}
    with Swarm(NAMES, rpc=cfgs) as swarm:
        deltas = deltas_for(NAMES, NUMEL, seed=0)
        results = swarm.average(0, deltas)
        assert not results["c"].committed
        bounds = shard_bounds(NUMEL, (0.0,) * len(NAMES))
        for name in ("a", "b"):
            r = results[name]
            assert r.committed and r.members == ("a", "b"), (name, r.reason)
            assert r.mean is not None
            for lo, hi in bounds[:2]:  # the shards a and b reduce: the mean of a's and b's parts exactly
                assert torch.equal(r.mean_tensor()[lo:hi], reference_mean(deltas, ["a", "b"], bounds)[lo:hi]), name


def _upload(client: RpcNode, server: RpcNode, payload: bytes, *, tls_ctx) -> list[bytes]:
    got: list[bytes] = []

    async def consume(view: memoryview) -> None:
        got.append(bytes(view))

    async def issue() -> bytes:
        assert server.bulk is not None
        return server.bulk.expect_upload(peer=client.peer_id, what="push of shard 0", size_bytes=len(payload),
                                         deadline=time.monotonic() + IO_S, consume=consume)

    token = server.run(issue(), timeout_s=IO_S)
    assert server.bulk is not None
    client.run(bulk.upload("127.0.0.1", server.bulk.port, token, client.ticket_proof(token), payload,
                           mac_key=client.secret.payloads, deadline=time.monotonic() + IO_S, what="push",
                           counters=client.counters, peer=server.peer_id, tls=tls_ctx), timeout_s=IO_S + 5)
    return got


def test_bulk_port_over_tls_moves_bytes_and_refuses_a_stranger_certificate() -> None:
    server = RpcNode(TLS, peer_id="r")
    client = RpcNode(TLS, peer_id="x", serve=False)
    stranger = RpcNode(dataclasses.replace(TLS, run_key="another"), peer_id="x", serve=False)
    server.start(), client.start(), stranger.start()
    try:
        payload = secrets.token_bytes(3_000_001)  # several TLS records and write chunks, odd length
        assert _upload(client, server, payload, tls_ctx=client.bulk_tls) == [payload]
        # The stranger trusts another authority: the server's certificate fails its check at once.
        with pytest.raises(RpcRejected) as info:
            _upload(stranger, server, payload, tls_ctx=stranger.bulk_tls)
        assert info.value.code == "UNAUTHENTICATED" and "certificate" in info.value.details
        # A plain client to a TLS port: its hello is not a TLS handshake, the connection is refused.
        with pytest.raises(RpcError):
            _upload(client, server, payload, tls_ctx=None)
        assert server.bulk is not None and server.bulk.refused_connections >= 1
        assert _upload(client, server, payload[:10], tls_ctx=client.bulk_tls) == [payload[:10]]  # still serving
    finally:
        for node in (server, client, stranger):
            node.close()


def test_tls_without_a_run_key_is_refused() -> None:
    with pytest.raises(TlsWithoutKeyError, match="needs a run key"):
        RpcNode(dataclasses.replace(TLS, run_key=""), peer_id="a")


@pytest.mark.timeout(180)
def test_a_tls_run_commits_with_one_hash_and_a_late_joiner_heals_over_tls(tmp_path: Path) -> None:
    """rpc.tls comes from the run: three peers that never set it speak TLS only (gRPC and bulk port), a and b
    commit every round with one hash, c joins late and heals (a range of the state from each, over TLS),
    then commits with them."""
    # 6 rounds: a joiner that first meets the swarm mid-transition (its heal waits a round) still commits with it
    rounds, join_at, key = 6, 1, "the run's secret"
    run = [*TINY_RUN, "averaging.matchmaking_timeout_s=1.0", "averaging.allreduce_timeout_s=10",
           "averaging.contribution_window_s=3", "discovery.heartbeat_s=0.2", "discovery.record_ttl_s=3.0",
           "rpc.call_timeout_s=3.0", f"diloco.rounds={rounds}", "rpc.tls=true"]

    async def main() -> tuple[dict[str, EventLog], dict[str, bool]]:
        services = LoopbackServices()
        await publish_run(services.registry, run, run_key=key)
        outs = {n: EventLog() for n in "abc"}
        peers = {n: Peer(load_config(overrides=[f"checkpoint.dir={str(tmp_path / n)!r}", f"rpc.run_key={key!r}"]),
                         writer=EventWriter(outs[n]), services=services) for n in "abc"}
        tls: dict[str, bool] = {}

        def started(peer: Peer) -> None:
            node = peer.plane.node  # type: ignore[union-attr]
            tls[node.peer_id] = node.tls is not None and node.bulk is not None and node.bulk._tls is not None

        stop = asyncio.Event()
        tasks = [asyncio.create_task(run_peer(peers[n], stop, started=started)) for n in "ab"]
        while not any(e.committed and e.round >= join_at for e in outs["a"].rounds()):
            await asyncio.sleep(0.05)
        tasks.append(asyncio.create_task(run_peer(peers["c"], stop, started=started)))
        assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=150) == ["done"] * 3
        return outs, tls

    outs, tls = asyncio.run(main())
    told = story(outs)
    assert len(tls) == 3 and all(tls.values()), tls
    by_round = hashes_by_round(outs)
    assert sorted(by_round) == list(range(rounds)) and all(len(h) == 1 for h in by_round.values()), told
    # It downloads the swarm's state, a range from each of a and b (over TLS); a round whose material a and b
    # still keep (the last committed one) it may learn from its certificate first.
    heals = [e for e in outs["c"].events() if isinstance(e, HealEvent)]
    assert heals and heals[0].from_round == 0, told
    transfers = [e for e in heals if e.source != "certificate"]
    assert transfers and len(transfers[0].source.split(",")) == 2, told
    assert any(e.committed and len(e.members) == 3 for e in outs["c"].rounds()), told

"""The bulk port (rpc/bulk.py): rounds through it equal the reference; bad tickets, stolen tickets, wrong
run keys, truncated or oversized payloads are refused and logged; junk connections are crowded out; a peer
dying mid-transfer is an RpcUnavailable."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable

import pytest
import torch
from allreduce_swarm import RPC, Swarm, check_rounds, deltas_for, reference_mean

from swarmtrain.averaging.reducer import shard_bounds
from swarmtrain.compress import get_codec
from swarmtrain.rpc import bulk
from swarmtrain.rpc.averaging_client import AveragingClient
from swarmtrain.rpc.averaging_wire import PushHeader, SessionKey
from swarmtrain.rpc.node import Rejected, RpcNode, RpcRejected, RpcUnavailable
from swarmtrain.testing import wait_until

pytestmark = pytest.mark.integration

NAMES = ["a", "b", "c", "d"]
NUMEL = 200_000  # 200 KB shards: big enough for the buffer pool, still fast
GRPC = dataclasses.replace(RPC, bulk_transport="grpc")
IO_S = 10.0


def _rounds(swarm: Swarm, count: int) -> None:
    check_rounds(swarm, NAMES, NUMEL, count)


def _counted(swarm: Swarm, expected: tuple[int, int]) -> None:
    """Every node's byte counters reach `expected` (a reducer counts a served mean once it is out)."""
    wait_until(lambda: all(n.counters.totals() == expected for n in swarm.nodes.values()), timeout_s=IO_S,
               what=f"byte counters at {expected}")


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_rounds_match_the_reference_and_count_the_same_bytes_on_either_transport(transport: str) -> None:
    encoded = len(get_codec("fp32").encode(torch.zeros(NUMEL // 4)))  # one shard or mean on the wire
    with Swarm(NAMES, rpc=dict.fromkeys(NAMES, dataclasses.replace(RPC, bulk_transport=transport))) as swarm:
        assert all((node.bulk is not None) == (transport == "tcp") for node in swarm.nodes.values())
        _rounds(swarm, 2)
        _counted(swarm, (2 * 6 * encoded, 2 * 6 * encoded))  # per round: 3 shards + 3 means out, as many in
        if transport == "tcp":
            assert all(node.buffers.idle_bytes > 0 for node in swarm.nodes.values())  # buffers came back


def test_a_peer_that_serves_grpc_only_is_pushed_to_and_fetched_from_over_grpc() -> None:
    with Swarm(NAMES, rpc={"c": GRPC}) as swarm:
        assert swarm.nodes["c"].bulk is None and swarm.nodes["a"].bulk is not None
        _rounds(swarm, 1)


def _serving_node() -> RpcNode:
    node = RpcNode(RPC, peer_id="r")
    node.start()
    return node


def _ticket(node: RpcNode, size_bytes: int, got: list[bytes], *, refuse: str = "") -> bytes:
    async def consume(view: memoryview) -> None:
        if refuse:
            raise Rejected(refuse)
        got.append(bytes(view))

    async def issue() -> bytes:
        assert node.bulk is not None
        return node.bulk.expect_upload(peer="x", what="push of shard 0", size_bytes=size_bytes,
                                       deadline=time.monotonic() + IO_S, consume=consume)

    return node.run(issue(), timeout_s=IO_S)


def _upload(client: RpcNode, server: RpcNode, token: bytes, payload: bytes, *, mac_key: bytes = b"") -> None:
    assert server.bulk is not None
    client.run(bulk.upload("127.0.0.1", server.bulk.port, token, client.ticket_proof(token), payload,
                           mac_key=mac_key or client.secret.payloads, deadline=time.monotonic() + IO_S, what="push",
                           counters=client.counters, peer="r"),
               timeout_s=IO_S + 5)


def _refused(call: Callable[[], None]) -> RpcRejected:
    with pytest.raises(RpcRejected) as info:
        call()
    return info.value


def test_bad_tickets_truncated_and_oversized_uploads_are_refused_and_logged(caplog) -> None:
    caplog.set_level(logging.INFO)
    server, client = _serving_node(), RpcNode(RPC, peer_id="x", serve=False)
    client.start()
    try:
        got: list[bytes] = []
        payload = secrets.token_bytes(300_000)
        token = _ticket(server, len(payload), got)
        _upload(client, server, token, payload)
        assert got == [payload]
        assert server.counters.per_peer()["x"] == (0, len(payload))
        assert client.counters.per_peer()["r"] == (len(payload), 0)

        reused = _refused(lambda: _upload(client, server, token, payload))  # one connection per ticket
        forged = _refused(lambda: _upload(client, server, secrets.token_bytes(bulk.TOKEN_BYTES), payload))
        assert reused.code == forged.code == "UNAUTHENTICATED" and "ticket" in forged.details
        # A token seen on the wire, presented by another peer (same run key, another id): no use to it.
        thief = RpcNode(RPC, peer_id="thief", serve=False)
        thief.start()
        try:
            stolen = _ticket(server, len(payload), got)
            theft = _refused(lambda: _upload(thief, server, stolen, payload))
            assert theft.code == "UNAUTHENTICATED" and "issued to x" in theft.details
            _upload(client, server, stolen, payload)  # the refused try did not burn the owner's ticket
            assert got == [payload, payload]
            got.pop()
        finally:
            thief.close()

        short = _refused(lambda: _upload(client, server, _ticket(server, len(payload), got), payload[:1000]))
        assert short.code == "INVALID_ARGUMENT" and "truncated" in short.details
        long = _refused(lambda: _upload(client, server, _ticket(server, 1000, got), payload))
        assert long.code == "RESOURCE_EXHAUSTED" and "more than the 1000 bytes" in long.details
        altered = _refused(lambda: _upload(client, server, _ticket(server, 1000, got), payload[:1000],
                                           mac_key=bytes(32)))  # as if a byte changed on the way
        assert altered.code == "INVALID_ARGUMENT" and "MAC is wrong" in altered.details
        refused = _refused(lambda: _upload(client, server, _ticket(server, 10, got, refuse="NaN here"), bytes(10)))
        assert refused.code == "INVALID_ARGUMENT" and refused.details == "NaN here"
        assert got == [payload]  # nothing refused reached the consumer

        assert server.bulk is not None
        with socket.create_connection(("127.0.0.1", server.bulk.port), timeout=IO_S) as raw:
            raw.sendall(b"HTTP" + bytes(bulk.TOKEN_BYTES + bulk.PROOF_BYTES))  # not our protocol
            code, length = struct.unpack("!BI", raw.recv(5))
            assert bulk.CODES[code] == "UNAUTHENTICATED" and b"magic" in raw.recv(length)
    finally:
        client.close()
        server.close()
    logged = " ".join(r.getMessage() for r in caplog.records)
    for words in ("unknown, used or expired bulk ticket", "truncated push", "more than the 1000", "bad magic",
                  "MAC is wrong"):
        assert words in logged, words


def test_a_caller_hoarding_tickets_voids_only_its_own_oldest_and_no_ticket_outlives_the_cap() -> None:
    """Tickets used to live for the caller's deadline, as many as it asked for: a key holder could pin any
    number of them (each a download's bytes, or a consumer) for as long as it liked."""
    server, client = _serving_node(), RpcNode(RPC, peer_id="x", serve=False)
    client.start()
    try:
        got: list[bytes] = []
        other = _ticket(server, 10, got)  # x's oldest
        tokens = [_ticket(server, 10, got) for _ in range(bulk.MAX_TICKETS_PER_PEER)]  # one past the cap

        async def issue_y() -> bytes:
            assert server.bulk is not None

            async def consume(view: memoryview) -> None:
                got.append(bytes(view))
            return server.bulk.expect_upload(peer="y", what="push", size_bytes=10,
                                             deadline=time.monotonic() + 10 * bulk.MAX_TICKET_TTL_S, consume=consume)

        y_token = server.run(issue_y(), timeout_s=IO_S)
        voided = _refused(lambda: _upload(client, server, other, bytes(10)))
        assert voided.code == "UNAUTHENTICATED"
        _upload(client, server, tokens[-1], b"0123456789")  # its newer tickets stand
        assert got == [b"0123456789"]
        assert server.bulk is not None
        ticket = server.bulk._tickets[y_token]  # another caller's stands too, its life capped
        assert ticket.deadline <= time.monotonic() + bulk.MAX_TICKET_TTL_S
        assert len(server.bulk._tickets) == bulk.MAX_TICKETS_PER_PEER  # x: the cap, less the one used; y: one
    finally:
        client.close()
        server.close()


def test_a_wrong_run_key_gets_no_ticket(monkeypatch) -> None:
    with Swarm(["a", "b"]) as swarm:
        group = swarm._group(0)
        key = SessionKey(group.run_id, 0, group.group_id, 0, ("a", "b"))
        header = PushHeader(key, "b", 0, 10, 40, "fp32")
        monkeypatch.setenv("SWARMTRAIN_RUN_KEY", "guess")
        guesser = RpcNode(RPC, peer_id="guesser", serve=False)
        guesser.start()
        try:
            push = AveragingClient(guesser).push(swarm.nodes["a"].endpoint, "a", header, bytes(40),
                                                 deadline=time.monotonic() + IO_S)
            assert _refused(lambda: guesser.run(push, timeout_s=IO_S + 5)).code == "UNAUTHENTICATED"
        finally:
            guesser.close()
        bulk_server = swarm.nodes["a"].bulk
        assert bulk_server is not None and not bulk_server._tickets and swarm.nodes["a"].counters.totals() == (0, 0)


def _fake_reducer(script: Callable[[socket.socket], None]) -> tuple[int, threading.Thread]:
    """A bulk port that accepts one connection and plays `script` on it (a reducer crashing mid-transfer)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(IO_S)

    def run() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(IO_S)
                hello = conn.recv(len(bulk.MAGIC) + bulk.TOKEN_BYTES + bulk.PROOF_BYTES, socket.MSG_WAITALL)
                assert hello[:4] == bulk.MAGIC
                script(conn)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener.getsockname()[1], thread


def test_a_reducer_dying_mid_transfer_is_unavailable_to_the_member() -> None:
    client = RpcNode(RPC, peer_id="x", serve=False)
    client.start()
    try:
        def dies_mid_download(conn: socket.socket) -> None:
            conn.sendall(struct.pack("!BIQ", 0, 0, 100_000) + bytes(40_000))

        port, thread = _fake_reducer(dies_mid_download)
        fetch = bulk.download("127.0.0.1", port, bytes(bulk.TOKEN_BYTES), bytes(bulk.PROOF_BYTES),
                              mac_key=client.secret.payloads, size_bytes=100_000,
                              deadline=time.monotonic() + IO_S, what="mean", counters=client.counters, peer="r",
                              pool=client.buffers)
        with pytest.raises(RpcUnavailable, match="40000 of 100000"):
            client.run(fetch, timeout_s=IO_S + 5)
        thread.join(IO_S)

        def serves_an_altered_mean(conn: socket.socket) -> None:  # the bytes arrive whole, their MAC does not match
            conn.sendall(struct.pack("!BIQ", 0, 0, 1000) + bytes(1000) + bytes(bulk.MAC_BYTES))

        port, thread = _fake_reducer(serves_an_altered_mean)
        fetch = bulk.download("127.0.0.1", port, bytes(bulk.TOKEN_BYTES), bytes(bulk.PROOF_BYTES),
                              mac_key=client.secret.payloads, size_bytes=1000, deadline=time.monotonic() + IO_S,
                              what="mean", counters=client.counters, peer="r", pool=client.buffers)
        with pytest.raises(RpcRejected, match="MAC is wrong"):
            client.run(fetch, timeout_s=IO_S + 5)
        thread.join(IO_S)

        def dies_mid_upload(conn: socket.socket) -> None:
            conn.sendall(struct.pack("!BI", 0, 0))
            conn.recv(1000, socket.MSG_WAITALL)

        port, thread = _fake_reducer(dies_mid_upload)
        with pytest.raises(RpcUnavailable):
            client.run(bulk.upload("127.0.0.1", port, bytes(bulk.TOKEN_BYTES), bytes(bulk.PROOF_BYTES), bytes(8 << 20),
                                   mac_key=client.secret.payloads,
                                   deadline=time.monotonic() + IO_S, what="push", counters=client.counters,
                                   peer="r"), timeout_s=IO_S + 5)
        thread.join(IO_S)
    finally:
        client.close()


def test_a_reducer_killed_while_serving_means_never_splits_the_mean() -> None:
    """c dies right after handing out its first mean ticket (its node closes, as its process would).
    Whichever attempt commits, if any (the first, where c's bytes arrived in time, or the retry without
    c), every committed member holds one mean, the exact reference over its contributors; the others
    abort (and heal by state transfer), keeping no local values; and the next round goes on without c."""
    with Swarm(NAMES) as swarm:
        c = swarm.nodes["c"]
        assert c.bulk is not None
        offer = c.bulk.offer_download
        dead = threading.Event()

        def offer_then_die(**kw: object) -> bytes:
            token = offer(**kw)  # type: ignore[arg-type]
            if not dead.is_set():  # the ticket is out; its bytes may never come
                dead.set()
                threading.Thread(target=c.close, name="crash-c", daemon=True).start()
            return token

        c.bulk.offer_download = offer_then_die  # type: ignore[method-assign]
        deltas = deltas_for(NAMES, NUMEL)
        results = swarm.average(0, deltas)
        committed = [r for r in results.values() if r.committed]  # possibly none: the round may abort everywhere
        assert len({r.members for r in committed}) <= 1, [r.reason for r in results.values()]
        for name, r in results.items():
            if r.committed:
                assert r.mean is not None and torch.equal(r.mean_tensor(),
                                                          reference_mean(deltas, r.members, ((0, NUMEL),))), name
            else:
                assert r.mean is None and r.reason, name
        survivors = ["a", "b", "d"]
        later = swarm.average(1, deltas_for(survivors, NUMEL, seed=1))
        assert all(r.committed for r in later.values()), [r.reason for r in later.values()]
        means = [r.mean_tensor() for r in later.values()]
        assert all(m is not None and torch.equal(m, means[0]) for m in means)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_thousand_junk_connections_leave_the_swarm_committing_with_bounded_memory() -> None:
    names = ["a", "b", "c"]
    with Swarm(names) as swarm:
        target = swarm.nodes["a"].bulk
        assert target is not None
        deltas = deltas_for(names, NUMEL, seed=0)
        swarm.average(0, deltas)  # buffers of a round's size exist before the baseline
        rss_before = _rss_bytes()
        junk: list[socket.socket] = []
        try:
            for i in range(1000):  # idle, half a hello, or garbage: none of it can be a member's
                sock = socket.create_connection(("127.0.0.1", target.port), timeout=IO_S)
                sock.sendall([b"", bulk.MAGIC + bytes(7), secrets.token_bytes(64)][i % 3])
                junk.append(sock)
            wait_until(lambda: target.refused_connections >= 1000 - target.max_unauthenticated, timeout_s=IO_S,
                       what="junk connections crowded out")
            assert len(target._unauthenticated) <= target.max_unauthenticated
            for round_index in (1, 2):
                deltas = deltas_for(names, NUMEL, seed=round_index)
                expected = reference_mean(deltas, names, shard_bounds(NUMEL, (0.0,) * len(names)))
                for name, r in swarm.average(round_index, deltas).items():
                    assert r.committed and r.mean is not None and torch.equal(r.mean_tensor(), expected), name
            assert _rss_bytes() - rss_before < 64 << 20
        finally:
            for sock in junk:
                sock.close()


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_means_altered_on_the_way_are_refused_by_their_mac(monkeypatch: pytest.MonkeyPatch, transport: str) -> None:
    """Every reducer's mean reaches its members with a MAC that does not match (as after a man in the middle
    changed bytes): no member commits a mean it cannot verify."""
    from swarmtrain.rpc import averaging_wire

    async def forged_mac(*_args: object) -> bytes:
        return bytes(32)

    names = ["a", "b"]
    rpc = dataclasses.replace(RPC, bulk_transport=transport)
    with Swarm(names, rpc=dict.fromkeys(names, rpc)) as swarm:
        monkeypatch.setattr(averaging_wire, "mac_of", forged_mac)  # the gRPC stream's serving side
        if transport == "tcp":
            real = bulk._bulk_mac

            def forge_means_only(key: bytes, token: bytes, digest: bytes) -> bytes:
                return bytes(32) if token in served else real(key, token, digest)

            served: set[bytes] = set()
            offer = bulk.BulkServer.offer_download

            def offer_and_note(self: bulk.BulkServer, **kw: object) -> bytes:
                token = offer(self, **kw)  # type: ignore[arg-type]
                served.add(token)
                return token

            monkeypatch.setattr(bulk.BulkServer, "offer_download", offer_and_note)
            monkeypatch.setattr(bulk, "_bulk_mac", forge_means_only)
        results = swarm.average(0, deltas_for(names, 20_000))
    assert not any(r.committed for r in results.values()), {n: r.reason for n, r in results.items()}
    assert all("MAC" in r.reason for r in results.values()), {n: r.reason for n, r in results.items()}


def test_a_mean_offered_to_several_members_is_digested_once_and_lands_in_their_own_pooled_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three downloads of one offered payload: each gets the bytes and their BLAKE3 digest (checked against the
    sender's MAC), the sender hashes them once for all three, and each copy lives in the client's pool memory,
    which comes back once the caller drops it."""
    from blake3 import blake3

    hashed: list[int] = []
    real = bulk.digest_of

    async def counted(data: bytes | bytearray | memoryview) -> bytes:
        hashed.append(len(data))
        return await real(data)

    monkeypatch.setattr(bulk, "digest_of", counted)
    server, client = _serving_node(), RpcNode(RPC, peer_id="x", serve=False)
    client.start()
    try:
        payload = secrets.token_bytes(3 * (1 << 20) + 5)

        async def offer() -> list[bytes]:
            assert server.bulk is not None
            return [server.bulk.offer_download(peer="x", what="mean", data=payload,
                                               deadline=time.monotonic() + IO_S) for _ in range(3)]

        tokens = server.run(offer(), timeout_s=IO_S)
        assert server.bulk is not None and len(server.bulk._digests) == 1

        async def fetch_all() -> list[bulk.Downloaded]:
            assert server.bulk is not None
            return list(await asyncio.gather(*(
                bulk.download("127.0.0.1", server.bulk.port, t, client.ticket_proof(t), mac_key=client.secret.payloads,
                              size_bytes=len(payload), deadline=time.monotonic() + IO_S, what="mean",
                              counters=client.counters, peer="r", pool=client.buffers) for t in tokens)))

        got = client.run(fetch_all(), timeout_s=IO_S + 5)
        assert all(bytes(g.view) == payload and g.digest == blake3(payload).digest() for g in got)
        assert hashed == [len(payload)]  # the sender's one pass; the client hashed as the bytes came in
        wait_until(lambda: not server.bulk._digests, timeout_s=IO_S, what="the digest forgotten with its tickets")
        idle = client.buffers.idle_bytes
        del got
        assert client.buffers.idle_bytes >= idle + 3 * (4 << 20)  # three 4 MiB blocks back in the client's pool
    finally:
        client.close()
        server.close()

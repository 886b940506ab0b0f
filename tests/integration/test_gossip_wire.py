"""The gossip data plane over loopback gRPC (rpc/gossip_wire.py): a partner's part arrives whole and MAC-checked;
a call for a round not reached yet waits for it, or ends at its own deadline; an old round is gone; a peer
without the run key cannot fetch, and a part altered on the way is refused."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from swarmtrain.config import RpcConfig
from swarmtrain.rpc.errors import RpcError, RpcRejected
from swarmtrain.rpc.gossip_wire import GossipClient, GossipMailbox, GossipPart, serve_gossip
from swarmtrain.rpc.node import RpcNode

pytestmark = pytest.mark.integration

RPC = RpcConfig(run_key="k", chunk_bytes=4096, max_message_bytes=1 << 20, retries=0, backoff_s=0.01)


def _part(round_index: int, size: int = 10_000) -> GossipPart:
    return GossipPart(round=round_index, peer_id="server", numel=size // 4, delta_codec="fp32", weights_codec="fp16",
                      delta=bytes([round_index % 256]) * size, weights=bytes(range(256)) * (size // 512))


@pytest.fixture
def pair(no_thread_leak: None):
    server = RpcNode(RPC, peer_id="server")
    mailbox = GossipMailbox(server, run_id="run", keep=2)
    serve_gossip(server, mailbox)
    client = RpcNode(RPC, peer_id="client", serve=False)
    server.start()
    client.start()
    yield server, mailbox, client
    client.close()
    server.close()


def _fetch(client: RpcNode, endpoint: str, round_index: int, *, timeout_s: float, numel: int = 2500,
           run_id: str = "run") -> GossipPart:
    fetcher = GossipClient(client, run_id=run_id)
    return client.run(fetcher.get_part(endpoint, round_index=round_index, numel=numel, max_bytes=1 << 20,
                                       deadline=time.monotonic() + timeout_s), timeout_s=timeout_s + 5)


def _publish(node: RpcNode, mailbox: GossipMailbox, part: GossipPart) -> None:
    node.run(mailbox.publish(part), timeout_s=5)


def test_a_published_part_arrives_whole(pair) -> None:
    server, mailbox, client = pair
    sent = _part(3)
    _publish(server, mailbox, sent)
    got = _fetch(client, server.endpoint, 3, timeout_s=5)
    assert got == sent  # chunked over 4 KiB frames, reassembled
    assert mailbox.served_of(3) == 1


def test_a_call_for_a_round_not_reached_waits_for_it_or_ends_at_its_deadline(pair) -> None:
    server, mailbox, client = pair
    later = threading.Timer(0.5, _publish, args=(server, mailbox, _part(1)))
    later.start()
    start = time.monotonic()
    got = _fetch(client, server.endpoint, 1, timeout_s=10)
    later.join()
    assert got.round == 1 and 0.4 < time.monotonic() - start < 8
    start = time.monotonic()
    with pytest.raises(RpcError) as e:  # round 2 never comes: the caller's deadline ends the wait
        _fetch(client, server.endpoint, 2, timeout_s=1.0)
    assert time.monotonic() - start < 4
    assert "not reached" in str(e.value) or "DEADLINE" in str(e.value)


def test_an_old_round_is_gone(pair) -> None:
    server, mailbox, client = pair
    for r in range(4):  # keep=2: rounds 2 and 3 stay
        _publish(server, mailbox, _part(r))
    with pytest.raises(RpcRejected, match="NOT_FOUND"):
        _fetch(client, server.endpoint, 0, timeout_s=3)
    assert _fetch(client, server.endpoint, 2, timeout_s=3).round == 2


def test_a_peer_without_the_run_key_cannot_fetch(pair, no_thread_leak: None) -> None:
    server, mailbox, _ = pair
    _publish(server, mailbox, _part(0))
    outsider = RpcNode(RpcConfig(run_key="other", chunk_bytes=4096, retries=0), peer_id="outsider", serve=False)
    outsider.start()
    try:
        with pytest.raises(RpcRejected) as e:
            _fetch(outsider, server.endpoint, 0, timeout_s=3)
        assert e.value.code in ("UNAUTHENTICATED", "PERMISSION_DENIED"), e.value
    finally:
        outsider.close()


def test_a_part_of_another_model_or_altered_on_the_way_is_refused(pair) -> None:
    server, mailbox, client = pair
    _publish(server, mailbox, _part(0))
    with pytest.raises(RpcRejected, match="values, this model"):
        _fetch(client, server.endpoint, 0, timeout_s=3, numel=99)
    # the served bytes change after their MAC was taken (a corrupting relay): the client refuses them
    header, data = mailbox._parts[0]
    mailbox._parts[0] = (header, data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(RpcRejected, match="MAC"):
        _fetch(client, server.endpoint, 0, timeout_s=3)


def test_a_mailbox_keeps_at_least_one_round() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        GossipMailbox(RpcNode(RPC, peer_id="x"), run_id="run", keep=0)


def test_waiting_callers_all_wake_on_publish(pair) -> None:
    server, mailbox, client = pair

    async def several() -> list[GossipPart]:
        fetcher = GossipClient(client, run_id="run")
        deadline = time.monotonic() + 10
        return await asyncio.gather(*(fetcher.get_part(server.endpoint, round_index=5, numel=2500, max_bytes=1 << 20,
                                                       deadline=deadline) for _ in range(3)))

    later = threading.Timer(0.3, _publish, args=(server, mailbox, _part(5)))
    later.start()
    got = client.run(several(), timeout_s=15)
    later.join()
    assert [p.round for p in got] == [5, 5, 5] and mailbox.served_of(5) == 3

"""A peer that died and came back at its address is reachable again within about a second, however long it was
down: cached channels do not sit in gRPC's growing reconnect backoff (120 s at most by default)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc import aio

from swarmtrain.config import RpcConfig
from swarmtrain.rpc.node import RECONNECT_BACKOFF_MAX_MS, RpcNode

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

DOWN_S = 6.0  # long enough for the default backoff to pass 2.5 s (1, 1.6, 2.56 s ... with ±20% jitter)


async def _reachable(node: RpcNode, endpoint: str) -> bool:
    """Whether a call reaches `endpoint`'s server: any answer but UNAVAILABLE (the method does not exist there)."""
    call = node.channel(endpoint).unary_unary("/swarmtrain.test.Nothing/Ping")
    try:
        await call(b"", timeout=1.0, metadata=node.metadata("/swarmtrain.test.Nothing/Ping", endpoint))
    except aio.AioRpcError as e:
        return e.code() != grpc.StatusCode.UNAVAILABLE
    return True


def test_a_restarted_peer_is_reachable_within_a_second_of_its_return(no_thread_leak: None) -> None:
    server = RpcNode(RpcConfig(run_key="k"), peer_id="server")
    endpoint = server.start()
    port = int(endpoint.rsplit(":", 1)[1])
    client = RpcNode(RpcConfig(run_key="k"), peer_id="client", serve=False)
    client.start()
    back = RpcNode(RpcConfig(run_key="k", port=port), peer_id="server")
    try:
        assert client.run(_reachable(client, endpoint), timeout_s=5)
        server.close()

        async def calls_while_down() -> None:  # the swarm keeps calling the dead peer, its channel backs off
            start = time.monotonic()
            while time.monotonic() - start < DOWN_S:
                assert not await _reachable(client, endpoint)
                await asyncio.sleep(0.3)

        client.run(calls_while_down(), timeout_s=DOWN_S + 10)
        back.start()
        returned = time.monotonic()

        async def until_reachable() -> float:
            while not await _reachable(client, endpoint):
                await asyncio.sleep(0.02)
            return time.monotonic() - returned

        took_s = client.run(until_reachable(), timeout_s=15)
    finally:
        client.close()
        back.close()
    # one backoff at most, its jitter and a connection: the default backoff took 2.8 s after 6 s down here
    assert took_s < 1.5 * RECONNECT_BACKOFF_MAX_MS / 1000 + 0.3, took_s

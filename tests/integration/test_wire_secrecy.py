"""No byte of the run key (nor of any key derived from it) crosses the wire: every packet on the loopback
interface is captured while a keyed swarm averages over both transports and a joiner downloads state."""

from __future__ import annotations

import dataclasses
import secrets
import socket
import threading
from collections.abc import Iterator

import grpc
import pytest
import torch
from allreduce_swarm import RPC, Swarm, deltas_for

from swarmtrain.config import RunConfig
from swarmtrain.rpc.node import RpcNode
from swarmtrain.sync.transfer import StateServer, StateSnapshot, fetch_state
from swarmtrain.testing import wait_until
from swarmtrain.trust import RunSecret

pytestmark = pytest.mark.integration

# Characters whose HPACK Huffman codes are longer than 8 bits: a header value made of them is sent
# literally, so a leaked key would show in the capture as it is (the control below checks that it does).
KEY = "~^{}|<`" * 6
ETH_P_ALL = 0x0003
CAPTURE_LIMIT_BYTES = 256 << 20


class LoopbackCapture:
    """Every frame on `lo` (AF_PACKET, needs root) into one buffer, until `stop()`."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)  # (capped by net.core.rmem_max)
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.1)
        self.data = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and len(self.data) < CAPTURE_LIMIT_BYTES:
            try:
                self.data += self.sock.recv(1 << 16)
            except TimeoutError:
                continue

    def stop(self) -> bytes:
        """Everything captured up to now: a marker datagram sent last must have arrived before it stops."""
        marker = secrets.token_bytes(16)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.sendto(marker, ("127.0.0.1", 9))
        wait_until(lambda: marker in self.data or len(self.data) >= CAPTURE_LIMIT_BYTES, timeout_s=10,
                   what="the capture's marker")
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        return bytes(self.data)


@pytest.fixture
def capture() -> Iterator[type[LoopbackCapture]]:
    try:
        LoopbackCapture().stop()
    except PermissionError:
        pytest.skip("capturing packets needs root (CAP_NET_RAW)")
    yield LoopbackCapture


def _secrets() -> list[bytes]:
    secret = RunSecret.from_run_key(KEY)
    raw = [KEY.encode(), secret.records, secret.calls, secret.tickets]
    return raw + [k.hex().encode() for k in raw[1:]]


def test_a_control_header_carrying_the_key_is_seen_by_the_capture(capture: type[LoopbackCapture]) -> None:
    rpc = dataclasses.replace(RPC, run_key=KEY)
    server = RpcNode(rpc, peer_id="server")
    server.start()
    cap = capture()
    try:
        async def call() -> None:
            channel = grpc.aio.insecure_channel(server.endpoint)
            try:
                with pytest.raises(grpc.aio.AioRpcError):  # refused: the capture only needs the bytes sent
                    await channel.unary_unary("/swarmtrain.wire.Averaging/Vote")(b"", metadata=(("x-control", KEY),),
                                                                                  timeout=5)
            finally:
                await channel.close()

        server.run(call(), timeout_s=10)
    finally:
        data = cap.stop()
        server.close()
    assert KEY.encode() in data


def test_no_byte_of_the_run_key_is_on_the_wire(capture: type[LoopbackCapture]) -> None:
    names = ["a", "b", "c"]
    rpcs = {n: dataclasses.replace(RPC, run_key=KEY, bulk_transport="grpc" if n == "c" else "tcp") for n in names}
    cap = capture()
    try:
        with Swarm(names, rpc=rpcs) as swarm:
            for round_index in range(2):
                results = swarm.average(round_index, deltas_for(names, 50_000, seed=round_index))
                assert all(r.committed for r in results.values()), {n: r.reason for n, r in results.items()}
    finally:
        data = cap.stop()
    assert len(data) > 1_000_000  # the rounds' shards and means went through the capture
    assert b"x-swarmtrain-auth" in data or b"swarmtrain.wire.Averaging" in data
    leaked = [s for s in _secrets() if s in data]
    assert not leaked


def test_no_byte_of_the_run_key_is_on_the_wire_of_a_state_transfer(capture: type[LoopbackCapture]) -> None:
    rpc = dataclasses.replace(RPC, run_key=KEY)
    donor = RpcNode(rpc, peer_id="donor")
    server = StateServer(donor)
    joiner = RpcNode(rpc, peer_id="joiner", serve=False)
    for node in (donor, joiner):
        node.start()
    cap = capture()
    try:
        server.publish(StateSnapshot(3, {"w": torch.arange(10_000, dtype=torch.float32)}, {}, RunConfig()))
        got = fetch_state(joiner, [donor.endpoint], run_id=RunConfig().train.run_id, timeout_s=10)
        assert got.round == 3 and torch.equal(got.params["w"], torch.arange(10_000, dtype=torch.float32))
    finally:
        data = cap.stop()
        for node in (donor, joiner):
            node.close()
    assert b"params/w" in data  # the state itself went through the capture
    assert not [s for s in _secrets() if s in data]


def _samples(tensor: torch.Tensor, count: int = 8, size: int = 32) -> list[bytes]:
    """`count` runs of `size` bytes from the fp32 encoding of `tensor`: what a plain payload shows on the wire."""
    raw = tensor.numpy().tobytes()
    step = (len(raw) - size) // count
    return [raw[i * step:i * step + size] for i in range(count)]


def test_with_tls_no_payload_state_or_call_name_is_readable_on_the_wire(capture: type[LoopbackCapture]) -> None:
    """rpc.tls: the rounds' shards (both transports), a state download and the calls' names and headers
    are ciphertext on the wire; the same capture without TLS finds the shards (the control)."""
    names = ["a", "b", "c"]
    found: dict[bool, list[bytes]] = {}
    for tls in (False, True):
        rpcs = {n: dataclasses.replace(RPC, run_key=KEY, tls=tls, bulk_transport="grpc" if n == "c" else "tcp")
                for n in names}
        deltas = deltas_for(names, 50_000, seed=7)
        donor, joiner = RpcNode(rpcs["a"], peer_id="donor"), RpcNode(rpcs["a"], peer_id="joiner", serve=False)
        state = StateServer(donor)
        for node in (donor, joiner):
            node.start()
        cap = capture()
        try:
            with Swarm(names, rpc=rpcs) as swarm:
                results = swarm.average(0, deltas)
                assert all(r.committed for r in results.values()), {n: r.reason for n, r in results.items()}
            state.publish(StateSnapshot(3, {"w": torch.arange(10_000, dtype=torch.float32)}, {}, RunConfig()))
            got = fetch_state(joiner, [donor.endpoint], run_id=RunConfig().train.run_id, timeout_s=10)
            assert got.round == 3
        finally:
            data = cap.stop()
            for node in (donor, joiner):
                node.close()
        assert len(data) > 1_000_000
        plain = [*(s for d in deltas.values() for s in _samples(d, count=32)), b"params/w", b"x-swarmtrain-auth"]
        found[tls] = [s for s in plain if s in data]
        print(f"tls={tls}: {len(found[tls])} of {len(plain)} plaintext samples in {len(data)} captured bytes")
    # Without TLS: the state and many samples (not those of the shard a peer reduces itself, which it never
    # sends, nor those split across two packets or lost by a busy capture).
    assert b"params/w" in found[False] and len(found[False]) >= len(plain) // 8
    assert found[True] == []

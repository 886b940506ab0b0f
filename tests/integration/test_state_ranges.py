"""A joiner downloads the state from several donors at once, a range from each (sync/transfer.py:
fetch_state_parallel): the result equals the published state, the bytes are spread over the donors, a
donor serving another state is left out, a donor that dies is covered by the others, a donor that
serves other bytes under the honest checksum fails the download, and a bad range is refused."""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest
import torch

from swarmtrain.config import RpcConfig, RunConfig
from swarmtrain.round.ballots import Voter
from swarmtrain.rpc.node import RpcNode, RpcRejected
from swarmtrain.rpc.state_wire import StateClient
from swarmtrain.sync.transfer import (
    StateSnapshot,
    StateTransferError,
    fetch_state_parallel,
    split_ranges,
)
from swarmtrain.testing import FaultPlan
from swarmtrain.testing.state_faults import faulty_state_server

pytestmark = pytest.mark.integration

RPC = RpcConfig(run_key="k", chunk_bytes=4096, max_message_bytes=1 << 20, retries=1, backoff_s=0.01)
CONFIG = RunConfig().replace(train={"run_id": "ranges"})
SHAPES = {"w": (256, 65), "b": (65,)}


def _snapshot(round_index: int) -> StateSnapshot:
    g = torch.Generator().manual_seed(round_index)
    params = {name: torch.randn(*shape, generator=g) for name, shape in SHAPES.items()}
    return StateSnapshot(round_index, params, {"w": torch.randn(256, 65, generator=g)}, CONFIG,
                         voters=(Voter("a", 0), Voter("b", 3)))


def _same(got: StateSnapshot, ref: StateSnapshot) -> bool:
    return got.round == ref.round and got.voters == ref.voters and all(
        torch.equal(got.params[k], ref.params[k]) for k in ref.params) and all(
        torch.equal(got.momentum[k], ref.momentum[k]) for k in ref.momentum)


@pytest.fixture
def swarm(no_thread_leak: None):
    plan = FaultPlan()
    donors = [RpcNode(RPC, peer_id=f"d{i}") for i in range(4)]
    servers = [faulty_state_server(node, plan) for node in donors]
    joiner = RpcNode(RPC, peer_id="joiner", serve=False)
    for node in (*donors, joiner):
        node.start()
    yield donors, servers, joiner, plan
    for node in (*donors, joiner):
        node.close()


def test_split_ranges_cover_the_blob_once_in_nearly_equal_parts() -> None:
    for total in (1, 2, 7, 1000, 1001):
        for parts in (1, 2, 3, 8):
            ranges = split_ranges(total, parts)
            assert ranges[0][0] == 0 and ranges[-1][1] == total and len(ranges) == min(parts, total)
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
            sizes = [hi - lo for lo, hi in ranges]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_the_state_comes_in_one_range_from_each_donor(swarm) -> None:
    """Each donor's header carries its own config (its local sections differ): one blob all the same."""
    donors, servers, joiner, _ = swarm
    for i, server in enumerate(servers[:3]):
        server.publish(dataclasses.replace(_snapshot(5), config=CONFIG.replace(rpc={"port": 7000 + i})))
    got, served = fetch_state_parallel(joiner, [d.endpoint for d in donors[:3]], run_id="ranges",
                                       expected_shapes=SHAPES, timeout_s=20)
    assert _same(got, _snapshot(5)) and served == tuple(d.endpoint for d in donors[:3])
    assert got.config == CONFIG.replace(rpc={"port": 7000})  # the first donor's
    sent = [d.counters.totals()[0] for d in donors[:3]]
    total = sum(sent)
    assert total == joiner.counters.totals()[1] > 2 * 256 * 65 * 4  # the blob once, no byte twice
    assert all(abs(s - total / 3) <= 1 for s in sent), sent  # a third each


def test_a_donor_serving_another_state_is_left_out(swarm) -> None:
    donors, servers, joiner, _ = swarm
    servers[0].publish(_snapshot(6))  # moved on (or lies): its header differs from the two others'
    for server in servers[1:3]:
        server.publish(_snapshot(5))
    got, served = fetch_state_parallel(joiner, [d.endpoint for d in donors[:3]], run_id="ranges",
                                       expected_shapes=SHAPES, timeout_s=20)
    assert _same(got, _snapshot(5)) and served == (donors[1].endpoint, donors[2].endpoint)
    assert donors[0].counters.totals()[0] == 0


def test_no_two_donors_serving_one_state_is_an_error(swarm) -> None:
    donors, servers, joiner, _ = swarm
    servers[0].publish(_snapshot(5))
    servers[1].publish(_snapshot(6))
    with pytest.raises(StateTransferError, match="no two of 3 donors serve the same state"):
        fetch_state_parallel(joiner, [d.endpoint for d in donors[:3]], run_id="ranges", timeout_s=20)


def test_a_donor_that_dies_after_its_header_is_covered_by_the_others(swarm) -> None:
    """d2's range fails (its answers end a quarter early, as if it died mid-stream): another donor serves
    that range too."""
    donors, servers, joiner, plan = swarm
    for server in servers[:3]:
        server.publish(_snapshot(5))
    plan.add(peer="d2", round=5, call="state", action="truncate")  # its blob loses its last quarter
    got, served = fetch_state_parallel(joiner, [d.endpoint for d in donors[:3]], run_id="ranges",
                                       expected_shapes=SHAPES, timeout_s=20)
    assert _same(got, _snapshot(5)) and served == (donors[0].endpoint, donors[1].endpoint)


def test_other_bytes_under_the_honest_checksum_fail_the_whole_download(swarm) -> None:
    donors, servers, joiner, plan = swarm
    for server in servers[:3]:
        server.publish(_snapshot(5))
    plan.add(peer="d1", round=5, call="state", action="corrupt")  # honest header; the blob's middle (its range) not
    with pytest.raises(StateTransferError, match="sha256 mismatch"):
        fetch_state_parallel(joiner, [d.endpoint for d in donors[:3]], run_id="ranges", timeout_s=20)


def test_a_range_outside_the_blob_is_refused_with_a_typed_error(swarm) -> None:
    donors, servers, joiner, _ = swarm
    servers[0].publish(_snapshot(5))
    client = StateClient(joiner)
    for offset, length in ((10**9, 10), (0, 10**9), (-1, 10)):
        with pytest.raises(RpcRejected) as info:
            joiner.run(client.get_range(donors[0].endpoint, run_id="ranges", max_bytes=1 << 30,
                                        deadline=time.monotonic() + 10, offset=offset, length=length), timeout_s=15)
        assert info.value.code == "OUT_OF_RANGE", info.value
    assert servers[0].current() is not None  # and the donor serves on

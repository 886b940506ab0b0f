"""Pure pieces of the all-reduce: shard plan, commit rule, reference mean, session ids, FaultPlan, run key."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swarmtrain.averaging.aggregate import (
    Aggregation,
    mean_of,
    mean_of_encoded,
    mean_of_gathered,
    pack_bundle,
    unpack_bundle,
)
from swarmtrain.averaging.inprocess import InProcessGroup
from swarmtrain.averaging.reducer import shard_bounds
from swarmtrain.compress import CodecError
from swarmtrain.compress.registry import CODEC_NAMES, get_codec
from swarmtrain.round.rules import has_quorum
from swarmtrain.rpc.averaging_wire import SessionKey
from swarmtrain.rpc.faults import Fault, FaultSite, corrupt, truncate
from swarmtrain.testing import FaultPlan

pytestmark = pytest.mark.unit


@given(st.integers(0, 10**7), st.lists(st.floats(0, 1e10, allow_nan=False), min_size=1, max_size=9))
def test_shard_bounds_tile_the_tensor(numel: int, weights: list[float]) -> None:
    bounds = shard_bounds(numel, tuple(weights))
    assert len(bounds) == len(weights) and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(lo <= hi for lo, hi in bounds) and all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))


def test_shard_sizes_follow_bandwidth_and_are_equal_when_unknown() -> None:
    assert shard_bounds(100, (1.0, 3.0)) == [(0, 25), (25, 100)]
    assert shard_bounds(100, (1.0, 0.0, 3.0)) == [(0, 33), (33, 67), (67, 100)]
    with pytest.raises(ValueError, match="no reducers"):
        shard_bounds(10, ())


@pytest.mark.parametrize(("n", "size", "min_peers", "ok"), [(2, 3, 2, True), (2, 4, 2, False), (1, 1, 2, False),
                                                             (3, 4, 2, True), (1, 1, 1, True), (3, 5, 4, False)])
def test_commit_rule_needs_min_peers_and_a_strict_majority(n: int, size: int, min_peers: int, ok: bool) -> None:
    assert has_quorum(n, group_size=size, min_peers=min_peers) is ok


def test_reference_mean_sums_in_the_given_order_in_fp32() -> None:
    parts = [torch.tensor([1e8, 1.0]), torch.tensor([1.0, 1e8]), torch.tensor([-1e8, -1e8])]
    got = mean_of(parts)
    acc = torch.zeros(2)
    for p in parts:
        acc = acc + p
    assert got.dtype == torch.float32 and torch.equal(got, acc / 3)


@pytest.mark.parametrize(("name", "zstd_level"),
                         [(n, z) for n in CODEC_NAMES for z in (0, 3) if not (n == "sparse" and z)])
def test_a_mean_of_encoded_parts_is_the_reference_mean_of_their_decoded_values(name: str, zstd_level: int) -> None:
    """Reducers keep contributions encoded and decode them one at a time: the mean must not move a bit."""
    codec = get_codec(name, zstd_level=zstd_level)
    g = torch.Generator().manual_seed(7)
    raw = [torch.randn(5000, generator=g) * 10.0 ** torch.randint(-6, 4, (5000,), generator=g) for _ in range(4)]
    raw[1][:8] = -0.0
    raw[2][100:200] = 0.0
    parts = [memoryview(codec.encode(x)) for x in raw]
    got = mean_of_encoded(codec, parts, out=torch.full((5000,), float("nan")))
    want = mean_of([codec.decode(p) for p in parts])
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_session_ids_separate_attempts_and_reducer_sets() -> None:
    base = SessionKey("run", 4, "g" * 32, 0, ("a", "b"))
    ids = {base.session_id, SessionKey("run", 4, "g" * 32, 1, ("a", "b")).session_id,
           SessionKey("run", 4, "g" * 32, 1, ("a",)).session_id,
           SessionKey("run", 5, "g" * 32, 0, ("a", "b")).session_id}
    assert len(ids) == 4
    assert SessionKey.from_wire(base.to_wire()) == base


def test_fault_plan_matches_peer_round_call_and_optional_target() -> None:
    plan = FaultPlan().add(peer="b", round=1, call="push", target="c", action="drop")
    plan.add(peer="b", round=2, call="push", action="delay", delay_s=0.5, times=1)
    assert plan(FaultSite("b", 1, "push", "a")) is None
    assert plan(FaultSite("b", 1, "push", "c")) == Fault("drop")
    assert plan(FaultSite("b", 2, "push", "a")) == Fault("delay", 0.5)
    assert plan(FaultSite("b", 2, "push", "a")) is None  # fired its one time
    assert [s.round for s, _ in plan.hits] == [1, 2]
    with pytest.raises(ValueError, match="unknown action"):
        Fault("explode")  # type: ignore[arg-type]


def test_corrupt_and_truncate_change_payloads_deterministically() -> None:
    payload = bytes(range(64))
    assert corrupt(payload) == corrupt(payload) != payload and len(corrupt(payload)) == 64
    assert truncate(payload) == payload[:48]


def test_shards_align_to_codec_blocks_so_they_quantize_like_the_whole() -> None:
    from swarmtrain.compress import get_codec

    codec = get_codec("int8", block_size=64)
    x = torch.randn(10_007, generator=torch.Generator().manual_seed(0))
    bounds = shard_bounds(x.numel(), (1.0, 2.5, 1.3), align=codec.alignment)
    assert all(lo % 64 == 0 for lo, _ in bounds) and bounds[-1][1] == x.numel()
    assert [hi - lo for lo, hi in bounds] != [0, 0, 0]
    pieces = torch.cat([codec.decode(codec.encode(x[lo:hi])) for lo, hi in bounds])
    assert torch.equal(pieces, codec.decode(codec.encode(x)))  # what error feedback assumes was lost


def test_gathered_contributions_average_in_group_order_and_a_bundle_is_checked() -> None:
    codec = get_codec("sparse", chunk_size=64, density=0.1)
    g = torch.Generator().manual_seed(2)
    parts = [codec.encode(torch.randn(500, generator=g)) for _ in range(3)]
    got = mean_of_gathered(codec, unpack_bundle(pack_bundle(parts), max_parts=3), out=torch.full((500,), 9.0))
    want = torch.zeros(500)
    for p in parts:
        want += codec.decode(p)
    assert torch.equal(got, want / 3)
    bundle = pack_bundle(parts)
    for bad, what in ((bundle[:-1], "lengths add up"), (b"XXXX" + bundle[4:], "magic"), (bundle[:6], "head")):
        with pytest.raises(CodecError, match=what):
            unpack_bundle(bad, max_parts=3)
    with pytest.raises(CodecError, match="at most 2"):
        unpack_bundle(bundle, max_parts=2)


def test_an_in_process_gathering_round_counts_each_contribution_k_minus_1_times() -> None:
    codec = get_codec("sparse", chunk_size=64, density=0.1)
    g = torch.Generator().manual_seed(4)
    deltas = [torch.randn(640, generator=g) for _ in range(4)]
    results = InProcessGroup(codec, num_workers=4, aggregation=Aggregation(gather=True)).average_all(0, deltas)
    size = len(codec.encode(deltas[0]))
    want = mean_of_gathered(codec, [codec.encode(d) for d in deltas], out=torch.empty(640))
    for r in results:
        assert r.committed and torch.equal(r.mean_tensor(), want)
        assert r.bytes_sent == r.bytes_received == 3 * size
    with pytest.raises(ValueError, match="trimmed_mean"):
        Aggregation("trimmed_mean", gather=True)

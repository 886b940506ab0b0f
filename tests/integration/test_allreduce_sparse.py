"""Sparse rounds over loopback gRPC: reducers gather the contributions (less the caller's own), every member
averages them in group order, and every committed member holds the same mean: the reference's bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from allreduce_swarm import AVG, Swarm, deltas_for

from swarmtrain.averaging.aggregate import mean_of_gathered
from swarmtrain.averaging.reducer import shard_bounds
from swarmtrain.compress import get_codec
from swarmtrain.testing import CrashPlan, FaultPlan

pytestmark = pytest.mark.integration

NAMES = ["a", "b", "c", "d"]
NUMEL = 20_000
SPARSE = {"chunk_size": 256, "density": 0.05, "bits": 2}


def _reference(deltas: dict[str, torch.Tensor], contributors: list[str], num_reducers: int) -> torch.Tensor:
    codec = get_codec("sparse", **SPARSE)
    out = torch.empty(NUMEL)
    for lo, hi in shard_bounds(NUMEL, (0.0,) * num_reducers, align=codec.alignment):
        parts = [codec.encode(deltas[p][lo:hi]) for p in contributors]
        mean_of_gathered(codec, parts, out=out[lo:hi])
    return out


def test_every_member_averages_the_gathered_contributions_to_the_same_mean(no_thread_leak: None) -> None:
    with Swarm(NAMES, client_mode=["d"], codec="sparse", codec_options=SPARSE) as swarm:
        deltas = deltas_for(NAMES, NUMEL, seed=1)
        results = swarm.average(0, deltas)
    expected = _reference(deltas, NAMES, num_reducers=3)
    assert int((expected != 0).sum()) > NUMEL * 0.05  # a union of sparse contributions
    for name, r in results.items():
        assert r.committed, f"{name} aborted: {r.reason}"
        assert list(r.members) == NAMES
        assert r.mean is not None and torch.equal(r.mean_tensor(), expected), (
            f"{name}'s mean differs from the reference")
    # each contribution crosses the network 3 times (gRPC framing on top): far below int8's 2 × 3/4 × 1 B/value
    size = len(get_codec("sparse", **SPARSE).encode(deltas["a"]))
    assert all(r.bytes_sent < 3 * size + 40_000
               for r in results.values()), {n: r.bytes_sent for n, r in results.items()}


def test_a_lost_contribution_leaves_its_sender_out_of_every_bundle(no_thread_leak: None) -> None:
    plan = FaultPlan().add(peer="b", round=0, call="push", target="c", action="corrupt")
    with Swarm(NAMES, fault_hook=plan, codec="sparse", codec_options=SPARSE) as swarm:
        deltas = deltas_for(NAMES, NUMEL, seed=2)
        results = swarm.average(0, deltas)
    expected = _reference(deltas, ["a", "c", "d"], num_reducers=4)
    for name, r in results.items():
        assert r.committed, f"{name} aborted: {r.reason}"
        assert list(r.members) == ["a", "c", "d"] and r.failed == ("b",)
        assert r.mean is not None and torch.equal(r.mean_tensor(), expected), name


def test_reencode_sends_the_mean_re_sparsified(no_thread_leak: None) -> None:
    avg = dataclasses.replace(AVG, combine="reencode")
    with Swarm(NAMES[:3], avg=avg, codec="sparse", codec_options=SPARSE) as swarm:
        deltas = deltas_for(NAMES[:3], NUMEL, seed=3)
        results = swarm.average(0, deltas)
    codec = get_codec("sparse", **SPARSE)
    expected = torch.empty(NUMEL)
    for lo, hi in shard_bounds(NUMEL, (0.0,) * 3, align=codec.alignment):
        mean = mean_of_gathered(codec, [codec.encode(deltas[p][lo:hi]) for p in NAMES[:3]], out=torch.empty(hi - lo))
        expected[lo:hi] = codec.decode(codec.encode(mean))
    assert all(r.committed and r.mean is not None and torch.equal(r.mean_tensor(), expected) for r in results.values())
    assert int((expected != 0).sum()) <= codec.k * (NUMEL // 256 + 3)  # k per chunk survive (3 short last chunks)


def test_a_dead_reducer_s_bundle_comes_from_its_stand_in() -> None:
    # c serves a its bundle and dies when the next member asks (0.5 s later; its own pull is over by then): the
    # others get it from a stand-in (d gathers nothing: c's own part went with it; a serves the copy it
    # fetched), and everyone averages the same four contributions.
    late = ["b", "d"]
    plan = FaultPlan()
    for n in late:
        plan.add(peer="c", round=0, call="mean", target=n, action="delay", delay_s=0.5)
    crash = CrashPlan(plan).crash(peer="c", round=0, call="mean_asked", target=late[0])
    with Swarm(NAMES, fault_hook=crash, codec="sparse", codec_options=SPARSE) as swarm:
        crash.nodes = swarm.nodes
        deltas = deltas_for(NAMES, NUMEL, seed=3)
        results = swarm.average(0, deltas)
    assert crash.crashed
    expected = _reference(deltas, NAMES, num_reducers=4)
    for name in ("a", "b", "d"):
        r = results[name]
        assert r.committed, f"{name} aborted: {r.reason}"
        assert list(r.members) == NAMES
        assert r.mean is not None and torch.equal(r.mean_tensor(), expected), name

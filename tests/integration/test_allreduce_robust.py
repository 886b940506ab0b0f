"""Reducers with `averaging.aggregator = "trimmed_mean"` over loopback gRPC: one member sending Δ × 10⁶
moves no coordinate beyond the honest members' values, and every member commits the same result, the
per-shard reference of the codec round trips."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from allreduce_swarm import AVG, Swarm, deltas_for

from swarmtrain.averaging.reducer import shard_bounds
from swarmtrain.compress import get_codec

pytestmark = pytest.mark.integration

NAMES = ["a", "b", "c", "d", "e"]
NUMEL = 20_000


def _reference(deltas: dict[str, torch.Tensor], codec_name: str) -> torch.Tensor:
    codec = get_codec(codec_name)
    out = torch.empty(NUMEL)
    for lo, hi in shard_bounds(NUMEL, (0.0,) * len(NAMES), align=codec.alignment):
        parts = torch.stack([codec.decode(codec.encode(deltas[n][lo:hi])) for n in NAMES])
        ordered = parts.sort(dim=0).values
        middle = (ordered[1] + ordered[2] + ordered[3]) / (len(NAMES) - 2)  # fp32, added in ascending order
        out[lo:hi] = codec.decode(codec.encode(middle))
    return out


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_a_member_scaling_its_delta_by_a_million_moves_nothing_past_the_honest_values(codec: str) -> None:
    avg = dataclasses.replace(AVG, aggregator="trimmed_mean", trim=1)
    deltas = deltas_for(NAMES, NUMEL, seed=5)
    deltas["e"] = deltas["e"] * 1e6
    with Swarm(NAMES, avg=avg, codec=codec) as swarm:
        results = swarm.average(0, deltas)
    assert all(r.committed for r in results.values()), {n: r.reason for n, r in results.items()}
    means = [r.mean_tensor() for r in results.values()]
    assert all(m is not None and torch.equal(m, means[0]) for m in means)
    expected = _reference(deltas, codec)
    assert torch.equal(means[0], expected)  # type: ignore[arg-type]
    honest = torch.stack([deltas[n] for n in NAMES[:-1]])
    slack = 0.05 if codec == "int8" else 1e-6  # one re-encode of the result
    assert bool((means[0] <= honest.max(0).values + slack).all() and (means[0] >= honest.min(0).values - slack).all())

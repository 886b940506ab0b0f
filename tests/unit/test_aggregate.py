"""Aggregation (averaging/aggregate.py) and simulated attacks (averaging/attacks.py): the trimmed mean
against a reference that sorts every coordinate, its robustness to one liar, and the attacks' shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmtrain.averaging import aggregate
from swarmtrain.averaging.aggregate import Aggregation, aggregate_encoded, mean_of_encoded, trimmed_mean
from swarmtrain.averaging.attacks import ATTACKS, attack, with_byzantine
from swarmtrain.compress import get_codec
from swarmtrain.diloco.averager import AverageResult

pytestmark = pytest.mark.unit


def _reference(stacked: np.ndarray, k: int) -> np.ndarray:
    s = np.sort(stacked.astype(np.float64), axis=0)
    return s[k:stacked.shape[0] - k].mean(axis=0)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(3, 9), numel=st.integers(1, 300), trim=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_the_trimmed_mean_is_the_mean_of_each_coordinates_middle_values(n: int, numel: int, trim: int,
                                                                        seed: int) -> None:
    k = Aggregation("trimmed_mean", trim).trimmed(n)
    stacked = torch.randn(n, numel, generator=torch.Generator().manual_seed(seed))
    got = trimmed_mean(stacked, k, out=torch.empty(numel))
    np.testing.assert_allclose(got.numpy(), _reference(stacked.numpy(), k), rtol=1e-5, atol=1e-6)


def test_chunks_and_the_sorting_method_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    stacked = torch.randn(5, 1000, generator=torch.Generator().manual_seed(1))
    whole = trimmed_mean(stacked, 1, out=torch.empty(1000))
    monkeypatch.setattr(aggregate, "_CHUNK", 7)
    assert torch.equal(trimmed_mean(stacked, 1, out=torch.empty(1000)), whole)
    monkeypatch.setattr(aggregate, "_NETWORK_MAX", 0)  # torch.sort instead of the network: same order, same bits
    assert torch.equal(trimmed_mean(stacked, 1, out=torch.empty(1000)), whole)
    big = torch.randn(40, 300, generator=torch.Generator().manual_seed(2))  # past the network's size
    np.testing.assert_allclose(trimmed_mean(big, 3, out=torch.empty(300)).numpy(), _reference(big.numpy(), 3),
                               rtol=1e-5, atol=1e-6)


def test_one_liar_among_eight_cannot_move_any_coordinate_beyond_the_honest_ones() -> None:
    honest = torch.randn(7, 5000, generator=torch.Generator().manual_seed(2))
    for liar in (honest[0] * 1e30, -1e30 * torch.ones(5000), torch.full((5000,), 3.0e38)):
        got = trimmed_mean(torch.cat([honest, liar[None]]), 1, out=torch.empty(5000))
        assert bool(((got >= honest.min(0).values) & (got <= honest.max(0).values)).all())
        assert bool(torch.isfinite(got).all())  # the kept values are summed as they are, never total − dropped


def test_how_much_is_trimmed_follows_the_count() -> None:
    rule = Aggregation("trimmed_mean", 2)
    assert [rule.trimmed(n) for n in (1, 2, 3, 4, 5, 6, 9)] == [0, 0, 1, 1, 2, 2, 2]
    assert Aggregation().trimmed(9) == 0
    for bad in ({"rule": "median"}, {"trim": 0}):
        with pytest.raises(ValueError):
            Aggregation(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["fp32", "int8"])
def test_aggregating_encoded_parts_decodes_each_once_and_the_mean_is_unchanged(name: str) -> None:
    codec = get_codec(name)
    g = torch.Generator().manual_seed(3)
    parts = [codec.encode(torch.randn(2048, generator=g)) for _ in range(5)]
    mean = aggregate_encoded(codec, parts, Aggregation(), out=torch.empty(2048))
    assert torch.equal(mean, mean_of_encoded(codec, parts, out=torch.empty(2048)))
    trimmed = aggregate_encoded(codec, parts, Aggregation("trimmed_mean"), out=torch.empty(2048))
    ref = _reference(np.stack([codec.decode(p).numpy() for p in parts]), 1)
    np.testing.assert_allclose(trimmed.numpy(), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="no contributions"):
        aggregate_encoded(codec, [], Aggregation(), out=torch.empty(1))


def test_attacks_replace_only_the_last_members_contributions() -> None:
    g = torch.Generator().manual_seed(4)
    deltas = [torch.randn(100, generator=g) for _ in range(4)]
    assert torch.equal(attack("scale", deltas[0], generator=g), deltas[0] * 100)
    assert torch.equal(attack("signflip", deltas[0], generator=g), deltas[0] * -4)
    noise = attack("random", deltas[0], generator=g)
    assert abs(float(noise.norm() / deltas[0].norm()) - 10.0) < 1e-3
    assert bool(torch.isnan(attack("nan", deltas[0], generator=g)).any())
    seen: list[list[torch.Tensor]] = []

    def record(round_index: int, sent: list[torch.Tensor]) -> list[AverageResult]:
        seen.append(list(sent))
        return []

    for name in ATTACKS:
        with_byzantine(record, num_workers=4, byzantine=1, name=name)(0, deltas)  # type: ignore[arg-type]
        assert all(torch.equal(a, b) for a, b in zip(seen[-1][:3], deltas[:3], strict=True))
        assert not torch.equal(seen[-1][3], deltas[3])
    with pytest.raises(ValueError, match="byzantine must be"):
        with_byzantine(record, num_workers=4, byzantine=4, name="scale")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attack 'x'"):
        with_byzantine(record, num_workers=4, byzantine=1, name="x")  # type: ignore[arg-type]

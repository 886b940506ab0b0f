"""EagerScale: λ of an overlapped peer's eager estimate, fitted by least squares from committed rounds."""

from __future__ import annotations

import math

import pytest
import torch

from swarmtrain.diloco.averager import MeanShard, ShardedMean
from swarmtrain.diloco.eager import DECAY, EagerScale, dot, dot_with_mean

pytestmark = pytest.mark.unit


def _orthogonal(c: torch.Tensor, seed: int) -> torch.Tensor:
    """A vector orthogonal to c: the part of the mean that c cannot predict (the other peers' values)."""
    noise = torch.randn(c.numel(), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    c64 = c.double()
    return (noise - c64 * (noise @ c64) / (c64 @ c64)).float()


def test_the_default_holds_until_a_round_is_observed() -> None:
    scale = EagerScale()
    assert scale.value(0.25) == 0.25
    scale.observe(torch.zeros(8), 0.0)  # c = 0 says nothing about λ
    assert scale.value(0.25) == 0.25


def test_lambda_is_the_least_squares_share_of_the_own_contribution_in_the_mean() -> None:
    c = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    mean = 0.3 * c + 2.0 * _orthogonal(c, 1)  # most of the mean is what the other members sent
    scale = EagerScale()
    scale.observe(c, dot_with_mean(c, mean))
    assert scale.value(1.0) == pytest.approx(0.3, rel=1e-5)


def test_recent_rounds_weigh_more() -> None:
    c = torch.randn(1024, generator=torch.Generator().manual_seed(2))
    d = 2 * c  # a later round with a larger contribution, half of which is in its mean
    scale = EagerScale()
    scale.observe(c, dot(c, c))  # λ = 1 in round 1
    scale.observe(d, dot(d, 0.5 * d))  # λ = 0.5 in round 2
    cc, dd = dot(c, c), dot(d, d)
    expected = (DECAY * cc + 0.5 * dd) / (DECAY * cc + dd)
    assert scale.value(1.0) == pytest.approx(expected, rel=1e-12)
    for _ in range(40):
        scale.observe(d, dot(d, 0.5 * d))
    assert scale.value(1.0) == pytest.approx(0.5, abs=1e-3)


@pytest.mark.parametrize(("share", "clamped"), [(2.0, 1.0), (-0.5, 0.0)])
def test_lambda_is_clamped_to_between_no_share_and_all_of_it(share: float, clamped: float) -> None:
    c = torch.randn(256, generator=torch.Generator().manual_seed(3))
    scale = EagerScale()
    scale.observe(c, dot(c, share * c))
    assert scale.value(0.25) == clamped


def test_a_round_with_non_finite_products_is_skipped() -> None:
    c = torch.ones(16)
    scale = EagerScale()
    scale.observe(c, dot(c, 0.5 * c))
    scale.observe(c, math.inf)
    scale.observe(torch.full((16,), math.nan), 1.0)
    assert scale.value(1.0) == 0.5 and scale.state() == {"cm": 8.0, "cc": 16.0}


def test_a_sharded_mean_gives_the_same_product_piece_by_piece() -> None:
    c = torch.randn(3000, generator=torch.Generator().manual_seed(4))
    mean = torch.randn(3000, generator=torch.Generator().manual_seed(5))

    def shard(lo: int, hi: int) -> MeanShard:
        return MeanShard(lo=lo, hi=hi, decode=lambda out: out.copy_(mean[lo:hi]))

    sharded = ShardedMean(numel=3000, shards=(shard(0, 1000), shard(1000, 2500), shard(2500, 3000)))
    assert dot_with_mean(c, sharded) == pytest.approx(float(c.double() @ mean.double()), rel=1e-5)


def test_the_state_round_trips_and_bad_state_is_refused_by_name() -> None:
    scale = EagerScale()
    scale.observe(torch.ones(4), 3.0)
    again = EagerScale()
    again.load_state(scale.state())
    assert again.state() == scale.state() and again.value(1.0) == 0.75
    for bad, field in (({"cm": 1.0}, "'cc'"), ({"cm": "x", "cc": 1.0}, "'cm'"), ({"cm": 1.0, "cc": math.nan}, "'cc'"),
                       ({"cm": True, "cc": 1.0}, "'cm'"), ({"cm": 1.0, "cc": -1.0}, "'cc'")):
        with pytest.raises(ValueError, match=field):
            again.load_state(bad)
        assert again.state() == scale.state()  # nothing half-loaded

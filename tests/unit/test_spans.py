"""A round's span (diloco/spans.py): all of θ in place, or a fragment gathered; the same bits where they overlap."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.config import OuterConfig
from swarmtrain.diloco.averager import MeanShard, ShardedMean
from swarmtrain.diloco.flat import flatten, pseudo_gradient, tensor_digest
from swarmtrain.diloco.outer import OuterOptimizer
from swarmtrain.diloco.spans import Fragment, Whole

pytestmark = pytest.mark.unit


def _setup(seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(4, 5, generator=gen), torch.randn(7, generator=gen), torch.randn(3, 3, generator=gen)]
    theta = flatten(params) + torch.randn(36, generator=gen) * 1e-2
    mean = torch.randn(36, generator=gen) * 1e-2
    return params, theta, mean


def _outer(momentum: float) -> OuterOptimizer:
    opt = OuterOptimizer(OuterConfig(lr=0.7, momentum=momentum, nesterov=momentum > 0), numel=36)
    if opt.momentum_buffer is not None:
        opt.momentum_buffer.copy_(torch.linspace(-1e-2, 1e-2, 36))
    return opt


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_a_fragment_of_all_of_theta_steps_as_the_whole_does(momentum: float) -> None:
    params, theta, mean = _setup(0)
    whole, frag = Whole(params, 36), Fragment([(0, 20), (20, 27), (27, 36)], params)
    assert torch.equal(whole.delta(theta), frag.delta(theta))
    assert torch.equal(whole.delta(theta), pseudo_gradient(theta, params))
    a, b = theta.clone(), theta.clone()
    oa, ob = _outer(momentum), _outer(momentum)
    preview_a, preview_b = whole.preview(oa, a, mean), frag.preview(ob, b, mean)
    assert torch.equal(a, theta)  # a preview changes nothing
    whole.step(oa, a, mean)
    frag.step(ob, b, mean)
    assert torch.equal(a, b)
    assert preview_a == preview_b == (tensor_digest(a), None if oa.momentum_buffer is None
                                      else tensor_digest(oa.momentum_buffer))


def test_a_fragment_moves_only_its_ranges_and_its_preview_names_the_result() -> None:
    params, theta, mean = _setup(1)
    frag = Fragment([(20, 27)], [params[1]])  # the middle parameter alone
    outer = _outer(0.9)
    part = mean[20:27].clone()
    before, buf_before = theta.clone(), outer.momentum_buffer.clone()  # type: ignore[union-attr]
    preview = frag.preview(outer, theta, part)
    frag.step(outer, theta, part)
    assert torch.equal(theta[:20], before[:20]) and torch.equal(theta[27:], before[27:])
    assert not torch.equal(theta[20:27], before[20:27])
    assert outer.momentum_buffer is not None and torch.equal(outer.momentum_buffer[:20], buf_before[:20])
    assert preview == (tensor_digest(theta), tensor_digest(outer.momentum_buffer))
    assert torch.equal(frag.delta(theta), theta[20:27] - params[1])


def test_the_whole_steps_a_sharded_mean_as_the_assembled_one() -> None:
    params, theta, mean = _setup(2)
    shards = tuple(MeanShard(lo, hi, lambda out, lo=lo, hi=hi: out.copy_(mean[lo:hi]))
                   for lo, hi in ((0, 10), (10, 36)))
    sharded = ShardedMean(36, shards)
    a, b = theta.clone(), theta.clone()
    oa, ob = _outer(0.9), _outer(0.9)
    whole = Whole(params, 36)
    assert whole.preview(oa, a, sharded) == whole.preview(ob, b, mean)
    whole.step(oa, a, sharded)
    whole.step(ob, b, mean)
    assert torch.equal(a, b)


def test_adopting_a_span_s_values() -> None:
    params, theta, _ = _setup(3)
    values = torch.arange(7, dtype=torch.float32)
    frag = Fragment([(20, 27)], [params[1]])
    out = frag.adopt(theta, values)
    assert out is theta and torch.equal(theta[20:27], values)
    whole_values = torch.zeros(36)
    assert Whole(params, 36).adopt(theta, whole_values) is whole_values
    assert torch.equal(frag.part(theta), values) and Whole(params, 36).part(theta) is theta

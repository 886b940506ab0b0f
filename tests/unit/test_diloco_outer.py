"""The outer step and the sign of Δ, pinned against torch.optim.SGD and a hand computation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from swarmtrain.config import OuterConfig
from swarmtrain.diloco import outer as outer_module
from swarmtrain.diloco.flat import assign_flat, flat_hash, flatten, pseudo_gradient
from swarmtrain.diloco.outer import OuterOptimizer, count_non_finite

pytestmark = pytest.mark.unit


def _torch_sgd(theta0: torch.Tensor, grads: list[torch.Tensor], cfg: OuterConfig) -> torch.Tensor:
    p = torch.nn.Parameter(theta0.clone())
    opt = torch.optim.SGD([p], lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, foreach=False)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("cfg", [OuterConfig(), OuterConfig(lr=0.5, momentum=0.0, nesterov=False),
                                 OuterConfig(lr=0.3, momentum=0.8, nesterov=False)])
def test_outer_steps_match_torch_sgd(cfg: OuterConfig) -> None:
    gen = torch.Generator().manual_seed(0)
    theta0 = torch.randn(37, generator=gen)
    grads = [torch.randn(37, generator=gen) for _ in range(3)]
    theta = theta0.clone()
    opt = OuterOptimizer(cfg, numel=37)
    for g in grads:
        opt.step(theta, g)
    torch.testing.assert_close(theta, _torch_sgd(theta0, grads, cfg), rtol=0, atol=1e-6)


def test_one_nesterov_step_by_hand_and_sign_of_delta() -> None:
    theta_global = torch.tensor([1.0, -2.0, 0.5])
    theta_local = torch.tensor([0.8, -1.0, 0.5])  # where the inner steps took this worker
    delta = pseudo_gradient(theta_global, [theta_local])
    torch.testing.assert_close(delta, torch.tensor([0.2, -1.0, 0.0]))  # θ_global − θ_local, not the reverse
    opt = OuterOptimizer(OuterConfig(lr=0.7, momentum=0.9, nesterov=True), numel=3)
    theta = theta_global.clone()
    opt.step(theta, delta)
    # First step: buf = Δ; Nesterov update = Δ + 0.9·buf = 1.9·Δ; θ ← θ − 0.7·1.9·Δ (moves towards θ_local, past it).
    # Exact in float64; the fp32 step rounds 0.9, 0.7 and three results: within 4 units of the last place.
    expected = theta_global.double() - 0.7 * 1.9 * delta.double()
    torch.testing.assert_close(theta.double(), expected, rtol=4 * 2**-24, atol=0)
    assert theta[0] < theta_global[0] and theta[1] > theta_global[1]
    torch.testing.assert_close(theta, _torch_sgd(theta_global, [delta], opt.cfg), rtol=0, atol=1e-6)


@pytest.mark.parametrize("cfg", [OuterConfig(lr=0.7, momentum=0.9, nesterov=True),
                                 OuterConfig(lr=0.3, momentum=0.8, nesterov=False),
                                 OuterConfig(lr=0.3, momentum=0.0, nesterov=False)])
def test_the_outer_step_is_separately_rounded_fp32_operations(cfg: OuterConfig) -> None:
    """The bits any IEEE machine computes: each multiply and add rounded on its own (numpy's float32 scalars),
    never fused into one FMA (which a CPU's vector unit or a GPU's compiler may do for `add(x, alpha=a)`): a
    peer whose round runs on a GPU and one whose round runs on a CPU must agree on θ_global to the bit."""
    gen = torch.Generator().manual_seed(3)
    theta = torch.randn(1031, generator=gen)
    grads = [torch.randn(1031, generator=gen) * 1e-3 for _ in range(3)]
    ref_theta = theta.numpy().copy()
    ref_buf = np.zeros_like(ref_theta)
    mu, lr = np.float32(cfg.momentum), np.float32(cfg.lr)
    opt = OuterOptimizer(cfg, numel=theta.numel())
    for g in grads:
        opt.step(theta, g)
        for i, gi in enumerate(g.numpy()):
            if cfg.momentum > 0:
                ref_buf[i] = np.float32(ref_buf[i] * mu) + gi
                update = gi + np.float32(ref_buf[i] * mu) if cfg.nesterov else ref_buf[i]
            else:
                update = gi
            ref_theta[i] = ref_theta[i] - np.float32(update * lr)
    assert np.array_equal(theta.numpy().view(np.int32), ref_theta.view(np.int32))


def test_plain_sgd_lr1_lands_on_the_mean_of_the_workers() -> None:
    theta_global = torch.zeros(4)
    locals_ = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([3.0, 2.0, 1.0, 0.0])]
    mean_delta = torch.stack([pseudo_gradient(theta_global, [t]) for t in locals_]).mean(0)
    OuterOptimizer(OuterConfig(lr=1.0, momentum=0.0, nesterov=False), numel=4).step(theta_global, mean_delta)
    torch.testing.assert_close(theta_global, torch.tensor([2.0, 2.0, 2.0, 2.0]))


def test_outer_step_rejects_bad_input() -> None:
    opt = OuterOptimizer(OuterConfig(), numel=3)
    with pytest.raises(ValueError, match="shape"):
        opt.step(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="NaN"):
        opt.step(torch.zeros(3), torch.tensor([0.0, float("nan"), 0.0]))
    with pytest.raises(ValueError, match="momentum buffer"):
        opt.load_state_tensors({"momentum": torch.zeros(5)})


def test_non_finite_values_are_counted_like_a_mask_across_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(outer_module, "STEP_SLICE", 100)  # several slices, some clean, some not
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(1_000, generator=gen)
    assert count_non_finite(t) == 0
    for at, bad in ((3, float("nan")), (250, float("inf")), (251, float("-inf")), (999, float("nan"))):
        t[at] = bad
    assert count_non_finite(t) == int((~torch.isfinite(t)).sum()) == 4
    # +Inf and -Inf in one slice sum to NaN; both are counted
    assert count_non_finite(torch.tensor([float("inf"), float("-inf"), 1.0])) == 2
    # finite values whose sum overflows fp32 are finite: the mask decides, not the sum
    huge = torch.full((300,), 3.0e38)
    assert not torch.isfinite(huge[:100].sum()) and count_non_finite(huge) == 0
    assert count_non_finite(torch.empty(0)) == 0


def test_flat_roundtrip_and_hash() -> None:
    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4))]
    flat = flatten(params)
    assert flat.shape == (10,) and flat.dtype == torch.float32
    assign_flat(flat * 2, params)
    torch.testing.assert_close(flatten(params), flat * 2)
    assert flat_hash(flat) == flat_hash(flat.clone()) != flat_hash(flat * 2)
    with pytest.raises(ValueError, match="need"):
        assign_flat(torch.zeros(9), params)


@pytest.mark.parametrize("nesterov", [True, False])
def test_an_outer_step_over_several_slices_is_bit_identical_to_one_pass(nesterov: bool) -> None:
    from swarmtrain.diloco.outer import STEP_SLICE

    n = 2 * STEP_SLICE + 12345
    g = torch.Generator().manual_seed(3)
    theta, buf0 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) for _ in range(2)]
    cfg = OuterConfig(lr=0.7, momentum=0.9, nesterov=nesterov)
    opt = OuterOptimizer(cfg, numel=n)
    opt.momentum_buffer = buf0.clone()
    ours, ref, buf = theta.clone(), theta.clone(), buf0.clone()
    for grad in grads:
        opt.step(ours, grad)
        buf.mul_(0.9).add_(grad)
        ref.sub_((grad.add(buf.mul(0.9)) if nesterov else buf).mul(0.7))  # one pass, each operation rounded
    assert torch.equal(ours, ref) and torch.equal(opt.momentum_buffer, buf)
    bad = grads[0].clone()
    bad[-1] = float("nan")  # in the last slice
    with pytest.raises(ValueError, match="NaN"):
        opt.step(ours, bad)
    assert torch.equal(ours, ref)  # refused before anything changed


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("cuts", [(0,), (0, 64, 1_048_640), (0, 1, 777_777, 1_048_577)])
def test_an_outer_step_in_pieces_is_bit_identical_to_one_pass(nesterov: bool, cuts: tuple[int, ...]) -> None:
    """A mean applied shard by shard (ShardedMean) moves θ and the momentum to the same bits as the whole."""
    from swarmtrain.diloco.averager import MeanShard, ShardedMean

    n = 1_300_003
    g = torch.Generator().manual_seed(5)
    theta, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    bounds = [*cuts, n]
    mean = ShardedMean(n, tuple(MeanShard(lo, hi, lambda out, lo=lo, hi=hi: out.copy_(grad[lo:hi]))
                                for lo, hi in itertools.pairwise(bounds)))
    cfg = OuterConfig(lr=0.7, momentum=0.9, nesterov=nesterov)
    whole, pieces = OuterOptimizer(cfg, numel=n), OuterOptimizer(cfg, numel=n)
    ours, ref = theta.clone(), theta.clone()
    for _ in range(2):
        whole.step(ref, grad)
        pieces.step_pieces(ours, mean.pieces)
    assert torch.equal(ours, ref) and torch.equal(pieces.momentum_buffer, whole.momentum_buffer)
    assert torch.equal(mean.tensor(), grad)


def test_an_outer_step_in_pieces_refuses_bad_pieces_before_changing_anything() -> None:
    n = 1000
    theta0 = torch.randn(n)
    opt = OuterOptimizer(OuterConfig(lr=0.7, momentum=0.9), numel=n)
    grad = torch.randn(n)
    bad = grad.clone()
    bad[-1] = float("inf")  # in the last piece: the first must not have been applied either
    theta = theta0.clone()
    with pytest.raises(ValueError, match="NaN/Inf"):
        opt.step_pieces(theta, lambda: [(0, bad[:500]), (500, bad[500:])])
    with pytest.raises(ValueError, match="cover 500 of 1000"):
        opt.step_pieces(theta, lambda: [(0, grad[:500])])
    with pytest.raises(ValueError, match="does not follow"):
        opt.step_pieces(theta, lambda: [(0, grad[:500]), (400, grad[400:])])
    assert torch.equal(theta, theta0) and opt.momentum_buffer is not None and not opt.momentum_buffer.any()

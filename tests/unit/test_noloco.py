"""NoLoCo's outer step and group means against hand-written references; a 2-worker gossip run equals
heavy-ball DiLoCo bit for bit (one group, the same means, replicas that never part)."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.averaging.inprocess import InProcessGroup
from swarmtrain.compress import get_codec
from swarmtrain.config import RunConfig
from swarmtrain.data import load_corpus
from swarmtrain.diloco.gossip_simulation import replica_spread, simulate_noloco
from swarmtrain.diloco.noloco import NolocoOuter, group_mean
from swarmtrain.diloco.simulation import simulate_diloco

pytestmark = pytest.mark.unit


def _paper_step(phi: torch.Tensor, m: torch.Tensor, thetas: list[torch.Tensor], phis: list[torch.Tensor], *,
                alpha: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """NoLoCo as its reference code writes it, in float64: m ← β·m + α·mean(θ − φ) + α·(mean(φ) − φ_i);
    φ_i ← φ_i + m (θ: the fast weights after the inner steps; the paper's own sign)."""
    mean_g = torch.stack([t - p for t, p in zip(thetas, phis, strict=True)]).mean(0)
    m = beta * m + alpha * mean_g + alpha * (torch.stack(phis).mean(0) - phi)
    return phi + m, m


def test_the_outer_step_is_the_paper_s_with_this_project_s_sign_of_delta() -> None:
    g = torch.Generator().manual_seed(0)
    n, alpha, beta = 1000, 0.7, 0.5
    phis = [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(3)]  # peer 0 and two partners
    ours = phis[0].to(torch.float32).clone()
    outer = NolocoOuter(lr=alpha, momentum=beta, buffer=torch.zeros(n))
    ref_phi, ref_m = phis[0].clone(), torch.zeros(n, dtype=torch.float64)
    for _ in range(4):
        phis[0] = ref_phi.clone()
        thetas = [p + 0.1 * torch.randn(n, generator=g, dtype=torch.float64) for p in phis]
        deltas = [p - t for p, t in zip(phis, thetas, strict=True)]  # this project's Δ = φ − θ_local
        mean_delta = torch.stack(deltas).mean(0).to(torch.float32)
        mean_phi = torch.stack(phis).mean(0).to(torch.float32)
        ours = ref_phi.to(torch.float32).clone()  # the same start, so the comparison is of one step's rule
        outer.step(ours, mean_delta, mean_phi)
        ref_phi, ref_m = _paper_step(ref_phi, ref_m, thetas, phis, alpha=alpha, beta=beta)
        torch.testing.assert_close(ours.double(), ref_phi, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outer.buffer.double(), -ref_m / alpha, atol=1e-5, rtol=1e-5)
        phis = [ref_phi] + [p + 0.01 * torch.randn(n, generator=g, dtype=torch.float64) for p in phis[1:]]


def test_a_non_finite_mean_changes_nothing() -> None:
    outer = NolocoOuter(lr=0.7, momentum=0.5, buffer=torch.ones(4))
    phi = torch.arange(4.0)
    bad = torch.tensor([0.0, float("nan"), 0.0, 0.0])
    with pytest.raises(ValueError, match="NaN/Inf"):
        outer.step(phi, bad, phi.clone())
    assert torch.equal(phi, torch.arange(4.0)) and torch.equal(outer.buffer, torch.ones(4))
    with pytest.raises(ValueError, match="shape"):
        outer.step(phi, torch.zeros(3), phi.clone())


def test_group_mean_uses_own_exact_values_and_leaves_out_a_bad_partner() -> None:
    own_d, own_p = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    good = ("b", torch.tensor([3.0, 4.0]), torch.tensor([12.0, 18.0]))
    nan = ("c", torch.tensor([float("nan"), 0.0]), torch.tensor([10.0, 20.0]))
    short = ("d", torch.tensor([1.0]), torch.tensor([1.0]))
    gm = group_mean(own_d, own_p, [good, nan, short], clip=0)
    assert torch.equal(gm.delta, torch.tensor([2.0, 3.0])) and torch.equal(gm.phi, torch.tensor([11.0, 19.0]))
    assert gm.used == ["b"] and set(gm.dropped) == {"c", "d"} and "NaN" in gm.dropped["c"]
    assert gm.spread == pytest.approx(float(torch.tensor([2.0, -2.0]).norm() / own_p.norm()))
    assert torch.equal(good[1], torch.tensor([3.0, 4.0]))  # the partner's tensors are not scaled in place


def test_a_lying_partner_moves_a_peer_by_a_bounded_step() -> None:
    own_d, own_p = torch.tensor([0.3, 0.4]), torch.zeros(2)  # ‖Δ_own‖ = 0.5
    liar = ("evil", torch.tensor([1e6, 0.0]), torch.tensor([0.0, -1e6]))
    gm = group_mean(own_d, own_p, [liar], clip=4.0)
    assert gm.clipped == ["evil"]
    # each part at most 4 × 0.5 = 2 in norm, halved by the group of 2
    assert float((gm.delta - own_d / 2).norm()) == pytest.approx(1.0)
    assert float((gm.phi - own_p).norm()) == pytest.approx(1.0)
    unclipped = group_mean(own_d, own_p, [liar], clip=0)
    assert float(unclipped.delta.norm()) > 1e5


def test_replica_spread() -> None:
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([3.0, 0.0])
    assert replica_spread([a, a]) == 0.0
    assert replica_spread([a, b]) == pytest.approx(0.5)  # each is 1 from the mean (2, 0), whose norm is 2


def test_two_workers_gossip_exactly_as_heavy_ball_diloco(tiny_config: RunConfig) -> None:
    torch.set_num_threads(1)
    cfg = tiny_config.replace(diloco={"rounds": 3, "inner_steps": 2}, compress={"codec": "fp32"},
                              averaging={"mode": "gossip", "gossip_weights_codec": "fp32", "gossip_lr": 0.7,
                                         "gossip_momentum": 0.5},
                              outer={"lr": 0.7, "momentum": 0.5, "nesterov": False})
    corpus = load_corpus(cfg.data)
    codec = get_codec("fp32")
    gossip, summary = simulate_noloco(cfg, train_tokens=corpus.train, val_tokens=corpus.val, num_workers=2,
                                      codec=codec)
    diloco = simulate_diloco(cfg.replace(averaging={"mode": "allreduce"}), train_tokens=corpus.train,
                             val_tokens=corpus.val, num_workers=2,
                             average_all=InProcessGroup(codec, num_workers=2).average_all)
    assert [r.spread for r in gossip.rounds] == [0.0, 0.0, 0.0]
    assert summary.replica_val_losses[0] == summary.replica_val_losses[1]
    assert gossip.final_theta is not None and diloco.final_theta is not None
    assert torch.equal(gossip.final_theta, diloco.final_theta)
    assert gossip.rounds[-1].val_loss < gossip.initial_val_loss

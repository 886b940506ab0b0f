"""diloco.overlap: the delayed outer step keeps θ_local's newer progress; simulations match references."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.averaging.inprocess import InProcessGroup
from swarmtrain.compress import get_codec
from swarmtrain.config import RunConfig
from swarmtrain.data import ShardedBatches, eval_batches, load_corpus
from swarmtrain.diloco import DilocoWorker
from swarmtrain.diloco.averager import AverageResult
from swarmtrain.diloco.flat import flatten
from swarmtrain.diloco.simulation import simulate_diloco
from swarmtrain.models import build_model

pytestmark = pytest.mark.unit


def _worker(cfg: RunConfig) -> DilocoWorker:
    batches = ShardedBatches(load_corpus(cfg.data).train, worker_index=0, num_workers=1,
                             batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len, seed=cfg.train.seed)
    return DilocoWorker(cfg, model=build_model(cfg.model, seed=cfg.train.seed), batches=batches,
                        device=torch.device("cpu"))


def test_sending_starts_the_next_round_from_the_eager_estimate_and_the_commit_corrects_it(
        tiny_config: RunConfig) -> None:
    cfg = tiny_config.replace(outer={"lr": 0.5, "momentum": 0.9, "nesterov": True})
    w, ref, eager = _worker(cfg), _worker(cfg), _worker(cfg)  # plain outer optimizers on θ_global alone
    w.train_inner()
    delta, carry = w.send_overlapped()
    estimate = eager.theta_global.clone()
    eager.outer.step(estimate, delta)
    assert torch.equal(flatten(w.params), estimate) and torch.equal(carry.base, estimate)
    assert w.round == 0 and torch.equal(w.theta_global, ref.theta_global), "sending changes no global state"
    w.train_inner()  # the next round trains while the first one is averaged
    progress = flatten(w.params) - estimate
    mean = 0.5 * delta  # the swarm's mean differs from this peer's own Δ
    assert w.apply(AverageResult(round=0, committed=True, mean=mean, members=("a", "b")), carry=carry)
    ref.outer.step(ref.theta_global, mean)
    assert torch.equal(w.theta_global, ref.theta_global) and w.round == 1
    assert torch.allclose(flatten(w.params), ref.theta_global + progress, atol=1e-6)
    assert torch.allclose(w.delta(), -progress, atol=1e-6)  # the next Δ is exactly the steps not yet sent


def test_an_aborted_overlapped_round_puts_its_delta_back(tiny_config: RunConfig) -> None:
    w = _worker(tiny_config)
    g0 = w.theta_global.clone()
    w.train_inner()
    first = w.delta()
    _, carry = w.send_overlapped()
    w.train_inner()
    progress = flatten(w.params) - carry.base
    assert not w.apply(AverageResult(round=0, committed=False, mean=None, reason="too few peers"), carry=carry)
    assert w.round == 0 and torch.equal(w.theta_global, g0)
    assert torch.allclose(w.delta(), first - progress, atol=1e-6)  # the retry sends both rounds' steps


def test_evaluate_global_scores_theta_global_and_restores_theta_local(tiny_config: RunConfig) -> None:
    w = _worker(tiny_config)
    batches = eval_batches(load_corpus(tiny_config.data).val, batch_size=2, seq_len=tiny_config.data.seq_len,
                           num_batches=2)
    before = w.evaluate(batches)  # θ_local == θ_global at the start
    w.train_inner()
    local = flatten(w.params)
    assert w.evaluate_global(batches) == pytest.approx(before, abs=1e-6)
    assert torch.equal(flatten(w.params), local)
    assert w.evaluate(batches) != pytest.approx(before, abs=1e-6)


@pytest.mark.parametrize("delay_steps", [4, 1])  # the average lands at the round's end / after 1 of 4 steps
def test_one_worker_overlapped_is_classic_diloco(tiny_config: RunConfig, delay_steps: int) -> None:
    """K=1: the mean is the worker's own Δ, so the eager estimate is exact and nothing needs correcting."""
    cfg = tiny_config.replace(diloco={"rounds": 3, "overlap_max_steps": delay_steps})
    data = load_corpus(cfg.data)

    def run(overlap: bool) -> torch.Tensor:
        c = cfg.replace(diloco={"overlap": overlap})
        result = simulate_diloco(c, train_tokens=data.train, val_tokens=data.val, num_workers=1,
                                 average_all=InProcessGroup(get_codec("fp32"), num_workers=1).average_all)
        return result.final_theta

    assert torch.allclose(run(True), run(False), atol=1e-6)


@pytest.mark.parametrize("delay_steps", [4, 1])
def test_overlapped_simulation_agrees_learns_and_differs_from_classic(tiny_config: RunConfig,
                                                                      delay_steps: int) -> None:
    cfg = tiny_config.replace(diloco={"rounds": 3, "overlap_max_steps": delay_steps})
    data = load_corpus(cfg.data)
    results = {}
    for overlap in (False, True):
        results[overlap] = simulate_diloco(cfg.replace(diloco={"overlap": overlap}), train_tokens=data.train,
                                           val_tokens=data.val, num_workers=2,
                                           average_all=InProcessGroup(get_codec("fp32"), num_workers=2).average_all)
    classic, overlapped = results[False], results[True]
    assert [r.round for r in overlapped.rounds] == [0, 1, 2]  # every round committed, in order
    assert overlapped.rounds[-1].tokens == classic.rounds[-1].tokens  # the same tokens trained
    assert overlapped.rounds[-1].val_loss < overlapped.initial_val_loss
    assert overlapped.hash != classic.hash  # the outer step really lands a round late


def test_one_round_overlapped_equals_classic(tiny_config: RunConfig) -> None:
    """With one round there is nothing to overlap: the same computation bit for bit."""
    cfg = tiny_config.replace(diloco={"rounds": 1})
    data = load_corpus(cfg.data)
    hashes = {simulate_diloco(cfg.replace(diloco={"overlap": o}), train_tokens=data.train, val_tokens=data.val,
                              num_workers=2,
                              average_all=InProcessGroup(get_codec("fp32"), num_workers=2).average_all).hash
              for o in (False, True)}
    assert len(hashes) == 1


def test_a_heal_can_keep_the_unsent_progress_on_top_of_the_donors_theta(tiny_config: RunConfig) -> None:
    w, donor = _worker(tiny_config), _worker(tiny_config)
    donor.train_inner()
    donor.apply(AverageResult(round=0, committed=True, mean=donor.delta(), members=("d",)))
    w.train_inner()
    unsent = w.theta_global - flatten(w.params)
    momentum = donor.outer.state_tensors().get("momentum")
    w.adopt_global(round_index=1, theta_global=donor.theta_global, outer_momentum=momentum, keep_progress=True)
    assert w.global_hash() == donor.global_hash() and w.round == 1
    assert torch.allclose(w.delta(), unsent, atol=1e-6)  # the same steps go out with round 1
    w.adopt_global(round_index=1, theta_global=donor.theta_global, outer_momentum=momentum)
    assert not w.has_local_progress()


@pytest.mark.parametrize(("eager", "share", "scale"), [("fitted", 0.5, 0.5), ("fitted", -1.0, 0.0), ("own", 0.5, 1.0)])
def test_the_next_eager_estimate_takes_the_share_of_its_delta_the_last_mean_held(
        tiny_config: RunConfig, eager: str, share: float, scale: float) -> None:
    cfg = tiny_config.replace(outer={"lr": 0.5, "momentum": 0.9, "nesterov": True}, diloco={"eager": eager})
    w = _worker(cfg)
    w.train_inner()
    delta, carry = w.send_overlapped()
    assert w.eager_scale() == 1.0  # nothing seen yet: a dense round guesses its own Δ
    w.train_inner()
    w.apply(AverageResult(round=0, committed=True, mean=share * delta, members=("a", "b")), carry=carry)
    assert w.eager_scale() == scale
    w.train_inner()
    theta, momentum = w.theta_global.clone(), w.outer.state_tensors()["momentum"].clone()
    delta, carry = w.send_overlapped()
    estimate = w.outer.preview(theta, delta * scale)
    assert torch.equal(carry.base, estimate) and torch.equal(flatten(w.params), estimate)
    assert torch.equal(w.outer.state_tensors()["momentum"], momentum), "the estimate moves no global state"


def test_the_fitted_scale_survives_a_checkpoint(tiny_config: RunConfig) -> None:
    w = _worker(tiny_config)
    w.train_inner()
    delta, carry = w.send_overlapped()
    w.train_inner()
    w.apply(AverageResult(round=0, committed=True, mean=0.25 * delta, members=("a", "b")), carry=carry)
    tensors, meta = w.state_dict()
    resumed = _worker(tiny_config)
    resumed.load_state_dict(tensors, meta)
    assert resumed.eager_scale() == w.eager_scale() == 0.25
    del meta["eager"]  # a checkpoint from before the fit: it starts again from the default
    resumed.load_state_dict(tensors, meta)
    assert resumed.eager_scale() == 1.0
    meta["eager"] = {"cm": 1.0}
    fresh = _worker(tiny_config)
    with pytest.raises(ValueError, match="'cc'"):
        fresh.load_state_dict(tensors, meta)
    assert fresh.round == 0 and not torch.equal(fresh.theta_global, w.theta_global), "nothing half-loaded"

"""DilocoWorker's round state: the inner schedule follows the swarm's round, θ is hashed once per change,
and a non-finite Δ is detected and resynchronised from θ_global."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.config import RunConfig
from swarmtrain.data import ShardedBatches, load_corpus
from swarmtrain.diloco import DilocoWorker
from swarmtrain.diloco import worker as worker_module
from swarmtrain.diloco.averager import AverageResult
from swarmtrain.diloco.flat import flatten
from swarmtrain.diloco.inner import lr_factor
from swarmtrain.models import build_model

pytestmark = pytest.mark.unit

H, ROUNDS = 4, 10


@pytest.fixture
def cfg(tiny_config: RunConfig) -> RunConfig:
    return tiny_config.replace(diloco={"inner_steps": H, "rounds": ROUNDS},
                               inner={"warmup_steps": 3, "min_lr_ratio": 0.1, "lr": 1e-3})


def _worker(cfg: RunConfig, index: int = 0) -> DilocoWorker:
    batches = ShardedBatches(load_corpus(cfg.data).train, worker_index=index, num_workers=2,
                             batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len, seed=cfg.train.seed)
    return DilocoWorker(cfg, model=build_model(cfg.model, seed=cfg.train.seed), batches=batches,
                        device=torch.device("cpu"), rng_seed=index)


def _commit(w: DilocoWorker) -> AverageResult:
    return AverageResult(round=w.round, committed=True, mean=w.delta(), members=("a",))


def _lr(w: DilocoWorker) -> float:
    return float(w.inner.param_groups[0]["lr"])


def _expected_lr(cfg: RunConfig, step: int) -> float:
    return cfg.inner.lr * lr_factor(step, cfg=cfg.inner, total_steps=ROUNDS * H)


def test_a_joiner_at_80_percent_of_the_run_trains_at_the_swarms_learning_rate(cfg: RunConfig) -> None:
    veteran = _worker(cfg, 0)
    for _ in range(8):
        veteran.train_inner()
        veteran.apply(_commit(veteran))
    joiner = _worker(cfg, 1)
    joiner.adopt_global(round_index=veteran.round, theta_global=veteran.theta_global.clone(),
                        outer_momentum=veteran.outer.state_tensors().get("momentum"))
    for k in range(H):
        veteran.train_inner(1)
        joiner.train_inner(1)
        assert _lr(joiner) == _lr(veteran) == pytest.approx(_expected_lr(cfg, 8 * H + k))
    # without the swarm's clock the joiner would have been warming up: its step 0 of the schedule
    assert _lr(joiner) != pytest.approx(_expected_lr(cfg, 0))


def test_a_time_paced_peer_taking_more_than_h_steps_holds_the_rounds_last_rate(cfg: RunConfig) -> None:
    w = _worker(cfg.replace(diloco={"pace": "time"}))
    w.train_inner(3 * H)  # a fast time-paced peer: three rounds' worth of steps in round 0
    assert w.schedule_step() == H - 1 and _lr(w) == pytest.approx(_expected_lr(cfg, H - 1))
    w.apply(_commit(w))
    w.train_inner(1)
    assert _lr(w) == pytest.approx(_expected_lr(cfg, H))


def test_steps_after_an_overlapped_send_count_for_the_next_round(cfg: RunConfig) -> None:
    w = _worker(cfg)
    w.train_inner()
    _, carry = w.send_overlapped()
    w.train_inner(2)  # round 1's first steps, before round 0's mean landed
    assert _lr(w) == pytest.approx(_expected_lr(cfg, H + 1))
    w.apply(AverageResult(round=0, committed=True, mean=carry.base * 0, members=("a",)), carry=carry)
    w.train_inner(1)
    assert w.schedule_step() == H + 3 and _lr(w) == pytest.approx(_expected_lr(cfg, H + 2))


def test_theta_is_hashed_once_per_change(cfg: RunConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = worker_module.flat_hash

    def counting(flat: torch.Tensor) -> str:
        calls.append(flat.numel())
        return real(flat)

    monkeypatch.setattr(worker_module, "flat_hash", counting)
    w = _worker(cfg)
    first = w.global_hash()
    assert [w.global_hash() for _ in range(50)] == [first] * 50 and len(calls) == 1  # heartbeats read the cache
    w.train_inner()
    assert w.global_hash() == first and len(calls) == 1  # inner steps move θ_local, not θ_global
    w.apply(_commit(w))
    second = w.global_hash()
    assert second != first and len(calls) == 2
    assert second == real(w.theta_global)
    w.adopt_global(round_index=5, theta_global=torch.zeros_like(w.theta_global),
                   outer_momentum=torch.zeros_like(w.theta_global))
    assert w.global_hash() == real(torch.zeros_like(w.theta_global)) and len(calls) == 3
    tensors, meta = w.state_dict()
    other = _worker(cfg)
    other.global_hash()
    other.load_state_dict(tensors, meta)
    assert other.global_hash() == w.global_hash()


def test_a_non_finite_delta_is_named_and_resync_drops_the_poisoned_progress(cfg: RunConfig) -> None:
    w = _worker(cfg)
    w.train_inner()
    assert w.delta_problem(w.delta()) == ""
    before = w.global_hash()
    with torch.no_grad():
        w.params[0].view(-1)[:3] = float("nan")
    w.train_inner(1)  # the NaN spreads into the AdamW moments
    assert any(not torch.isfinite(v).all() for st in w.inner.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))
    problem = w.delta_problem(w.delta())
    assert problem.startswith("non-finite pseudo-gradient:") and "NaN or Inf" in problem
    w.resync()
    assert torch.equal(flatten(w.params), w.theta_global) and w.global_hash() == before
    assert not w.inner.state, "poisoned moments start afresh"
    w.train_inner()
    assert w.delta_problem(w.delta()) == ""


def test_a_heal_forgets_the_error_feedback_residual_and_keeps_the_adamw_moments(cfg: RunConfig) -> None:
    from swarmtrain.compress import get_codec

    w = DilocoWorker(cfg.replace(compress={"error_feedback": True}), model=build_model(cfg.model, seed=0),
                     batches=ShardedBatches(load_corpus(cfg.data).train, worker_index=0, num_workers=1,
                                            batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len, seed=0),
                     device=torch.device("cpu"), codec=get_codec("int8"))
    w.train_inner()
    w.apply(_commit(w))
    assert w.residual is not None and bool(w.residual.abs().sum() > 0)
    moments = {k: v.clone() for k, v in w.inner.state[w.params[0]].items() if isinstance(v, torch.Tensor)}
    w.adopt_global(round_index=7, theta_global=w.theta_global.clone(), outer_momentum=torch.zeros_like(w.theta_global))
    w.forget_residual()
    assert not bool(w.residual.abs().sum() > 0)
    assert all(torch.equal(w.inner.state[w.params[0]][k], v) for k, v in moments.items())


def test_the_data_parallel_baseline_walks_the_whole_schedule(cfg: RunConfig) -> None:
    """simulate's DDP mode trains one worker for rounds × H steps and never commits a round."""
    from swarmtrain.diloco.simulation import simulate_ddp

    seen: list[float] = []
    w = _worker(cfg)
    for step in range(ROUNDS * H):
        w.train_inner(1)
        seen.append(_lr(w))
        assert _lr(w) == pytest.approx(_expected_lr(cfg, step))
    assert seen[-1] < seen[H] and max(seen) == pytest.approx(cfg.inner.lr)
    data = load_corpus(cfg.data)
    result = simulate_ddp(cfg.replace(diloco={"rounds": 2}), train_tokens=data.train, val_tokens=data.val,
                          num_workers=2)
    assert result.rounds[-1].val_loss < result.initial_val_loss


def test_a_state_dict_without_copies_shares_the_workers_tensors_and_holds_the_same_values(cfg: RunConfig) -> None:
    w = _worker(cfg)
    w.train_inner()
    w.apply(_commit(w))
    w.train_inner()
    copied, meta = w.state_dict()
    shared, shared_meta = w.state_dict(copy=False)
    local = [f"theta_local.{i}" for i in range(len(w.params))]  # each parameter itself, not a flat copy
    assert meta == shared_meta and copied.keys() - {"theta_local"} == shared.keys() - set(local)
    assert all(torch.equal(copied[k], shared[k]) for k in copied if k != "theta_local")
    assert torch.equal(torch.cat([shared[k] for k in local]), copied["theta_local"])
    assert [shared[k].data_ptr() for k in local] == [p.data_ptr() for p in w.params]
    other = _worker(cfg)  # either form restores the same worker
    other.load_state_dict({k: v.clone() for k, v in shared.items()}, shared_meta)
    assert torch.equal(flatten(other.params), copied["theta_local"])
    assert torch.equal(other.theta_global, w.theta_global)
    assert shared["theta_global"].data_ptr() == w.theta_global.data_ptr()
    assert copied["theta_global"].data_ptr() != w.theta_global.data_ptr()
    moments = [k for k in shared if k.startswith("inner.") and k.endswith("exp_avg")]
    assert moments and shared[moments[0]].data_ptr() != copied[moments[0]].data_ptr()


def test_a_classic_rounds_delta_is_read_in_slices_equal_to_the_whole_and_refused_once_theta_moves(
        cfg: RunConfig) -> None:
    """`delta_source()` reads Δ = θ_global − θ_local a slice at a time: every slice, across parameter
    boundaries, equals the same slice of `delta()` to the bit; after any change of θ_local or θ_global
    (an inner step, an outer step, a resync, a heal) a read raises instead of mixing two states."""
    w = _worker(cfg)
    w.train_inner()
    source, whole = w.delta_source(), w.delta()
    assert not isinstance(source, torch.Tensor) and source.numel() == whole.numel()
    cuts = torch.randint(0, whole.numel(), (20,), generator=torch.Generator().manual_seed(0))
    bounds = [0, 1, 7, *(int(b) for b in cuts), whole.numel()]
    for lo, hi in zip(sorted(bounds), sorted(bounds)[1:], strict=False):
        assert torch.equal(source.read(lo, hi), whole[lo:hi]), (lo, hi)
    assert w.delta_problem(source) == w.delta_problem(whole) == ""
    with pytest.raises(IndexError):
        source.read(0, whole.numel() + 1)
    changes = {
        "an inner step": lambda: w.train_inner(1),
        "an outer step": lambda: w.apply(_commit(w)),
        "a resync": w.resync,
        "a heal": lambda: w.adopt_global(round_index=w.round, theta_global=w.theta_global.clone(),
                                         outer_momentum=w.outer.state_tensors().get("momentum")),
    }
    for what, change in changes.items():
        source = w.delta_source()
        source.read(0, 10)
        change()
        with pytest.raises(RuntimeError, match="changed since this Δ was taken"):
            source.read(0, 10)
        assert w.delta_source().read(0, 10).shape == (10,), what


def test_a_non_finite_delta_read_in_slices_is_found(cfg: RunConfig) -> None:
    w = _worker(cfg)
    w.train_inner()
    with torch.no_grad():
        w.params[-1].view(-1)[0] = float("nan")
    source = w.delta_source()
    assert "1 of" in w.delta_problem(source) and w.delta_problem(source) == w.delta_problem(w.delta())

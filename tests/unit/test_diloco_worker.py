"""DilocoWorker: exact resume from state_dict, aborted rounds, error feedback, threaded averaging."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from swarmtrain.averaging.inprocess import InProcessGroup
from swarmtrain.compress import get_codec
from swarmtrain.config import CODEC_DEFAULTS, RunConfig
from swarmtrain.data import ShardedBatches, eval_batches, load_corpus
from swarmtrain.diloco import DilocoWorker
from swarmtrain.diloco.averager import AverageResult
from swarmtrain.diloco.flat import flatten
from swarmtrain.diloco.inner import lr_factor
from swarmtrain.models import build_model
from swarmtrain.round.ballots import Voter

pytestmark = pytest.mark.unit

SPARSE_OUTER = CODEC_DEFAULTS["sparse"]["outer"]  # an outer momentum on sparse means is refused


def _worker(cfg: RunConfig, *, index: int = 0, num_workers: int = 1, codec=None) -> DilocoWorker:
    tokens = load_corpus(cfg.data).train
    batches = ShardedBatches(tokens, worker_index=index, num_workers=num_workers, batch_size=cfg.data.batch_size,
                             seq_len=cfg.data.seq_len, seed=cfg.train.seed)
    return DilocoWorker(cfg, model=build_model(cfg.model, seed=cfg.train.seed), batches=batches,
                        device=torch.device("cpu"), codec=codec, rng_seed=index)


def _commit(worker: DilocoWorker, delta: torch.Tensor) -> AverageResult:
    return AverageResult(round=worker.round, committed=True, mean=delta, members=("a",))


def test_state_dict_resumes_exactly_mid_round(tiny_config: RunConfig) -> None:
    cfg = tiny_config.replace(model={"dropout": 0.1})  # dropout: the RNG state must be carried too
    a = _worker(cfg)
    a.train_inner()
    a.apply(_commit(a, a.delta()))
    a.train_inner(2)  # stop between two inner steps of round 1
    tensors, meta = a.state_dict()
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    meta = json.loads(json.dumps(meta))  # metadata must survive JSON
    b = _worker(cfg)
    b.load_state_dict({k: v.clone() for k, v in tensors.items()}, meta)
    for w in (a, b):
        w.train_inner(2)
        w.apply(_commit(w, w.delta()))
        w.train_inner()
    assert (a.round, a.inner_step) == (b.round, b.inner_step) == (2, 12)
    assert a.global_hash() == b.global_hash()
    assert torch.equal(flatten(a.params), flatten(b.params))


def test_load_state_dict_rejects_a_different_model(tiny_config: RunConfig) -> None:
    tensors, meta = _worker(tiny_config).state_dict()
    other = _worker(tiny_config.replace(model={"n_embd": 32}))
    with pytest.raises(ValueError, match="parameters"):
        other.load_state_dict(tensors, meta)


def test_aborted_round_keeps_theta_global_and_round(tiny_config: RunConfig) -> None:
    w = _worker(tiny_config)
    before = w.global_hash()
    w.train_inner()
    w.delta()
    assert not w.apply(AverageResult(round=0, committed=False, mean=None, reason="too few peers"))
    assert w.round == 0 and w.global_hash() == before
    assert torch.equal(flatten(w.params), w.theta_global)  # local progress dropped, no drift
    with pytest.raises(ValueError, match="round 3"):
        w.apply(AverageResult(round=3, committed=True, mean=torch.zeros(w.numel)))


def test_error_feedback_carries_what_the_codec_lost(tiny_config: RunConfig) -> None:
    cfg = tiny_config.replace(compress={"codec": "int4", "error_feedback": True})
    codec = get_codec("int4")
    w = _worker(cfg, codec=codec)
    w.train_inner()
    raw = w.theta_global - flatten(w.params)
    sent = w.delta()
    torch.testing.assert_close(sent, raw)  # residual starts at zero
    lost = sent - codec.decode(codec.encode(sent))
    assert lost.abs().max() > 0
    w.apply(_commit(w, codec.decode(codec.encode(sent))))
    assert w.residual is not None
    torch.testing.assert_close(w.residual, lost)
    w.train_inner()
    torch.testing.assert_close(w.delta(), (w.theta_global - flatten(w.params)) + lost)
    with pytest.raises(ValueError, match="error_feedback"):
        _worker(cfg, codec=None)


def test_threaded_members_agree_with_the_sequential_group(tiny_config: RunConfig, no_thread_leak: None) -> None:
    k = 2
    group = InProcessGroup(get_codec("fp32"), num_workers=k, timeout_s=30.0)
    workers = [_worker(tiny_config, index=i, num_workers=k) for i in range(k)]
    reports: list = [None] * k

    def run(i: int) -> None:
        reports[i] = [workers[i].run_round(group.member(i)) for _ in range(2)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r is not None and all(x.committed for x in r) for r in reports)
    assert reports[0][-1].hash == reports[1][-1].hash
    reference = [_worker(tiny_config, index=i, num_workers=k) for i in range(k)]
    seq = InProcessGroup(get_codec("fp32"), num_workers=k)
    for r in range(2):
        for w in reference:
            w.train_inner()
        for w, res in zip(reference, seq.average_all(r, [w.delta() for w in reference]), strict=True):
            w.apply(res)
    assert reference[0].global_hash() == reports[0][-1].hash
    assert reports[0][0].bytes_sent > 0 and reports[0][0].members == ("worker-0", "worker-1")


def test_evaluate_and_schedule(tiny_config: RunConfig) -> None:
    w = _worker(tiny_config)
    val = eval_batches(load_corpus(tiny_config.data).val, batch_size=4, seq_len=64, num_batches=2)
    assert 4.0 < w.evaluate(val) < 6.5  # ~ln(256) = 5.5 at init
    inner = tiny_config.inner
    total = 100
    factors = [lr_factor(s, cfg=inner, total_steps=total) for s in range(total + 5)]
    assert factors[0] == pytest.approx(1 / inner.warmup_steps) and factors[inner.warmup_steps - 1] == 1.0
    assert factors[total] == pytest.approx(inner.min_lr_ratio) and factors[-1] == pytest.approx(inner.min_lr_ratio)
    assert all(a >= b for a, b in zip(factors[inner.warmup_steps:], factors[inner.warmup_steps + 1:], strict=False))


def test_a_decayed_residual_is_scaled_before_it_joins_the_next_delta(tiny_config: RunConfig) -> None:
    cfg = tiny_config.replace(compress={"codec": "sparse", "error_feedback": True, "error_feedback_decay": 0.5,
                                        "chunk_size": 64, "density": 0.05}, outer=SPARSE_OUTER)
    codec = get_codec("sparse", chunk_size=64, density=0.05)
    w = _worker(cfg, codec=codec)
    w.train_inner()
    sent = w.delta()
    kept = codec.decode(codec.encode(sent))
    assert 0 < int((kept != 0).sum()) < sent.numel() // 10  # a sparse contribution
    w.apply(_commit(w, kept))
    assert w.residual is not None
    torch.testing.assert_close(w.residual, sent - kept)
    w.train_inner()
    torch.testing.assert_close(w.delta(), (w.theta_global - flatten(w.params)) + 0.5 * (sent - kept))


def test_an_interrupt_ends_inner_steps_after_the_step_it_was_set_in(tiny_config: RunConfig) -> None:
    # an overlapped peer trains until the swarm's mean lands: the same steps as a call that stopped there
    a, b = _worker(tiny_config), _worker(tiny_config)
    landed = threading.Event()
    a.on_step = lambda step: landed.set() if step.step == 3 else None
    stats = a.train_inner(8, interrupt=landed)
    assert stats.steps == 3 and a.inner_step == 3
    assert b.train_inner(3).steps == 3
    assert torch.equal(flatten(a.params), flatten(b.params))
    assert a.train_inner(8, interrupt=landed).steps == 1  # already set: one step still runs


@pytest.mark.parametrize(("codec", "ef"), [("int8", False), ("int8", True), ("sparse", True)])
def test_the_eager_mean_of_an_overlapped_round_is_this_peers_share(tiny_config: RunConfig, codec: str,
                                                                    ef: bool) -> None:
    cfg = tiny_config.replace(compress={"codec": codec, "error_feedback": ef},
                              **({"outer": SPARSE_OUTER} if codec == "sparse" else {}))
    w = _worker(cfg, codec=get_codec(codec))
    w.train_inner()
    w.voters = tuple(Voter(x, 0) for x in "abcd")  # 4 voters named by the last commit; no overlapped round seen yet
    delta = w.delta()
    guess = w.own_contribution(delta.clone()) * w.eager_scale()
    if codec == "sparse":
        # what the codec kept of Δ, on positions the others mostly did not pick: a quarter of it enters the mean
        sent = w.codec.decode(w.codec.encode(delta)).reshape(-1)
        assert torch.equal(guess, sent / 4)
        assert int((guess != 0).sum()) < 0.05 * delta.numel()
    elif ef:  # dense: what the codec carried of Δ (the rest waits in the residual for the next round)
        torch.testing.assert_close(guess, w.codec.decode(w.codec.encode(delta)).reshape(-1))
    else:  # dense Δs of peers that trained on the same θ point the same way
        assert torch.equal(guess, delta)

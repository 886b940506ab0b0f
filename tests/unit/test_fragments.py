"""Streaming DiLoCo (diloco.fragments): each round syncs one fragment; one fragment is classic DiLoCo."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from golden_platform import golden_platform

from swarmtrain.averaging.inprocess import InProcessGroup
from swarmtrain.compress import get_codec
from swarmtrain.config import ConfigError, RunConfig, load_config
from swarmtrain.data import ShardedBatches, load_corpus
from swarmtrain.diloco import DilocoWorker
from swarmtrain.diloco.flat import flatten
from swarmtrain.diloco.fragments import fragment_params, fragment_ranges, gather
from swarmtrain.diloco.simulation import simulate_diloco
from swarmtrain.models import build_model

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).parent / "golden" / "diloco_trajectory.json"


def _simulate(overrides: list[str], *, workers: int = 2, codec_name: str = ""):
    torch.set_num_threads(1)
    cfg: RunConfig = load_config(overrides=overrides)
    corpus = load_corpus(cfg.data)
    codec = get_codec(codec_name or cfg.compress.codec)
    group = InProcessGroup(codec, num_workers=workers)
    return simulate_diloco(cfg, train_tokens=corpus.train, val_tokens=corpus.val, num_workers=workers,
                           average_all=group.average_all)


def test_one_fragment_is_the_golden_classic_trajectory_bit_for_bit() -> None:
    golden = json.loads(GOLDEN.read_text())
    result = _simulate([*golden["overrides"], "diloco.fragments=1"], codec_name="fp32")  # as the golden run
    for got, want in zip(result.rounds, golden["rounds"], strict=True):
        assert (got.tokens, got.bytes_sent) == (want["tokens"], want["bytes_sent"])
        assert got.loss == pytest.approx(want["loss"], rel=1e-5) and got.val_loss == pytest.approx(want["val_loss"],
                                                                                                rel=1e-5)
    plain = _simulate(golden["overrides"], codec_name="fp32")
    assert result.hash == plain.hash  # the same bits as the run without the key
    if golden["platform"] == golden_platform():
        assert result.hash == golden["final_hash"]


def test_fragments_stride_the_blocks_and_cover_theta_once() -> None:
    cfg = load_config(overrides=["model.preset=tiny", "model.n_layer=4"])
    model = build_model(cfg.model, seed=0)
    frags = fragment_ranges(model, 2)
    offsets, names = {}, []
    at = 0
    for name, p in model.named_parameters():
        offsets[name] = (at, at + p.numel())
        names.append(name)
        at += p.numel()
    covered = sorted(r for f in frags for r in f)
    assert covered[0][0] == 0 and covered[-1][1] == at
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(covered))  # disjoint

    def owner(name: str) -> int:
        lo, _ = offsets[name]
        return next(i for i, f in enumerate(frags) if any(a <= lo < b for a, b in f))
    assert owner("tok_emb.weight") == owner("ln_f.weight") == 0
    assert [owner(f"blocks.{b}.attn.qkv.weight") for b in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="fewer transformer blocks"):
        fragment_ranges(model, 5)
    with pytest.raises(ConfigError, match=r"diloco\.fragments"):
        load_config(overrides=["model.preset=tiny", "model.n_layer=2", "diloco.inner_steps=6", "diloco.fragments=3"])


def test_a_fragments_parameters_flatten_to_its_ranges_of_theta() -> None:
    model = build_model(load_config(overrides=["model.preset=tiny", "model.n_layer=4"]).model, seed=0)
    params = list(model.parameters())
    frags = fragment_ranges(model, 3)
    theta = flatten(params)
    chosen = [fragment_params(params, f) for f in frags]
    for frag, mine in zip(frags, chosen, strict=True):
        assert torch.equal(flatten(mine), gather(theta, frag))
    assert sorted(id(p) for ps in chosen for p in ps) == sorted(id(p) for p in params)  # each once
    first = params[0].numel()
    with pytest.raises(ValueError, match="cuts the parameter"):
        fragment_params(params, [(0, first + 1)])
    with pytest.raises(ValueError, match="cover"):
        fragment_params(params, [(0, theta.numel() + 8)])


def _workers(cfg: RunConfig, k: int) -> list[DilocoWorker]:
    tokens = load_corpus(cfg.data).train
    return [DilocoWorker(cfg, model=build_model(cfg.model, seed=cfg.train.seed), device=torch.device("cpu"),
                         batches=ShardedBatches(tokens, worker_index=i, num_workers=k, batch_size=cfg.data.batch_size,
                                                seq_len=cfg.data.seq_len, seed=cfg.train.seed), rng_seed=i)
            for i in range(k)]


def test_a_round_moves_only_its_fragment_and_the_others_keep_training_locally() -> None:
    cfg = load_config(overrides=["model.preset=tiny", "data.seq_len=32", "data.batch_size=2",
                                 "data.max_corpus_bytes=500000", "diloco.inner_steps=4", "diloco.fragments=2",
                                 "outer.lr=1.0", "outer.momentum=0", "outer.nesterov=false", "compress.codec=fp32"])
    workers = _workers(cfg, 2)
    frags = workers[0].fragments
    assert frags is not None and [w.fragment() for w in workers] == [frags[0]] * 2
    group = InProcessGroup(get_codec("fp32"), num_workers=2)
    start = workers[0].theta_global.clone()
    for round_index, frag in ((0, frags[0]), (1, frags[1])):
        before = workers[0].theta_global.clone()
        stats = [w.train_inner() for w in workers]
        assert all(s.steps == 2 for s in stats)  # H / P
        locals_ = [flatten(w.params) for w in workers]
        writes = [p._version for p in workers[0].params]  # in-place writes so far, per parameter
        deltas = [w.delta() for w in workers]
        assert deltas[0].numel() == sum(hi - lo for lo, hi in frag)
        for w, r in zip(workers, group.average_all(round_index, deltas), strict=True):
            assert w.apply(r)
        after = workers[0].theta_global
        other = frags[1 - round_index]
        # the round wrote its fragment's parameters only (the others' tensors were not even copied into)
        mine = {id(p) for p in fragment_params(workers[0].params, frag)}
        assert [p._version > v for p, v in zip(workers[0].params, writes, strict=True)] == \
            [id(p) in mine for p in workers[0].params]
        # plain averaging: the fragment is the workers' mean θ_local; the other fragment did not move
        want = (gather(locals_[0], frag) + gather(locals_[1], frag)) / 2
        torch.testing.assert_close(gather(after, frag), want, rtol=0, atol=1e-6)
        assert torch.equal(gather(after, other), gather(before, other))
        for w, local in zip(workers, locals_, strict=True):
            theta_local = flatten(w.params)
            assert torch.equal(gather(theta_local, frag), gather(after, frag))
            assert torch.equal(gather(theta_local, other), gather(local, other))  # local progress kept
    assert not torch.equal(gather(workers[0].theta_global, frags[1]), gather(start, frags[1]))


@pytest.mark.parametrize("overlap", [False, True])
def test_a_fragmented_run_commits_every_round_with_one_theta(overlap: bool) -> None:
    result = _simulate(["model.preset=tiny", "model.n_layer=2", "data.seq_len=32", "data.batch_size=2",
                        "data.max_corpus_bytes=500000", "diloco.inner_steps=4", "diloco.fragments=2",
                        "diloco.rounds=6", f"diloco.overlap={'true' if overlap else 'false'}",
                        "diloco.overlap_max_steps=1", "diloco.eval_batches=1", "compress.codec=int8"])
    assert len(result.rounds) == 6  # simulate_diloco checks every round's hashes agree
    assert result.rounds[-1].tokens == 6 * 2 * 2 * 2 * 32  # rounds × H/P × workers × batch × seq
    assert result.final_val_loss < result.initial_val_loss

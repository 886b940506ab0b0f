"""Gradient accumulation over micro-batches, and train.precision's autocast and fp16 gradient scaler."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.config import load_config
from swarmtrain.data import ShardedBatches, load_corpus
from swarmtrain.diloco import DilocoWorker
from swarmtrain.diloco.flat import flatten
from swarmtrain.diloco.precision import Precision
from swarmtrain.models import build_model

pytestmark = pytest.mark.unit


def _worker(*extra: str) -> DilocoWorker:
    cfg = load_config(overrides=["model.arch=llama", "model.preset=tiny", "data.seq_len=32", "data.batch_size=8",
                                 "data.max_corpus_bytes=200000", "inner.warmup_steps=1", *extra])
    batches = ShardedBatches(load_corpus(cfg.data).train, worker_index=0, num_workers=1, batch_size=8, seq_len=32,
                             seed=1)
    return DilocoWorker(cfg, model=build_model(cfg.model, seed=2), batches=batches, device=torch.device("cpu"))


def test_micro_batches_take_the_same_steps_on_the_same_data() -> None:
    torch.set_num_threads(1)
    whole, split = _worker(), _worker("data.micro_batch_size=2")
    a, b = whole.train_inner(3), split.train_inner(3)
    assert abs(a.loss - b.loss) < 1e-5 and a.tokens == b.tokens
    assert torch.allclose(flatten(whole.params), flatten(split.params), atol=1e-5)
    assert whole.batches.state_dict() == split.batches.state_dict()


def test_bf16_autocast_trains_on_cpu() -> None:
    w = _worker("train.precision=bf16")
    assert w.precision.dtype is torch.bfloat16
    stats = w.train_inner(2)
    assert torch.isfinite(torch.tensor(stats.loss)) and w.theta_global.dtype is torch.float32


def test_fp16_scaler_skips_an_overflowing_step_and_checkpoints_its_scale() -> None:
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    prec = Precision("fp16", device=torch.device("cpu"))
    start = prec.scaler.get_scale()
    prec.backward((p * float("inf")).sum())
    prec.unscale_(opt)
    prec.step(opt)
    assert torch.equal(p.detach(), torch.ones(4)), "an overflowing step must not move the weights"
    assert prec.scaler.get_scale() == start / 2
    opt.zero_grad()
    prec.backward(p.sum())
    prec.unscale_(opt)
    prec.step(opt)
    assert torch.allclose(p.detach(), torch.full((4,), 0.9))
    w = _worker("train.precision=fp16")
    w.train_inner(2)
    _, meta = w.state_dict()
    assert meta["grad_scaler"]["scale"] == w.precision.scaler.get_scale()
    other = _worker("train.precision=fp16")
    other.load_state_dict(*w.state_dict())
    assert other.precision.scaler.get_scale() == w.precision.scaler.get_scale()

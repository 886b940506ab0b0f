"""H=1, inner SGD, outer lr 1, momentum 0: DiLoCo over K workers equals data-parallel SGD over K ranks."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.averaging.inprocess import InProcessGroup
from swarmtrain.compress import get_codec
from swarmtrain.config import RunConfig
from swarmtrain.data import ShardedBatches, load_corpus
from swarmtrain.diloco import DilocoWorker
from swarmtrain.diloco.flat import flatten
from swarmtrain.models import build_model

pytestmark = pytest.mark.unit

K = 3
STEPS = 4


def _worker(cfg: RunConfig, tokens: torch.Tensor, *, index: int, num_workers: int, batch_size: int) -> DilocoWorker:
    batches = ShardedBatches(tokens, worker_index=index, num_workers=num_workers, batch_size=batch_size,
                             seq_len=cfg.data.seq_len, seed=cfg.train.seed)
    return DilocoWorker(cfg, model=build_model(cfg.model, seed=cfg.train.seed), batches=batches,
                        device=torch.device("cpu"))


def test_diloco_h1_equals_data_parallel_sgd(tiny_config: RunConfig) -> None:
    cfg = tiny_config.replace(
        inner={"optimizer": "sgd", "lr": 0.5, "momentum": 0.0, "grad_clip": 0.0, "warmup_steps": 0,
               "min_lr_ratio": 1.0},
        outer={"lr": 1.0, "momentum": 0.0, "nesterov": False},
        diloco={"inner_steps": 1, "rounds": STEPS},
    )
    tokens = load_corpus(cfg.data).train
    workers = [_worker(cfg, tokens, index=k, num_workers=K, batch_size=cfg.data.batch_size) for k in range(K)]
    group = InProcessGroup(get_codec("fp32"), num_workers=K)
    ddp = _worker(cfg, tokens, index=0, num_workers=1, batch_size=K * cfg.data.batch_size)
    start = flatten(ddp.params)
    for r in range(STEPS):
        for w in workers:
            w.train_inner()
        for w, result in zip(workers, group.average_all(r, [w.delta() for w in workers]), strict=True):
            assert w.apply(result)
        ddp.train_inner(1)
        theta_ddp = flatten(ddp.params)
        assert not torch.equal(theta_ddp, start)  # it trains
        for w in workers:
            torch.testing.assert_close(w.theta_global, theta_ddp, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(flatten(w.params), theta_ddp, rtol=1e-5, atol=1e-6)
    assert {w.global_hash() for w in workers} == {workers[0].global_hash()}

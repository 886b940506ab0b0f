"""Warm starts of the simulation drivers: `init_theta` + `start_step` continue a run exactly."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.averaging.inprocess import InProcessGroup
from swarmtrain.compress import get_codec
from swarmtrain.config import RunConfig
from swarmtrain.data import load_corpus
from swarmtrain.diloco.simulation import SimulationResult, simulate_ddp, simulate_diloco

pytestmark = pytest.mark.unit

# Memoryless inner SGD at a constant lr (and outer lr 1, momentum 0): a run of 2 steps equals a run of
# 1 step followed by a 1-step run that starts from its weights at data step 1.
MEMORYLESS = {"inner": {"optimizer": "sgd", "lr": 0.05, "warmup_steps": 0, "min_lr_ratio": 1.0, "grad_clip": 0.0,
                        "weight_decay": 0.0},
              "outer": {"lr": 1.0, "momentum": 0.0, "nesterov": False}, "diloco": {"inner_steps": 1}}


def _run(cfg: RunConfig, mode: str, *, rounds: int, init_theta: torch.Tensor | None = None,
         start_step: int = 0) -> SimulationResult:
    torch.set_num_threads(1)
    cfg = cfg.replace(diloco={"rounds": rounds})
    corpus = load_corpus(cfg.data)
    kwargs = {"train_tokens": corpus.train, "val_tokens": corpus.val, "num_workers": 2, "init_theta": init_theta,
              "start_step": start_step}
    if mode == "ddp":
        return simulate_ddp(cfg, **kwargs)
    return simulate_diloco(cfg, average_all=InProcessGroup(get_codec("fp32"), num_workers=2).average_all, **kwargs)


@pytest.mark.parametrize("mode", ["ddp", "diloco"])
def test_warm_start_continues_the_run(tiny_config: RunConfig, mode: str) -> None:
    cfg = tiny_config.replace(**MEMORYLESS)
    whole = _run(cfg, mode, rounds=2)
    first = _run(cfg, mode, rounds=1)
    assert first.final_theta is not None and whole.final_theta is not None
    rest = _run(cfg, mode, rounds=1, init_theta=first.final_theta, start_step=1)
    assert rest.initial_val_loss == pytest.approx(first.final_val_loss, rel=1e-6)
    assert rest.final_theta is not None
    torch.testing.assert_close(rest.final_theta, whole.final_theta, rtol=1e-5, atol=1e-6)
    replayed = _run(cfg, mode, rounds=1, init_theta=first.final_theta, start_step=0)  # step 0's batch again
    assert replayed.final_theta is not None
    assert not torch.allclose(replayed.final_theta, whole.final_theta, rtol=1e-5, atol=1e-6)


def test_negative_start_step_is_rejected(tiny_config: RunConfig) -> None:
    with pytest.raises(ValueError, match="start_step"):
        _run(tiny_config, "ddp", rounds=1, start_step=-1)

"""pipeline/memory.py and models/memory.py: what each part needs to train; peer/memory.py: a worker's budget check."""

from __future__ import annotations

import pytest

from swarmtrain.config import load_config
from swarmtrain.models import build_model
from swarmtrain.peer.memory import check_worker_budget
from swarmtrain.peer.services import PeerError
from swarmtrain.pipeline.memory import (
    MB,
    server_bytes,
    stage_params,
    trainer_bytes,
    worker_bytes,
)

pytestmark = pytest.mark.unit


def test_the_parts_add_up_to_the_model() -> None:
    cfg = load_config(overrides=["model.preset=small", "model.n_layer=5", "pipeline.stages=2", "data.seq_len=32"])
    model = build_model(cfg.model, seed=0)
    total = sum(p.numel() for p in model.parameters())
    blocks = stage_params(cfg.model, 2)
    assert len(blocks) == 2 and blocks[0] == 3 * blocks[1] / 2  # 3 blocks and 2
    assert worker_bytes(cfg.model) == total * 24
    assert trainer_bytes(cfg.model) == (total - sum(blocks)) * 24  # + θ_global and the outer momentum
    contexts = cfg.pipeline.max_contexts * cfg.pipeline.microbatch_size * 32 * 128 * 4
    assert server_bytes(cfg.model, cfg.pipeline, seq_len=32) == [b * 24 + contexts for b in blocks]


def test_a_worker_over_its_budget_is_refused_naming_both_figures() -> None:
    cfg = load_config(overrides=["model.preset=small", "train.memory_budget_mb=10"])
    need = worker_bytes(cfg.model) / MB
    check_worker_budget(cfg.replace(train={"memory_budget_mb": 0}))  # no budget: no limit
    check_worker_budget(cfg.replace(train={"memory_budget_mb": int(need) + 1}))
    with pytest.raises(PeerError, match=rf"needs {need:.0f} MB .* train.memory_budget_mb=1: the run would"):
        check_worker_budget(cfg.replace(train={"memory_budget_mb": 1}))
    with pytest.raises(PeerError, match=r"join as a stage server"):
        check_worker_budget(cfg.replace(train={"memory_budget_mb": 1}, pipeline={"stages": 2}))


def test_the_memory_count_imports_first() -> None:
    """The peer package imports pipeline.memory; importing it first in a fresh interpreter must not cycle."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import swarmtrain.pipeline.memory"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr

"""A golden 3-round DiLoCo trajectory on a seeded tiny model (the DiLoCo surface freeze).

Regenerate after an intended change of the algorithm (and say why in the commit):
    python tests/unit/test_diloco_golden.py
Losses are compared to 1e-5; θ_global hashes only where torch's version, CPU kernel set and the CPU's
matrix extensions match the recorded ones (golden_platform.py: others may round differently in the last bit).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from golden_platform import golden_platform

from swarmtrain.averaging.inprocess import InProcessGroup
from swarmtrain.compress import get_codec
from swarmtrain.config import RunConfig, load_config
from swarmtrain.data import load_corpus
from swarmtrain.diloco.simulation import simulate_diloco

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).parent / "golden" / "diloco_trajectory.json"
OVERRIDES = [
    "model.preset=tiny", "data.seq_len=64", "data.batch_size=4", "data.max_corpus_bytes=2000000",
    "inner.warmup_steps=2", "diloco.inner_steps=4", "diloco.rounds=3", "diloco.eval_batches=2", "train.seed=7",
]


def _trajectory() -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg: RunConfig = load_config(overrides=OVERRIDES)
    corpus = load_corpus(cfg.data)
    group = InProcessGroup(get_codec("fp32"), num_workers=2)
    result = simulate_diloco(cfg, train_tokens=corpus.train, val_tokens=corpus.val, num_workers=2,
                             average_all=group.average_all)
    return {
        "overrides": OVERRIDES, "workers": 2, "platform": golden_platform(),
        "initial_val_loss": result.initial_val_loss,
        "rounds": [{"round": r.round, "loss": r.loss, "val_loss": r.val_loss, "tokens": r.tokens,
                    "bytes_sent": r.bytes_sent} for r in result.rounds],
        "final_hash": result.hash,
    }


def test_golden_trajectory() -> None:
    expected = json.loads(GOLDEN.read_text())
    got = _trajectory()
    assert got["overrides"] == expected["overrides"]
    assert got["initial_val_loss"] == pytest.approx(expected["initial_val_loss"], rel=1e-5)
    assert len(got["rounds"]) == len(expected["rounds"]) == 3
    for g, e in zip(got["rounds"], expected["rounds"], strict=True):
        assert (g["round"], g["tokens"], g["bytes_sent"]) == (e["round"], e["tokens"], e["bytes_sent"])
        assert g["loss"] == pytest.approx(e["loss"], rel=1e-5), f"round {g['round']} training loss"
        assert g["val_loss"] == pytest.approx(e["val_loss"], rel=1e-5), f"round {g['round']} val loss"
    if got["platform"] == expected["platform"]:
        assert got["final_hash"] == expected["final_hash"]


if __name__ == "__main__":
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(_trajectory(), indent=2) + "\n")
    sys.stdout.write(f"wrote {GOLDEN}\n")

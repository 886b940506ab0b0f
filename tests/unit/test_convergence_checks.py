"""The sparse target check of `benchmarks/convergence.py` refuses to pass against an int8 run that diverged."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@pytest.fixture(scope="module")
def convergence() -> ModuleType:
    path = RESULTS.parent / "convergence.py"
    spec = importlib.util.spec_from_file_location("convergence_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def _run(arm: str, losses: list[float], final: float, bytes_sent: int) -> dict:
    return {"corpus": "stdlib", "seed": 0, "arm": arm, "mode": "diloco", "warm_start_val_loss": 2.0,
            "initial_val_loss": 5.0, "rounds": [{"val_loss": v} for v in losses], "final_val_loss": final,
            "bytes_sent": bytes_sent}


SPARSE = "diloco H=50 sparse+ef+d=0.011"


def _check(convergence: ModuleType, int8_losses: list[float], sparse_final: float) -> str:
    results = [_run("diloco H=50 int8", int8_losses, int8_losses[-1], 26_000),
               _run(SPARSE, [1.9, sparse_final], sparse_final, 1_000)]
    rows = [{"corpus": "stdlib", "arm": SPARSE, "ddp_bytes_over_arm": 5000.0}]
    return convergence.sparse_checks(results, rows, [])


def test_a_sparse_arm_within_one_percent_of_a_sound_baseline_passes(convergence: ModuleType) -> None:
    line = _check(convergence, [2.03, 1.8, 1.5], 1.51)
    assert "within 1% and >= 25x: yes" in line and "26.0x" in line


def test_a_sparse_arm_beyond_one_percent_fails(convergence: ModuleType) -> None:
    assert "within 1% and >= 25x: NO" in _check(convergence, [2.03, 1.8, 1.5], 1.52)


def test_beating_a_baseline_that_diverged_on_the_way_does_not_pass(convergence: ModuleType) -> None:
    line = _check(convergence, [2.1, 2.3, 1.6], 1.4)  # peak 2.3 is 1.15x its start of 2.0
    assert "within 1% and >= 25x: NO" in line
    assert "rose to 1.150x its start" in line


def test_every_stored_sweep_baseline_passes_the_rise_guard_and_the_base_model_runs_do_not(
        convergence: ModuleType) -> None:
    rises = {}
    for path in sorted(RESULTS.glob("convergence-sparse-*.json")):
        for run in json.loads(path.read_text())["runs"]:
            if run["arm"] == "diloco H=50 int8":
                rises[path.stem] = convergence.peak_rise(run)
    assert rises, "no stored int8 runs"
    for stem, rise in rises.items():
        diverged = stem.startswith("convergence-sparse-base-")
        assert (rise > convergence.BASELINE_MAX_RISE) == diverged, (stem, rise)

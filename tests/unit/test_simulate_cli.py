"""`swarmtrain simulate`: results JSON end to end, and one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarmtrain.daemon.cli import main

pytestmark = pytest.mark.unit

TINY = ["--model", "tiny", "--inner-steps", "2", "--rounds", "2", "--workers", "2", "--no-progress",
        "--set", "data.seq_len=32", "--set", "data.batch_size=2", "--set", "data.max_corpus_bytes=400000",
        "--set", "diloco.eval_batches=1", "--set", "inner.warmup_steps=1"]


@pytest.mark.parametrize("mode", ["diloco", "ddp"])
def test_simulate_writes_results(tmp_path: Path, mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results.json"
    fp32 = ["--codec", "fp32"] if mode == "diloco" else []  # 4 bytes per value, as DDP's gradients
    assert main(["simulate", "--mode", mode, "--seed", "3", "--out", str(out), *fp32, *TINY]) == 0
    res = json.loads(out.read_text())
    assert res["mode"] == mode and res["workers"] == 2
    assert [r["round"] for r in res["rounds"]] == [0, 1]
    assert res["tokens"] == res["rounds"][-1]["tokens"] == 2 * 2 * 2 * 2 * 32  # rounds × H × K × B × T
    assert res["final_val_loss"] == res["rounds"][-1]["val_loss"] < res["initial_val_loss"]
    # 2(K−1)/K × 4 bytes × params per all-reduce; diloco: one per round, ddp: one per step (R=2, H=2, K=2)
    allreduces = 2 if mode == "diloco" else 4
    expected = allreduces * 2 * (2 - 1) / 2 * 4 * res["num_params"]
    assert expected <= res["bytes_sent"] < expected * 1.01  # + codec headers
    assert res["config"]["train"]["seed"] == 3 and res["config"]["diloco"]["inner_steps"] == 2
    assert str(out) in capsys.readouterr().out


def test_simulate_codec_flag_changes_bytes(tmp_path: Path) -> None:
    sizes = {}
    for codec in ("fp32", "int8"):
        out = tmp_path / f"{codec}.json"
        assert main(["simulate", "--codec", codec, "--out", str(out), *TINY]) == 0
        sizes[codec] = json.loads(out.read_text())["bytes_sent"]
    assert 3.5 < sizes["fp32"] / sizes["int8"] < 4.0


@pytest.mark.parametrize(("extra", "needle"), [
    (["--set", "inner.lr=-1"], "inner.lr"),
    (["--set", "inner.nope=1"], "inner.nope"),
    (["--config", "/does/not/exist.toml"], "exist.toml"),
    (["--data", "/does/not/exist.txt"], "exist.txt: data file not found"),
    (["--codec", "int7"], "compress.codec"),
])
def test_simulate_bad_input_exits_with_one_line(extra: list[str], needle: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *TINY, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and err[0].startswith("swarmtrain simulate: error:"), err


def test_simulate_empty_corpus_exits_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["simulate", *TINY, "--data", str(empty)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "corpus too small" in err[0], err

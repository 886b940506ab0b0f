"""Config: defaults < TOML < overrides; unknown keys and bad values name the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from swarmtrain.config import ConfigError, RunConfig, load_config, to_toml

pytestmark = pytest.mark.unit


def test_defaults_then_file_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text('[outer]\nlr = 0.5\n[diloco]\ninner_steps = 20\n[data]\npaths = ["a.txt"]\n')
    cfg = load_config(f, ["outer.lr=0.9", "compress.codec=int8"])
    assert cfg.outer.lr == 0.9 and cfg.diloco.inner_steps == 20
    assert cfg.compress.codec == "int8" and cfg.data.paths == ("a.txt",)
    assert cfg.outer.momentum == RunConfig().outer.momentum


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("outer.lrr=1", "outer.lrr: unknown key"),
        ("nosuch.x=1", "nosuch: unknown config section"),
        ("outer.lr=-1", "outer.lr: must be > 0"),
        ("diloco.inner_steps=2.5", "diloco.inner_steps: expected int"),
        ("outer.nesterov=1", "outer.nesterov: expected bool"),
        ("compress.codec=int3", "compress.codec"),
        ("model.preset=huge", "model.preset"),
        ("outer.lr", "must look like section.key=value"),
        ("averaging.contribution_window_s=60", "averaging.contribution_window_s: 60.0 must be shorter than "
                                               "averaging.allreduce_timeout_s"),
    ],
)
def test_bad_values_name_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(overrides=[override])


def test_missing_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[outer\nlr=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_toml_round_trip(tmp_path: Path) -> None:
    cfg = load_config(overrides=["data.paths=['x', 'y']", "train.seed=7", "rpc.run_key=s3cret"])
    f = tmp_path / "out.toml"
    f.write_text(to_toml(cfg))
    assert load_config(f) == cfg


def test_replace_merges_sections() -> None:
    cfg = RunConfig().replace(outer={"lr": 1.0, "momentum": 0.0, "nesterov": False})
    assert (cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov) == (1.0, 0.0, False)
    with pytest.raises(ConfigError, match=r"outer\.bogus"):
        RunConfig().replace(outer={"bogus": 1})


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["model.n_head=3"], "model.n_embd: 64 must be divisible by model.n_head (3)"),
        (["data.seq_len=300"], "data.seq_len: 300 exceeds the model's context length 256"),
        (["model.context_len=32", "data.seq_len=64"], "data.seq_len: 64 exceeds the model's context length 32"),
        (["model.vocab_size=100"], "model.vocab_size: 100 is smaller than the data's 256"),
    ],
)
def test_cross_field_errors_are_caught_at_load(overrides: list[str], field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config(overrides=["model.preset=tiny", *overrides])
    assert load_config(overrides=["model.preset=tiny", "data.seq_len=256"]).data.seq_len == 256


def test_config_knows_the_data_vocabulary() -> None:
    from swarmtrain.config import BYTE_VOCAB_SIZE
    from swarmtrain.data import VOCAB_SIZE

    assert BYTE_VOCAB_SIZE == VOCAB_SIZE


def test_public_dict_blanks_the_run_key() -> None:
    from swarmtrain.config import public_dict

    cfg = load_config(overrides=["rpc.run_key=s3cret"])
    assert public_dict(cfg)["rpc"]["run_key"] == "" and cfg.rpc.run_key == "s3cret"

"""A codec's own outer step: a config that names the sparse codec gets SparseLoCo's step for the keys it
leaves unset, every key it sets wins, and a record that carries every key is read back unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmtrain.config import CODEC_DEFAULTS, ConfigError, RunConfig, from_dict, load_config, to_dict, to_toml

pytestmark = pytest.mark.unit


def _outer_step(cfg: RunConfig) -> tuple[float, float, bool, bool, float]:
    return (cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov, cfg.compress.error_feedback,
            cfg.compress.error_feedback_decay)


def test_naming_the_sparse_codec_brings_its_outer_step() -> None:
    cfg = load_config(overrides=["compress.codec=sparse"])
    assert _outer_step(cfg) == (4.0, 0.0, False, True, 0.9)
    sparse = CODEC_DEFAULTS["sparse"]
    assert {k: getattr(cfg.outer, k) for k in sparse["outer"]} == sparse["outer"]
    assert {k: getattr(cfg.compress, k) for k in sparse["compress"]} == sparse["compress"]


def test_other_codecs_keep_the_sections_defaults() -> None:
    for codec in ("int8", "int4", "fp32"):
        cfg = load_config(overrides=[f"compress.codec={codec}"])
        assert _outer_step(cfg) == _outer_step(RunConfig())


def test_every_key_the_config_sets_wins(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text('[compress]\ncodec = "sparse"\nerror_feedback_decay = 1.0\n[outer]\nlr = 2.0\n')
    cfg = load_config(f, ["outer.momentum=0.5", "outer.nesterov=true"])
    assert _outer_step(cfg) == (2.0, 0.5, True, True, 1.0)


def test_the_codec_set_by_an_override_counts_too(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text("[outer]\nlr = 3.0\n")
    cfg = load_config(f, ["compress.codec=sparse"])
    assert _outer_step(cfg) == (3.0, 0.0, False, True, 0.9)


def test_a_resolved_config_round_trips_unchanged(tmp_path: Path) -> None:
    cfg = load_config(overrides=["compress.codec=sparse", "outer.lr=6"])
    assert from_dict(to_dict(cfg)) == cfg  # a run record carries every key: nothing is filled in again
    f = tmp_path / "out.toml"
    f.write_text(to_toml(cfg))
    assert load_config(f) == cfg


def test_a_malformed_section_is_still_reported_by_name() -> None:
    with pytest.raises(ConfigError, match=r"^outer: must be a table"):
        from_dict({"compress": {"codec": "sparse"}, "outer": 3})
    with pytest.raises(ConfigError, match=r"compress\.codec"):
        from_dict({"compress": {"codec": 7}})


def test_an_outer_momentum_that_diverges_on_sparse_means_is_refused_by_name() -> None:
    for overrides in (["outer.momentum=0.9"], ["outer.momentum=0.9", "outer.nesterov=true", "outer.lr=1"],
                      ["outer.momentum=0.95", "outer.nesterov=false"]):
        with pytest.raises(ConfigError, match=r"^outer\.momentum: .* with compress\.codec = 'sparse' diverges"):
            load_config(overrides=["compress.codec=sparse", *overrides])
    with pytest.raises(ConfigError, match=r"outer\.momentum"):  # built in code, with the sections' defaults
        RunConfig().replace(compress={"codec": "sparse", "error_feedback": True})
    ok = load_config(overrides=["compress.codec=sparse", "outer.momentum=0.5", "outer.nesterov=true", "outer.lr=2"])
    assert (ok.outer.momentum, ok.outer.nesterov) == (0.5, True)
    assert load_config(overrides=["outer.momentum=0.9"]).outer.momentum == 0.9  # dense codecs: the default

"""The resolved run: fingerprints, tokenizer hashes, and a peer whose files differ refused by field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarmtrain.config import ConfigError, load_config
from swarmtrain.models.spec import RunMismatchError, check_run, resolve_run

pytestmark = pytest.mark.unit

HF = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def test_builtin_models_resolve_to_their_dimensions() -> None:
    cfg = resolve_run(load_config(overrides=["model.arch=llama", "model.preset=small"]))
    sig = dict(s.split("=", 1) for s in cfg.model.signature)
    assert (sig["arch"], sig["n_layer"], sig["n_kv_head"], sig["vocab_size"]) == ('"llama"', "4", "2", "256")
    assert cfg.data.tokenizer_hash == "bytes" and len(cfg.model.fingerprint) == 64
    assert check_run(cfg) == cfg  # the same files resolve the same
    other = resolve_run(load_config(overrides=["model.arch=llama", "model.preset=small", "model.n_layer=5"]))
    assert other.model.fingerprint != cfg.model.fingerprint


def test_a_peer_with_another_hf_config_is_refused_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF))
    run = resolve_run(load_config(overrides=["model.arch=hf", f"model.hf_path={json.dumps(str(path))}",
                                             "data.seq_len=32"]))
    assert "config.num_hidden_layers=2" in run.model.signature
    path.write_text(json.dumps({**HF, "num_hidden_layers": 3, "rms_norm_eps": 1e-6}))
    with pytest.raises(RunMismatchError, match=r"config\.num_hidden_layers = 3 here, 2 in the run") as e:
        check_run(run)
    assert "config.rms_norm_eps = 1e-06 here, (none) in the run" in str(e.value)


def test_a_peer_with_another_tokenizer_file_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from swarmtrain.data.tokenizer_train import train_bpe

    tok = tmp_path / "tok.json"
    train_bpe(iter(["some text " * 50, "other words " * 40]), vocab_size=280, out=tok)
    run = resolve_run(load_config(overrides=[f"data.tokenizer={json.dumps(str(tok))}", "model.vocab_size=280"]))
    train_bpe(iter(["different words, other text " * 60, "and more of it " * 30]), vocab_size=280, out=tok)
    with pytest.raises(RunMismatchError, match=rf"data.tokenizer: this peer's tokenizer \({tok} on this peer\)"):
        check_run(run)
    with pytest.raises(ConfigError, match=r"model.vocab_size: 256 is smaller than the 2[5-9][0-9] tokens"):
        resolve_run(load_config(overrides=[f"data.tokenizer={json.dumps(str(tok))}"]))


def test_config_errors_name_the_field() -> None:
    for overrides, match in [
        (["model.arch=llama", "model.preset=124m"], "model.preset: unknown llama preset"),
        (["model.arch=llama", "model.n_kv_head=3"], "model.n_kv_head: 3 must divide model.n_head"),
        (["model.arch=gpt", "model.n_kv_head=2"], "model.n_kv_head: is a llama field"),
        (["model.arch=hf"], "model.hf_path: must name"),
        (["model.hf_path=x.json"], "model.hf_path: is only used with model.arch = 'hf'"),
        (["model.arch=hf", "model.hf_path=c.json", "pipeline.stages=2"],
         "pipeline.stages: a pipeline cuts the built-in"),
        (["data.batch_size=8", "data.micro_batch_size=3"], "data.micro_batch_size: 3 does not divide"),
        (["data.shards=x", "data.paths=['y']"], "data.shards: excludes data.paths"),
        (["train.precision=fp8"], "train.precision: 'fp8' is not one of"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(overrides=overrides)

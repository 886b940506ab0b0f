"""The resolved model and tokenizer a run agrees on: signature, fingerprint and tokenizer hash.

The coordinator resolves its config once (`resolve_run`): every dimension of a built-in model, every field
of an `hf` config.json, the hash of initial weights and of the tokenizer file go into the run config it
publishes (`model.signature`, `model.fingerprint`, `data.tokenizer_hash`). A peer resolves the same config
against its own files (`check_run`) and is refused, with the fields that differ named, when they do not
give the same: a config.json, tokenizer or weights file that differs between machines would otherwise
train a different model under the same round numbers, or fail only inside the first all-reduce.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from swarmtrain.config import BYTES_TOKENIZER, ConfigError, RunConfig

__all__ = ["RunMismatchError", "check_run", "fingerprint_of", "model_signature", "resolve_run"]

_GPT_FIELDS = ("n_layer", "n_head", "n_embd", "context_len")
_LLAMA_FIELDS = ("n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size", "context_len")


class RunMismatchError(ConfigError):
    """This peer's model or tokenizer resolves otherwise than the run's; names each field that differs."""


def _sha256(path: Path) -> str:
    from swarmtrain.data.tokenizer import file_sha256

    return file_sha256(path)


def _model_items(cfg: RunConfig) -> dict[str, Any]:
    m = cfg.model
    items: dict[str, Any] = {"arch": m.arch}
    if m.arch == "hf":
        from swarmtrain.models.hf import IGNORED_FIELDS, read_hf_source

        source = read_hf_source(m.hf_path)
        items.update({f"config.{k}": v for k, v in sorted(source.fields.items()) if k not in IGNORED_FIELDS})
        for f in source.weight_files():
            items[f"weights.{f.name}.sha256"] = _sha256(f)
        return items
    items.update({k: m.shape_value(k) for k in (_GPT_FIELDS if m.arch == "gpt" else _LLAMA_FIELDS)})
    items["vocab_size"] = m.vocab_size
    if m.arch == "llama":
        items.update(rope_theta=m.rope_theta, norm_eps=m.norm_eps, tie_embeddings=m.tie_embeddings)
    else:
        items["dropout"] = m.dropout
    if m.init_from:
        if not Path(m.init_from).is_file():
            raise ConfigError(f"model.init_from: {m.init_from}: no such file")
        items["init_from.sha256"] = _sha256(Path(m.init_from))
    return items


def model_signature(cfg: RunConfig) -> tuple[str, ...]:
    """`name=value` (value as JSON) of everything that makes up the run's model, in a fixed order."""
    return tuple(f"{k}={json.dumps(v, sort_keys=True)}" for k, v in _model_items(cfg).items())


def fingerprint_of(signature: tuple[str, ...]) -> str:
    return hashlib.sha256("\n".join(signature).encode()).hexdigest()


def _check_fits(cfg: RunConfig, signature: tuple[str, ...], *, tokenizer_vocab: int) -> None:
    values = dict(s.split("=", 1) for s in signature)
    if cfg.model.arch != "hf":
        if cfg.model.vocab_size < tokenizer_vocab:
            raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the {tokenizer_vocab} tokens "
                              f"of data.tokenizer = {cfg.data.tokenizer!r}")
        return
    if "config.vocab_size" not in values:
        raise ConfigError(f"model.hf_path: {cfg.model.hf_path}: the config has no vocab_size")
    vocab = int(json.loads(values["config.vocab_size"]))
    if vocab < tokenizer_vocab:
        raise ConfigError(f"model.hf_path: vocab_size {vocab} of {cfg.model.hf_path} is smaller than the "
                          f"{tokenizer_vocab} tokens of data.tokenizer = {cfg.data.tokenizer!r}")
    longest = json.loads(values.get("config.max_position_embeddings", "0")) or 0
    if longest and cfg.data.seq_len > longest:
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} exceeds max_position_embeddings {longest} of "
                          f"{cfg.model.hf_path}")


def resolve_run(cfg: RunConfig) -> RunConfig:
    """`cfg` with its model's signature and fingerprint and its tokenizer's hash filled in, after checking
    that the tokenizer, the shards and the model fit together (ConfigError naming the field otherwise)."""
    from swarmtrain.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    signature = model_signature(cfg)
    _check_fits(cfg, signature, tokenizer_vocab=tokenizer.info.vocab_size)
    if cfg.data.shards:
        from swarmtrain.data.shards import TokenShards

        shards = TokenShards.open(cfg.data.shards)
        shards.close()
        if shards.tokenizer_hash != tokenizer.info.hash:
            raise ConfigError(f"data.shards: {cfg.data.shards} was tokenized with another tokenizer (sha256 "
                              f"{shards.tokenizer_hash[:12]}) than data.tokenizer = {cfg.data.tokenizer!r} "
                              f"({tokenizer.info.hash[:12]})")
    return cfg.replace(model={"signature": list(signature), "fingerprint": fingerprint_of(signature)},
                       data={"tokenizer_hash": tokenizer.info.hash})


def _differences(run: tuple[str, ...], own: tuple[str, ...]) -> list[str]:
    theirs, mine = dict(s.split("=", 1) for s in run), dict(s.split("=", 1) for s in own)
    out = []
    for key in [*theirs, *(k for k in mine if k not in theirs)]:
        if theirs.get(key) != mine.get(key):
            out.append(f"{key} = {mine.get(key, '(none)')} here, {theirs.get(key, '(none)')} in the run")
    return out


def check_run(cfg: RunConfig) -> RunConfig:
    """The run's config resolved against this peer's files; RunMismatchError naming what differs from what
    the coordinator resolved (a run published without a fingerprint is only resolved)."""
    own = resolve_run(cfg.replace(model={"signature": [], "fingerprint": ""}, data={"tokenizer_hash": ""}))
    want_tok, got_tok = cfg.data.tokenizer_hash, own.data.tokenizer_hash
    if want_tok and want_tok != got_tok:
        where = "" if cfg.data.tokenizer == BYTES_TOKENIZER else f" ({cfg.data.tokenizer} on this peer)"
        raise RunMismatchError(f"data.tokenizer: this peer's tokenizer{where} has hash {got_tok[:16]}, the run's "
                               f"{want_tok[:16]}: every peer needs the same tokenizer file")
    if cfg.model.fingerprint and cfg.model.fingerprint != own.model.fingerprint:
        diff = _differences(cfg.model.signature, own.model.signature) or ["(the signatures agree: fingerprint "
                                                                          "computed otherwise)"]
        source = f" (model.hf_path = {cfg.model.hf_path})" if cfg.model.arch == "hf" else ""
        raise RunMismatchError(f"model: this peer's model differs from the run's{source}: {'; '.join(diff[:5])}")
    return own

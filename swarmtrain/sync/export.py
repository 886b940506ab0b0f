"""A trained θ as a Hugging Face directory: config.json, model.safetensors, generation_config.json, tokenizer.

`transformers.AutoModelForCausalLM.from_pretrained(out)` loads it and computes swarmtrain's logits: the
`llama` architecture's state_dict is LlamaForCausalLM's as it stands; the `gpt` is written as a
GPT2LMHeadModel (its Linear weights transposed into GPT-2's Conv1D layout, zero biases, exact GELU); `hf`
models save themselves. Writing needs no transformers for gpt and llama. The directory is written beside
`out` under a hidden name and renamed once complete, so an interrupted export never looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swarmtrain.config import ConfigError, RunConfig, from_dict
from swarmtrain.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from swarmtrain.diloco.flat import assign_flat
from swarmtrain.models.build import build_model
from swarmtrain.models.gpt import GPT
from swarmtrain.models.llama import INIT_STD, Llama
from swarmtrain.sync.checkpoint import LoadedCheckpoint, load_latest_checkpoint

__all__ = ["ExportError", "export_checkpoint", "export_model", "model_from_checkpoint"]


class ExportError(ValueError):
    """A checkpoint cannot be exported (none there, no run config in it, a θ of another size); names it."""


def model_from_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> tuple[nn.Module, RunConfig, LoadedCheckpoint]:
    """The newest good checkpoint of `checkpoint_dir` as a model holding its θ_global (eval mode)."""
    loaded = load_latest_checkpoint(checkpoint_dir)
    if loaded is None:
        raise ExportError(f"{checkpoint_dir}: no checkpoint (ckpt-*.json) in this directory")
    raw = loaded.meta.get("run_config")
    if not isinstance(raw, dict):
        raise ExportError(f"{loaded.path}: the checkpoint has no run config (written by a swarmtrain before "
                          "checkpoints carried one), so the model it holds cannot be rebuilt")
    try:
        cfg = from_dict(raw)
    except ConfigError as e:
        raise ExportError(f"{loaded.path}: the checkpoint's run config is not valid here: {e}") from e
    model = build_model(cfg.model, seed=cfg.train.seed)
    theta = loaded.tensors.get("theta_global")
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    if theta is None or theta.numel() != numel:
        raise ExportError(f"{loaded.path}: θ_global has {None if theta is None else theta.numel()} values, the model "
                          f"its run config describes has {numel}")
    with torch.no_grad():
        assign_flat(theta.to(torch.float32).reshape(-1), params)
    return model.eval(), cfg, loaded


def export_checkpoint(checkpoint_dir: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """`swarmtrain export`: the newest checkpoint of `checkpoint_dir` as a Hugging Face directory at `out`."""
    model, cfg, loaded = model_from_checkpoint(checkpoint_dir)
    worker = loaded.meta.get("worker") or {}
    return export_model(model, cfg, out, provenance={"checkpoint": str(loaded.path), "round": worker.get("round"),
                                                    "hash": loaded.meta.get("hash")})


def export_model(model: nn.Module, cfg: RunConfig, out: str | os.PathLike[str], *,
                 provenance: dict[str, Any] | None = None) -> Path:
    """Write `model` (of `cfg`) as a Hugging Face directory at `out`, which must not exist yet."""
    target = Path(out)
    if target.exists():
        raise ExportError(f"{target}: already exists (remove it, or export into another --out)")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.parent / f".{target.name}.partial-{os.getpid()}"
    partial.mkdir()
    try:
        _write_weights(model, cfg, partial, eos_id=tokenizer.info.eos_id)
        _write_json(partial / "generation_config.json", {"bos_token_id": tokenizer.info.eos_id,
                                                         "eos_token_id": tokenizer.info.eos_id,
                                                         "pad_token_id": tokenizer.info.eos_id})
        _write_tokenizer(tokenizer, partial, context_len=cfg.data.seq_len)
        _write_json(partial / "swarmtrain.json", {"provenance": provenance or {}, "tokenizer": tokenizer.info.to_json(),
                                                  "model": {"signature": list(cfg.model.signature),
                                                            "fingerprint": cfg.model.fingerprint}})
        os.rename(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return target


def _write_weights(model: nn.Module, cfg: RunConfig, out: Path, *, eos_id: int) -> None:
    from safetensors.torch import save_file

    if isinstance(model, Llama):
        state = {k: v for k, v in model.state_dict().items() if not (model.tie_embeddings and k == "lm_head.weight")}
        config = _llama_config(model, eos_id=eos_id)
    elif isinstance(model, GPT):
        state, config = _gpt2_state(model), _gpt2_config(model, eos_id=eos_id)
    else:
        from swarmtrain.models.hf import HFCausalLM

        assert isinstance(model, HFCausalLM), type(model)
        model.hf.save_pretrained(str(out))
        return
    save_file({k: v.detach().to(torch.float32).contiguous().clone() for k, v in state.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)


def _llama_config(model: Llama, *, eos_id: int) -> dict[str, Any]:
    s = model.shape
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": model.vocab_size,
            "hidden_size": s.n_embd, "intermediate_size": s.intermediate_size, "num_hidden_layers": s.n_layer,
            "num_attention_heads": s.n_head, "num_key_value_heads": s.n_kv_head, "head_dim": s.n_embd // s.n_head,
            "hidden_act": "silu", "max_position_embeddings": s.context_len, "rms_norm_eps": model.norm_eps,
            "rope_theta": model.rope_theta, "rope_parameters": {"rope_theta": model.rope_theta, "rope_type": "default"},
            "tie_word_embeddings": model.tie_embeddings, "attention_bias": False, "mlp_bias": False,
            "initializer_range": INIT_STD, "bos_token_id": eos_id, "eos_token_id": eos_id, "torch_dtype": "float32"}


def _gpt2_config(model: GPT, *, eos_id: int) -> dict[str, Any]:
    s = model.shape
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": model.vocab_size,
            "n_positions": s.context_len, "n_embd": s.n_embd, "n_layer": s.n_layer, "n_head": s.n_head,
            "n_inner": 4 * s.n_embd, "activation_function": "gelu", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
            "tie_word_embeddings": True, "bos_token_id": eos_id, "eos_token_id": eos_id, "torch_dtype": "float32"}


def _gpt2_state(model: GPT) -> dict[str, torch.Tensor]:
    """GPT's weights under GPT2LMHeadModel's names: Conv1D holds (in, out), nn.Linear (out, in)."""
    sd = model.state_dict()
    out = {"transformer.wte.weight": sd["tok_emb.weight"], "transformer.wpe.weight": sd["pos_emb.weight"],
           "transformer.ln_f.weight": sd["ln_f.weight"], "transformer.ln_f.bias": sd["ln_f.bias"]}
    for i in range(model.shape.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[f"{theirs}{b}.weight"], out[f"{theirs}{b}.bias"] = sd[f"{ours}{a}.weight"], sd[f"{ours}{a}.bias"]
        for a, b in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("mlp.0", "mlp.c_fc"),
                     ("mlp.2", "mlp.c_proj")):
            w = sd[f"{ours}{a}.weight"]
            out[f"{theirs}{b}.weight"] = w.t()
            out[f"{theirs}{b}.bias"] = torch.zeros(w.shape[0])
    return out


def _write_tokenizer(tokenizer: Tokenizer, out: Path, *, context_len: int) -> None:
    """The tokenizer file beside the model; a tokenizer.json also gets a tokenizer_config.json, which
    transformers' AutoTokenizer reads. The byte tokenizer has no file."""
    info = tokenizer.info
    if info.kind == "bytes":
        return
    src = Path(info.path)
    if isinstance(tokenizer, HFTokenizer):
        shutil.copyfile(src, out / "tokenizer.json")
        eos = tokenizer.eos_token()
        _write_json(out / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                                                    "bos_token": eos, "model_max_length": context_len,
                                                    "clean_up_tokenization_spaces": False})
    elif info.kind == "sentencepiece":
        shutil.copyfile(src, out / "tokenizer.model")
    else:
        shutil.copyfile(src, out / src.name)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")

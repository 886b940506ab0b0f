"""The `hf` architecture: any `transformers.AutoModelForCausalLM` from a local config.json (or a directory
with weights), behind the `forward(idx, targets) -> (logits, loss)` every swarmtrain model has."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from swarmtrain.config import ConfigError
from swarmtrain.extras import require

__all__ = ["HFCausalLM", "HFSource", "build_hf", "read_hf_source"]

# Fields of a config.json that say how it was written or run, not what the model is.
IGNORED_FIELDS = frozenset({"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache",
                            "architectures", "output_attentions", "output_hidden_states", "return_dict"})
WEIGHT_SUFFIXES = (".safetensors", ".bin")


@dataclass(frozen=True)
class HFSource:
    """What `model.hf_path` names: the config's fields, and the directory of weights to start from (if any)."""

    config_file: Path
    fields: dict[str, Any]
    weights_dir: Path | None

    def weight_files(self) -> list[Path]:
        if self.weights_dir is None:
            return []
        return sorted(p for p in self.weights_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def read_hf_source(path: str) -> HFSource:
    """Read `model.hf_path` (a config.json, or a directory with one); ConfigError naming the file otherwise."""
    p = Path(path)
    if p.is_dir():
        config_file = p / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"model.hf_path: {p} has no config.json")
    elif p.is_file():
        config_file = p
    else:
        raise ConfigError(f"model.hf_path: {p}: no such file or directory")
    try:
        fields = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"model.hf_path: {config_file}: not a readable JSON config ({e})") from e
    if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
        raise ConfigError(f"model.hf_path: {config_file}: a transformers config.json needs a \"model_type\"")
    source = HFSource(config_file=config_file, fields=fields, weights_dir=p if p.is_dir() else None)
    if source.weights_dir is not None and not source.weight_files():
        source = HFSource(config_file=config_file, fields=fields, weights_dir=None)
    return source


class HFCausalLM(nn.Module):
    """A transformers causal LM (`self.hf`) with swarmtrain's forward: logits of every position, and the mean
    cross-entropy against `targets` (already shifted, as the data gives them) in fp32."""

    def __init__(self, inner: Any) -> None:  # a transformers PreTrainedModel: an optional dependency, untyped
        super().__init__()
        self.hf = inner
        self.vocab_size = int(self.hf.config.vocab_size)
        self.context_len = int(getattr(self.hf.config, "max_position_embeddings", 0) or 0)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # idx (B, T) -> logits (B, T, V)
        if self.context_len and idx.shape[1] > self.context_len:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds the model's max_position_embeddings "
                             f"{self.context_len}")
        logits = self.hf(input_ids=idx, use_cache=False).logits
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build_hf(path: str, *, seed: int | None) -> HFCausalLM:
    """The model of `model.hf_path`: from its weights when the directory has them, else a seeded init
    (transformers' scheme: N(0, initializer_range) matrices, unit norms, zero biases) that does not depend on
    torch's global RNG, so every peer builds the same θ."""
    transformers = require("transformers", purpose="model.arch = 'hf'")
    source = read_hf_source(path)
    fields = {k: v for k, v in source.fields.items() if k not in ("transformers_version", "_name_or_path")}
    try:
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"model.hf_path: {source.config_file}: transformers cannot build this config ({e})") from e
    if source.weights_dir is not None:
        inner = transformers.AutoModelForCausalLM.from_pretrained(str(source.weights_dir), config=config,
                                                                  local_files_only=True, dtype=torch.float32)
        return HFCausalLM(inner)
    with torch.random.fork_rng(devices=[]):  # transformers' own init draws from the global RNG
        inner = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if seed is not None:
        _seeded_init(inner, seed=seed, std=float(getattr(config, "initializer_range", 0.02)))
    return HFCausalLM(inner)


@torch.no_grad()
def _seeded_init(model: nn.Module, *, seed: int, std: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.zero_()
        elif p.dim() == 1:  # norms' scales
            p.fill_(1.0)
        else:
            nn.init.normal_(p, mean=0.0, std=std, generator=generator)

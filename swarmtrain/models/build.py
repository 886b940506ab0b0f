"""`build_model(cfg)`: the network `model.arch` names, with a seeded init every peer reproduces."""

from __future__ import annotations

from torch import nn

from swarmtrain.config import ModelConfig
from swarmtrain.models.gpt import GPT, build_gpt, load_init_weights

__all__ = ["build_model", "count_params"]


def build_model(cfg: ModelConfig, *, seed: int | None = None, activation_checkpointing: bool = False) -> nn.Module:
    """Build `cfg.arch`'s model; with `seed` its initial weights are reproducible (and independent of torch's
    global RNG). Every model's `forward(idx, targets)` returns (logits, loss)."""
    if cfg.arch == "gpt":
        model: nn.Module = build_gpt(cfg, seed=seed)
    elif cfg.arch == "llama":
        model = _build_llama(cfg, seed=seed)
    else:
        from swarmtrain.models.hf import build_hf

        model = build_hf(cfg.hf_path, seed=seed)
    if activation_checkpointing:
        _enable_checkpointing(model)
    return model


def _build_llama(cfg: ModelConfig, *, seed: int | None) -> nn.Module:
    import torch

    from swarmtrain.models.llama import Llama, llama_shape

    def make() -> Llama:
        return Llama(llama_shape(cfg), vocab_size=cfg.vocab_size, rope_theta=cfg.rope_theta,
                     norm_eps=cfg.norm_eps, tie_embeddings=cfg.tie_embeddings)

    if seed is None:
        model = make()
        model.seeded_init(None)  # torch's global RNG
    else:
        with torch.device("meta"):  # no storage, no RNG draws
            model = make()
        model.to_empty(device="cpu")
        model.retie()
        model.seeded_init(torch.Generator().manual_seed(seed))
    if cfg.init_from:
        load_init_weights(model, cfg.init_from)
    return model


def _enable_checkpointing(model: nn.Module) -> None:
    from swarmtrain.models.hf import HFCausalLM
    from swarmtrain.models.llama import Llama

    if isinstance(model, HFCausalLM):
        model.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        assert isinstance(model, GPT | Llama), type(model)
        model.activation_checkpointing = True


def count_params(cfg: ModelConfig) -> int:
    """Parameters of `cfg`'s model (a tied head counted once), built on the meta device: nothing allocated."""
    import torch

    if cfg.arch == "hf":
        from swarmtrain.extras import require
        from swarmtrain.models.hf import read_hf_source

        transformers = require("transformers", purpose="model.arch = 'hf'")
        fields = dict(read_hf_source(cfg.hf_path).fields)
        fields = {k: v for k, v in fields.items() if k not in ("transformers_version", "_name_or_path")}
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        with torch.device("meta"):
            model: nn.Module = transformers.AutoModelForCausalLM.from_config(config)
    elif cfg.arch == "llama":
        from swarmtrain.models.llama import Llama, llama_shape

        with torch.device("meta"):
            model = Llama(llama_shape(cfg), vocab_size=cfg.vocab_size, tie_embeddings=cfg.tie_embeddings)
    else:
        from swarmtrain.models.gpt import GPT, resolve_shape

        with torch.device("meta"):
            model = GPT(resolve_shape(cfg), vocab_size=cfg.vocab_size)
    return sum(p.numel() for p in model.parameters())

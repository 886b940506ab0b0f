"""`build_model(cfg)`: the network `model.arch` names, with a seeded init every peer reproduces."""

from __future__ import annotations

from torch import nn

from swarmtrain.config import ModelConfig
from swarmtrain.models.gpt import build_gpt, load_init_weights

__all__ = ["build_model"]


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

    kwargs = dict(vocab_size=cfg.vocab_size, rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps,
                  tie_embeddings=cfg.tie_embeddings)
    shape = llama_shape(cfg)
    if seed is None:
        model = Llama(shape, **kwargs)
        model.seeded_init(None)  # torch's global RNG
    else:
        with torch.device("meta"):  # no storage, no RNG draws
            model = Llama(shape, **kwargs)
        model.to_empty(device="cpu")
        model.retie()
        model.seeded_init(torch.Generator().manual_seed(seed))
    if cfg.init_from:
        load_init_weights(model, cfg.init_from)
    return model


def _enable_checkpointing(model: nn.Module) -> None:
    from swarmtrain.models.hf import HFCausalLM

    if isinstance(model, HFCausalLM):
        model.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.activation_checkpointing = True

"""The inner optimizer: AdamW or SGD, linear warmup then cosine decay, and its checkpointable state."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from swarmtrain.config import InnerConfig

__all__ = ["build_inner_optimizer", "load_optimizer_state", "lr_factor", "optimizer_state", "set_lr"]


def build_inner_optimizer(model: nn.Module, cfg: InnerConfig) -> torch.optim.Optimizer:
    """AdamW (decoupled decay on matrices only, as in GPT-2) or SGD over `model`'s parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if cfg.optimizer == "adamw":
        # foreach=False: the single-tensor path gives the same bits on every run and machine build.
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=False)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=False)


def lr_factor(step: int, *, cfg: InnerConfig, total_steps: int) -> float:
    """Multiplier of `cfg.lr` at inner step `step` (0-based): linear warmup, then cosine to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def optimizer_state(optimizer: torch.optim.Optimizer, *, prefix: str,
                    copy: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split `optimizer.state_dict()` into tensors (`{prefix}{param}.{name}`) and JSON-able metadata
    (without `copy`, CPU tensors are the optimizer's own)."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in sd["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                t = value.detach().cpu().contiguous()
                tensors[f"{prefix}{index}.{name}"] = t.clone() if copy and t.data_ptr() == value.data_ptr() else t
            else:
                scalars.setdefault(str(index), {})[name] = value
    meta = {"param_groups": sd["param_groups"], "scalars": scalars, "tensor_keys": sorted(tensors)}
    return tensors, meta


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any], *, prefix: str
) -> None:
    """Inverse of `optimizer_state`; raises ValueError if tensors named in `meta` are missing."""
    missing = [k for k in meta["tensor_keys"] if k not in tensors]
    if missing:
        raise ValueError(f"inner optimizer state is missing tensors {missing[:3]}")
    state: dict[int, dict[str, Any]] = {}
    for key in meta["tensor_keys"]:
        index, name = key[len(prefix) :].split(".", 1)
        state.setdefault(int(index), {})[name] = tensors[key]
    for index, entry in meta["scalars"].items():
        state.setdefault(int(index), {}).update(entry)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})

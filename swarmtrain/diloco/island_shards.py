"""An island's model sharded with FSDP2 (`train.parallel = "fsdp"`): each rank keeps 1/N of the weights, their
gradients and the inner optimizer's moments (`torch.distributed.fsdp.fully_shard`, one unit per transformer
block and one for the rest), and the whole island moves them between the sharded and the full form.

Shards follow `torch.chunk` along the first dimension (what FSDP2 does): rank r of N holds chunk r of every
parameter (possibly empty). Every function here is a collective where it says so: every rank calls it, in
the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

__all__ = ["full_optimizer_state", "gather_full", "load_sharded_optimizer_state", "local_chunk", "scatter_full",
           "shard_model"]


def shard_model(model: nn.Module) -> nn.Module:
    """`model` sharded in place: each block of its block lists a unit of its own, the root the rest."""
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                fully_shard(block)
    fully_shard(model)
    return model


def local_chunk(full: torch.Tensor, *, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s chunk of `full` along dimension 0 (empty where the dimension has fewer rows than ranks)."""
    chunks = torch.chunk(full, world_size, dim=0)
    return chunks[rank] if rank < len(chunks) else full[0:0]


@torch.no_grad()
def gather_full(sharded: Sequence[torch.Tensor], into: Sequence[torch.Tensor] | None) -> None:
    """Collective: every sharded parameter whole, copied into `into` (the same order and shapes) where given."""
    for i, p in enumerate(sharded):
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if into is not None:
            into[i].copy_(full)


@torch.no_grad()
def scatter_full(flat: torch.Tensor, sharded: Sequence[torch.Tensor], *, rank: int, world_size: int) -> None:
    """Local: each sharded parameter takes its chunk of the flat fp32 vector `flat` (the whole θ, every rank's)."""
    at = 0
    for p in sharded:
        n = p.numel()
        full = flat[at:at + n].view(p.shape)
        at += n
        if isinstance(p, DTensor):
            local = p.to_local()
            local.copy_(local_chunk(full, rank=rank, world_size=world_size).to(local.device, local.dtype))
        else:
            p.copy_(full)
    if at != flat.numel():
        raise ValueError(f"a flat θ of {flat.numel()} values for sharded parameters of {at}")


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: the optimizer's `state_dict()` with every sharded state tensor whole (on the CPU): the state
    a single process training the whole model holds."""
    sd = optimizer.state_dict()
    state = {}
    for index, entry in sd["state"].items():
        state[index] = {k: (v.full_tensor().cpu() if isinstance(v, DTensor) else v) for k, v in entry.items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def load_sharded_optimizer_state(optimizer: torch.optim.Optimizer, full: dict[str, Any], *, rank: int,
                                 world_size: int) -> None:
    """Local: load a whole-model optimizer state (`full_optimizer_state`'s, or a single process's) into
    `optimizer` over sharded parameters: each moment as this rank's chunk. A state's index is its parameter's
    place in the optimizer's groups, in order (as `state_dict()` numbers them)."""
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entry in full["state"].items():
        p = ordered[int(index)]
        out = {}
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) and isinstance(p, DTensor) and v.shape == p.shape:
                local = local_chunk(v, rank=rank, world_size=world_size).to(p.to_local().device).contiguous()
                out[k] = DTensor.from_local(local, device_mesh=p.device_mesh, placements=p.placements,
                                            run_check=False, shape=p.shape, stride=p.stride())
            else:
                out[k] = v
        state[int(index)] = out
    optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})

"""A DiLoCo worker's resumable state: everything a checkpoint holds to resume it exactly (`DilocoWorker.state_dict`,
`load_state_dict`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from swarmtrain.diloco.eager import EagerScale
from swarmtrain.diloco.flat import flatten
from swarmtrain.diloco.inner import load_optimizer_state, optimizer_state
from swarmtrain.round.ballots import BallotError, voters_from_json, voters_to_json

if TYPE_CHECKING:
    from swarmtrain.diloco.worker import DilocoWorker

__all__ = ["STATE_FORMAT", "load_worker_state", "save_worker_state"]

STATE_FORMAT = 1


def save_worker_state(worker: DilocoWorker, *, copy: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Everything needed to resume exactly: (tensors for safetensors, JSON-able metadata).

    Without `copy` the tensors are the worker's own (θ_global, momenta, residual): for a caller
    that writes them out before the worker steps again, saving up to five copies of the model.

    The RNG carried is this worker's CPU generator state (dropout on CPU); dropout on CUDA draws
    from the device generator, which is not captured, so a CUDA run with dropout > 0 resumes
    statistically, not bit for bit.
    """

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if copy else t

    tensors: dict[str, torch.Tensor] = {
        "theta_global": own(worker.theta_global.detach()) if worker.theta_global.device.type == "cpu"
        else worker.theta_global.detach().cpu(),
        "rng.cpu": worker._rng_state.clone(),
    }
    if copy or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in worker.params):
        tensors["theta_local"] = flatten(worker.params)
    else:  # each parameter as it is: no model-sized concatenation at every checkpoint
        tensors.update({f"theta_local.{i}": p.detach().reshape(-1) for i, p in enumerate(worker.params)})
    tensors.update({f"outer.{k}": own(v) for k, v in worker.outer.state_tensors().items()})
    if worker.residual is not None:
        tensors["ef.residual"] = own(worker.residual)
    inner_tensors, inner_meta = optimizer_state(worker.inner, prefix="inner.", copy=copy)
    tensors.update(inner_tensors)
    data_state = worker.batches.state_dict() if hasattr(worker.batches, "state_dict") else None
    meta: dict[str, Any] = {
        "format": STATE_FORMAT, "round": worker.round, "inner_step": worker.inner_step,
        "round_step": worker.round_step, "numel": worker.numel,
        "inner_optimizer": inner_meta, "data": data_state, "voters": voters_to_json(worker.voters),
        "eager": worker._eager.state(), "grad_scaler": worker.precision.state(),
    }
    return tensors, meta


def load_worker_state(worker: DilocoWorker, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Restore a `state_dict()`; raises ValueError naming what does not fit this worker."""
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"worker state has format {meta.get('format')!r}, this code reads {STATE_FORMAT}")
    if meta["numel"] != worker.numel:
        raise ValueError(f"worker state is for {meta['numel']} parameters, this model has {worker.numel}")
    for key in ("theta_global", "rng.cpu"):
        if key not in tensors:
            raise ValueError(f"worker state is missing tensor {key!r}")
    if worker.residual is not None:
        if "ef.residual" not in tensors:
            raise ValueError("worker state has no error-feedback residual but compress.error_feedback is on")
        if tensors["ef.residual"].shape != (worker.numel,):
            raise ValueError(f"worker state's error-feedback residual has shape {tuple(tensors['ef.residual'].shape)}, "
                             f"need ({worker.numel},)")
    eager = EagerScale()  # a checkpoint written before the eager estimate was fitted: fitted again from here
    if "eager" in meta:
        eager.load_state(meta["eager"])  # checked before anything of this worker changes
    local = tensors.get("theta_local")
    if local is None:  # one tensor per parameter (`state_dict(copy=False)`)
        missing = [f"theta_local.{i}" for i in range(len(worker.params)) if f"theta_local.{i}" not in tensors]
        if missing:
            raise ValueError(f"worker state is missing tensor 'theta_local' (or {missing[0]!r})")
        local = torch.cat([tensors[f"theta_local.{i}"].reshape(-1) for i in range(len(worker.params))])
    worker.theta_global.copy_(tensors["theta_global"])
    worker._theta_version += 1
    worker._set_local(local)
    worker.outer.load_state_tensors({k[len("outer."):]: v for k, v in tensors.items() if k.startswith("outer.")})
    if worker.residual is not None:
        worker.residual = tensors["ef.residual"].detach().to(device=worker.round_device, dtype=torch.float32,
                                                            copy=True)
    load_optimizer_state(worker.inner, tensors, meta["inner_optimizer"], prefix="inner.")
    if meta["data"] is not None:
        if not hasattr(worker.batches, "load_state_dict"):
            raise ValueError("worker state has a data position but this batch stream cannot be resumed")
        worker.batches.load_state_dict(meta["data"])
    worker._rng_state = tensors["rng.cpu"].clone()
    worker.precision.load_state(meta.get("grad_scaler"))
    worker.round = int(meta["round"])
    # Written before commits named their voters: none, so the next round asks the scope's genesis.
    try:
        worker.voters = voters_from_json(meta.get("voters", []), what="worker state voters")
    except BallotError as e:
        raise ValueError(str(e)) from None
    worker.inner_step = int(meta["inner_step"])
    # A checkpoint written before the schedule followed the round resumes at the round's first position.
    worker.round_step = int(meta.get("round_step", 0))
    worker._pending_residual = None
    worker._eager = eager

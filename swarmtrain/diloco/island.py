"""A local island: one peer trains on several ranks (local GPUs or CPU processes, or the nodes of one
datacenter under torchrun's rendezvous) with DDP; only rank 0 talks to the swarm.

Rank 0 runs the whole peer: an `IslandWorker` (island_steps.py) holds θ_global, the outer momentum, the
codec, the round, its votes and checkpoints, like any peer's worker. The other ranks run an
`IslandFollower`: the same model under `DistributedDataParallel`, the same inner optimizer, and their own
slice of the peer's batches; they do what rank 0 tells them, one command at a time over the island's
process group (gloo on CPU, NCCL on GPU):

* `step` (with the step's learning rate): one inner step, whose gradients DDP averages over the ranks;
* `sync`: rank 0's θ_local (after an outer step, a heal, a resync, an overlapped landing), its data position
  and, when it changed outside a step (a resume, a reset), the inner optimizer's state;
* `ping`: rank 0 is alive but not training (matchmaking, an all-reduce, a heal);
* `stop`: the peer left; the followers exit.

So θ_local is identical on every rank at every step, by construction, and the island is one peer to the
swarm: one record, one vote, one data slot, one checkpoint. A rank that dies breaks the next collective
on every other rank at once (its sockets close): rank 0 leaves as a peer does on an error, the followers
exit. A rank that hangs is given up on after the island's timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["Island", "IslandError", "IslandLost", "island_env", "open_store"]

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 30.0  # gloo lets go of a finished collective's tensors within microseconds to milliseconds


class IslandError(ValueError):
    """The island is misconfigured (its rank, size or backend)."""


class IslandLost(RuntimeError):
    """A collective of the island failed: another rank died, or hung past the island's timeout."""


def island_env() -> tuple[int, int] | None:
    """(rank, world size) when this process is one rank of an island of several (torchrun's RANK and
    WORLD_SIZE, or what `swarmtrain peer --nproc-per-node` sets), else None."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError as e:
        raise IslandError(f"RANK and WORLD_SIZE must be integers: {e}") from None
    if world <= 1:
        return None
    if not 0 <= rank < world:
        raise IslandError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
    return rank, world


def open_store(*, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The island's rendezvous: rank 0 listens (port 0 = any free port, read back `.port`), others dial it."""
    return dist.TCPStore(host, port, world_size, rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


@dataclass
class Island:
    """This process's place in the island: its rank, the island's size, backend and device."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    timeout_s: float = 300.0

    @classmethod
    def start(cls, *, rank: int, world_size: int, store: dist.Store | None = None, backend: str = "auto",
              timeout_s: float = 300.0) -> Island:
        """Join the island's process group (blocks until all ranks joined or `timeout_s` passed); every
        collective after it fails after `timeout_s` without an answer.

        Without `store` the rendezvous comes from the environment (MASTER_ADDR, MASTER_PORT: torchrun's).
        `backend="auto"` is NCCL when CUDA is available, else gloo; on GPU a rank uses `cuda:LOCAL_RANK`.
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise IslandError(f"island rank {rank} is not in [0, world_size={world_size})")
        if dist.is_initialized():
            raise IslandError("a torch.distributed process group is already initialised in this process")
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in ("gloo", "nccl"):
            raise IslandError(f"island backend {backend!r} is not 'gloo' or 'nccl'")
        if backend == "nccl":
            if not torch.cuda.is_available():
                raise IslandError("island backend 'nccl' needs CUDA, which is not available")
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if store is None:
                dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                        timeout=timeout)
            else:
                dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        except (RuntimeError, ValueError) as e:
            raise IslandLost(f"island rank {rank} of {world_size} could not join the island's process group "
                             f"within {timeout_s:.0f}s: {e}") from e
        log.info("island rank %d/%d up (%s on %s)", rank, world_size, backend, device)
        return cls(rank=rank, world_size=world_size, backend=backend, device=device, timeout_s=timeout_s)

    @classmethod
    def from_env(cls, *, backend: str = "auto", timeout_s: float = 300.0) -> Island:
        """Join as torchrun (or `swarmtrain peer --nproc-per-node`) describes this process."""
        found = island_env()
        if found is None:
            raise IslandError("WORLD_SIZE is not set above 1 (start the island with torchrun or --nproc-per-node)")
        rank, world = found
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise IslandError(f"environment variable {name} is not set (start the island with torchrun or "
                                  "--nproc-per-node)")
        return cls.start(rank=rank, world_size=world, backend=backend, timeout_s=timeout_s)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> Island:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_leader(self) -> bool:
        """Rank 0: the only rank that talks to the swarm and writes checkpoints."""
        return self.rank == 0

    def wrap(self, model: nn.Module) -> DistributedDataParallel:
        """DDP around `model` (already on `self.device`): a collective, its constructor copies rank 0's weights
        to every rank."""
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        with self.collective("wrapping the model in DDP"):
            return DistributedDataParallel(model, device_ids=device_ids)

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Around any collective: a failure (a rank gone, a timeout) becomes `IslandLost`, naming `what`."""
        try:
            yield
        except RuntimeError as e:  # dist.DistBackendError is one
            if isinstance(e, IslandLost):
                raise
            raise IslandLost(f"island rank {self.rank} of {self.world_size}: {what} failed (another rank died, "
                             f"or did not answer within {self.timeout_s:.0f}s): {e}") from e

    # ------------------------------------------------------------------ collectives from rank 0

    def broadcast_(self, tensor: torch.Tensor) -> None:
        """Overwrite `tensor` (any device) with rank 0's values, staging through the backend's device."""
        staged = tensor if tensor.device == self._comm_device() else tensor.to(self._comm_device())
        with self.collective("a broadcast"), self._released(staged):
            dist.broadcast(staged, src=0)
        if staged is not tensor:
            tensor.copy_(staged)

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (pickled: the ranks of one island are one job and trust each other)."""
        payload = pickle.dumps(obj) if self.is_leader else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        self.broadcast_(size)
        data = _byte_tensor(payload) if self.is_leader else torch.empty(int(size.item()), dtype=torch.uint8)
        self.broadcast_(data)
        return obj if self.is_leader else pickle.loads(data.numpy().tobytes())

    @contextlib.contextmanager
    def _released(self, *tensors: torch.Tensor) -> Iterator[None]:
        """Around a collective on `tensors`: afterwards, wait until gloo's worker threads let go of them.

        gloo completes a collective before its worker thread drops the work that holds the tensors.
        Were that drop the last reference to a tensor Python had already released, it would take the
        GIL, and a process finalizing by then aborts ("terminate called without an active exception"):
        an island's last collective right before exit did so. Waited for here, the drop is a plain
        refcount decrement, and no gloo thread touches Python objects once the collective returned.
        """
        counts = [t._use_count() for t in tensors]  # type: ignore[attr-defined]  # private, not in torch's stubs
        yield
        if self.backend != "gloo":
            return
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        while any(t._use_count() > n for t, n in zip(tensors, counts, strict=True)):  # type: ignore[attr-defined]
            if time.monotonic() > deadline:
                raise IslandLost(f"gloo still holds an island collective's tensors after {RELEASE_TIMEOUT_S:.0f}s")
            time.sleep(0.0002)

    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")


def _byte_tensor(payload: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).clone()  # owns its memory, not the bytearray's

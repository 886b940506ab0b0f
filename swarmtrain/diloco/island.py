"""A local island: one peer trains on several local ranks with DDP; only local rank 0 talks to the swarm.

Every local rank runs a `DilocoWorker` whose inner steps go through `DistributedDataParallel`
(gloo on CPU, NCCL on GPU), so the ranks' θ_local stay identical while each reads its own slice of
the data (worker index = peer_index × local_world + local_rank). At a round boundary:

1. `IslandAverager.average` — rank 0 asks the swarm's `Averager` for the mean Δ, then broadcasts
   the outcome (round, committed, mean, byte counts) so every rank's `apply` takes the same branch;
2. `Island.sync_global` (the worker's `after_round` hook) — rank 0 broadcasts θ_global, the outer
   momentum and the round; the other ranks install them, so the island is bit-identical by
   construction rather than by floating-point luck (a rank that had drifted is logged).

Checkpoints are written by rank 0 only: `island_state_dict` gathers each rank's data position and
RNG state into one (tensors, meta); `load_island_state` gives every rank its own part back.
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

from swarmtrain.averaging.protocol import Averager, AverageResult
from swarmtrain.config import RunConfig
from swarmtrain.data.sharding import ShardedBatches
from swarmtrain.diloco.worker import DilocoWorker

__all__ = ["Island", "IslandAverager", "IslandError", "build_island_worker", "island_state_dict",
           "load_island_state", "open_store"]

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 30.0  # gloo lets go of a finished collective's tensors within microseconds to milliseconds


class IslandError(ValueError):
    """The island is misconfigured or its ranks disagree (round, world size, roles)."""


def open_store(*, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The island's rendezvous: rank 0 listens (port 0 = any free port, read back `.port`), others dial it."""
    return dist.TCPStore(host, port, world_size, rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


@dataclass
class Island:
    """This process's place in the island: its local rank, the island's size, backend and device."""

    rank: int
    world_size: int
    backend: str
    device: torch.device

    @classmethod
    def start(cls, *, rank: int, world_size: int, store: dist.Store | None = None, backend: str = "auto",
              timeout_s: float = 300.0) -> Island:
        """Join the island's process group (blocks until all ranks joined or `timeout_s` passed).

        Without `store` the rendezvous comes from torchrun's env (MASTER_ADDR, MASTER_PORT).
        `backend="auto"` is NCCL when CUDA is available, else gloo; on GPU rank r uses `cuda:LOCAL_RANK`.
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise IslandError(f"local rank {rank} is not in [0, world_size={world_size})")
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
        if store is None:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        log.info("island rank %d/%d up (%s on %s)", rank, world_size, backend, device)
        return cls(rank=rank, world_size=world_size, backend=backend, device=device)

    @classmethod
    def from_env(cls, *, backend: str = "auto", timeout_s: float = 300.0) -> Island:
        """Join as torchrun describes this process (LOCAL_RANK, LOCAL_WORLD_SIZE; MASTER_ADDR/PORT)."""
        try:
            rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        except KeyError as e:
            raise IslandError(f"environment variable {e.args[0]} is not set (start the island with torchrun)") from e
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world))
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
        """Local rank 0: the only rank that talks to the swarm and writes checkpoints."""
        return self.rank == 0

    def worker_slot(self, *, peer_index: int, num_peers: int) -> tuple[int, int]:
        """(worker_index, num_workers) for `ShardedBatches`: every local rank of every peer gets its own slice."""
        if not 0 <= peer_index < num_peers:
            raise IslandError(f"peer_index {peer_index} is not in [0, num_peers={num_peers})")
        return peer_index * self.world_size + self.rank, num_peers * self.world_size

    def wrap(self, model: nn.Module) -> DistributedDataParallel:
        """DDP around `model` (already on `self.device`); its constructor copies rank 0's weights to all ranks."""
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    # ------------------------------------------------------------------ collectives from rank 0

    def broadcast_(self, tensor: torch.Tensor) -> None:
        """Overwrite `tensor` (any device) with rank 0's values, staging through the backend's device."""
        staged = tensor if tensor.device == self._comm_device() else tensor.to(self._comm_device())
        with self._released(staged):
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

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj` on every rank, in rank order (pickled, like `broadcast_object`)."""
        payload = pickle.dumps(obj)
        sizes = [int(s.item()) for s in self._all_gather(torch.tensor([len(payload)], dtype=torch.int64))]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: len(payload)] = _byte_tensor(payload)
        parts = self._all_gather(padded)
        return [pickle.loads(part[:size].numpy().tobytes()) for part, size in zip(parts, sizes, strict=True)]

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        local = tensor.to(self._comm_device())
        out = [torch.empty_like(local) for _ in range(self.world_size)]
        with self._released(local, *out):
            dist.all_gather(out, local)
        return [t.cpu() for t in out]

    @contextlib.contextmanager
    def _released(self, *tensors: torch.Tensor) -> Iterator[None]:
        """Around a collective on `tensors`: afterwards, wait until gloo's worker threads let go of them.

        gloo completes a collective before its worker thread drops the work that holds the tensors.
        Were that drop the last reference to a tensor Python had already released, it would take the
        GIL, and a process finalizing by then aborts ("terminate called without an active exception"):
        an island's last collective right before exit did so. Waited for here, the drop is a plain
        refcount decrement, and no gloo thread touches Python objects once the collective returned.
        """
        counts = [t._use_count() for t in tensors]
        yield
        if self.backend != "gloo":
            return
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        while any(t._use_count() > n for t, n in zip(tensors, counts, strict=True)):
            if time.monotonic() > deadline:
                raise IslandError(f"gloo still holds an island collective's tensors after {RELEASE_TIMEOUT_S:.0f}s")
            time.sleep(0.0002)

    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def sync_global(self, worker: DilocoWorker) -> None:
        """The worker's `after_round` hook: every rank takes rank 0's θ_global, outer momentum and round."""
        header = self.broadcast_object({"round": worker.round, "has_momentum": worker.outer.momentum_buffer is not None})
        theta = worker.theta_global.detach().clone()
        self.broadcast_(theta)
        momentum = None
        if header["has_momentum"]:
            assert worker.outer.momentum_buffer is not None, "local ranks disagree on outer.momentum"
            momentum = worker.outer.momentum_buffer.clone()
            self.broadcast_(momentum)
        if self.is_leader:
            return
        if header["round"] != worker.round or not torch.equal(theta, worker.theta_global):
            log.warning("island rank %d had drifted from rank 0 (round %d vs %d); adopting rank 0's θ_global",
                        self.rank, worker.round, header["round"])
        worker.adopt_global(round_index=header["round"], theta_global=theta, outer_momentum=momentum)


class IslandAverager:
    """The `Averager` every local rank calls: rank 0 averages with the swarm, the others receive its result."""

    def __init__(self, island: Island, averager: Averager | None) -> None:
        if island.is_leader and averager is None:
            raise IslandError("local rank 0 needs the swarm's Averager")
        if not island.is_leader and averager is not None:
            raise IslandError(f"local rank {island.rank} must not talk to the swarm (pass averager=None)")
        self.island = island
        self.averager = averager

    def average(self, round_index: int, delta: torch.Tensor) -> AverageResult:
        result = self.averager.average(round_index, delta) if self.averager is not None else None
        header = self.island.broadcast_object(None if result is None else {
            "round": result.round, "committed": result.committed, "has_mean": result.mean is not None,
            "members": result.members, "bytes_sent": result.bytes_sent, "bytes_received": result.bytes_received,
            "reason": result.reason, "failed": result.failed, "asked_round": round_index,
        })
        if header["asked_round"] != round_index:
            raise IslandError(f"local rank {self.island.rank} is at round {round_index}, rank 0 at {header['asked_round']}")
        mean = result.mean_tensor() if result is not None else None
        if header["has_mean"]:
            buf = mean.reshape(-1).to(torch.float32).clone() if mean is not None else torch.empty(delta.numel())
            self.island.broadcast_(buf)
            mean = buf
        if result is not None:
            return result
        return AverageResult(round=header["round"], committed=header["committed"], mean=mean,
                             members=tuple(header["members"]), bytes_sent=0, bytes_received=0,
                             reason=header["reason"], failed=tuple(header["failed"]))


def _byte_tensor(payload: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).clone()  # owns its memory, not the bytearray's


def build_island_worker(cfg: RunConfig, island: Island, *, model: nn.Module, train_tokens: torch.Tensor,
                        peer_index: int = 0, num_peers: int = 1) -> DilocoWorker:
    """A DilocoWorker for this local rank: its data slice, DDP inner steps, θ_global synced after rounds."""
    if cfg.diloco.overlap:
        # sync_global re-installs θ_global on every rank after a round: it would drop the progress an
        # overlapped round keeps. Overlap on an island needs that progress broadcast too; not built.
        raise IslandError("diloco.overlap is not supported on a multi-GPU island yet; set diloco.overlap=false")
    if cfg.diloco.pace != "steps":
        # Every rank's DDP step is one collective: a rank that stopped on its own clock would hang the others.
        raise IslandError(f"diloco.pace={cfg.diloco.pace!r} is not supported on a multi-GPU island yet; "
                          "set diloco.pace=steps")
    worker_index, num_workers = island.worker_slot(peer_index=peer_index, num_peers=num_peers)
    batches = ShardedBatches(train_tokens, worker_index=worker_index, num_workers=num_workers,
                             batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len, seed=cfg.train.seed)
    model = model.to(island.device)
    ddp = island.wrap(model)  # before the worker snapshots θ_global: rank 0's init reaches every rank
    return DilocoWorker(cfg, model=model, batches=batches, device=island.device, forward_module=ddp,
                        after_round=island.sync_global, rng_seed=cfg.train.seed * 1000 + worker_index)


def island_state_dict(island: Island, worker: DilocoWorker) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Collective: rank 0's worker state plus every rank's data position and RNG state (save on rank 0)."""
    tensors, meta = worker.state_dict()
    parts = island.gather_objects({"data": meta["data"], "rng": tensors["rng.cpu"]})
    for r, part in enumerate(parts):
        tensors[f"island.rng.{r}"] = part["rng"]
    meta["island"] = {"world_size": island.world_size, "data": [p["data"] for p in parts]}
    return tensors, meta


def load_island_state(island: Island, worker: DilocoWorker, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Restore an `island_state_dict` on every rank, each taking its own data position and RNG state."""
    saved = meta.get("island")
    if saved is None:
        raise IslandError("checkpoint was not written by an island (no 'island' metadata)")
    if saved["world_size"] != island.world_size:
        raise IslandError(f"checkpoint is for an island of {saved['world_size']} local ranks, this one has "
                          f"{island.world_size} (the data slices would not line up)")
    own = {**tensors, "rng.cpu": tensors[f"island.rng.{island.rank}"]}
    worker.load_state_dict(own, {**meta, "data": saved["data"][island.rank]})

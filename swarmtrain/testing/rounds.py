"""Rounds without training: a round's arithmetic on given θ_local moves, on any device (the round-device tests).

`replay_rounds` builds one DilocoWorker per `Seat` (its training device and `train.round_device`), each with
its codec on its round's device, and plays rounds in which every worker's θ_local is θ_global plus a seeded
move (the same on every device: drawn on the CPU), so no inner step's nondeterminism enters. Each round goes
through the code a networked round runs: Δ read from θ_global and θ_local (with error feedback and fragments
where the config says), `encode_from` on the worker's device, a reducer's `aggregate_encoded` and encode on
its own device, the mean held as a `ShardedMean` of several shards decoded piece by piece on each worker's
device, the preview of the commit's digest, and the outer step. What comes back is each worker's digest and
θ_global's hash per round: a swarm that mixes GPU and CPU rounds must agree on them bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from swarmtrain.averaging.aggregate import Aggregation, aggregate_encoded
from swarmtrain.averaging.material import Material, layout_of, sharded_mean
from swarmtrain.averaging.reducer import shard_bounds
from swarmtrain.compress import codec_from_config
from swarmtrain.compress.codec import Codec
from swarmtrain.config import RunConfig
from swarmtrain.diloco.averager import AverageResult, ShardedMean, reader
from swarmtrain.diloco.flat import assign_flat
from swarmtrain.diloco.worker import DilocoWorker
from swarmtrain.models import build_model

__all__ = ["RoundTrace", "Seat", "replay_rounds"]


@dataclass(frozen=True)
class Seat:
    """One worker of a replay: where it trains and where its round runs (`train.round_device`)."""

    train_device: str = "cpu"
    round_device: str = "train"


@dataclass(frozen=True)
class RoundTrace:
    """One worker after one round: its state digest, the preview's digest of that commit, θ_global's hash, and
    the devices its state was found on."""

    digest: str
    preview: str
    hash: str
    theta_device: torch.device
    momentum_device: torch.device | None
    residual_device: torch.device | None


def _no_batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    raise AssertionError("a replayed round trains no inner step")
    yield  # pragma: no cover


def _worker(cfg: RunConfig, seat: Seat, seed: int) -> DilocoWorker:
    seat_cfg = cfg.replace(train={"device": seat.train_device, "round_device": seat.round_device})
    probe = torch.device(seat.train_device) if seat.round_device == "train" else torch.device("cpu")
    codec = codec_from_config(cfg.compress, seed=seed, device=probe)
    model = build_model(cfg.model, seed=cfg.train.seed)
    return DilocoWorker(seat_cfg, model=model, batches=_no_batches(),
                        device=torch.device(seat.train_device), codec=codec, rng_seed=seed)


def _mean(reducer: Codec, pushes: list[list[bytes]], bounds: list[tuple[int, int]]) -> list[bytes]:
    """Each shard's mean as its reducer encodes it: the members' pushes of that shard decoded and summed in order."""
    shards = []
    for j, (lo, hi) in enumerate(bounds):
        parts = [member[j] for member in pushes]
        for part in parts:
            reducer.validate(part, numel=hi - lo)  # as a reducer takes a push
        out = torch.empty(hi - lo, dtype=torch.float32, device=reducer.device)
        shards.append(reducer.encode(aggregate_encoded(reducer, parts, Aggregation(), out=out, checked=True)))
    return shards


def _sharded(codec: Codec, blobs: list[bytes], bounds: list[tuple[int, int]], numel: int) -> ShardedMean:
    """The mean the reducers' blobs stand for, as a peer holds a round's material (averaging/material.py)."""
    layout = layout_of(blobs, bounds, numel=numel, codec=codec.name, gather=False)
    return sharded_mean(Material(layout, list(blobs)), codec)


def _shifted(read: Callable[[int, int], torch.Tensor], lo: int, a: int, b: int) -> torch.Tensor:
    return read(lo + a, lo + b)


def replay_rounds(cfg: RunConfig, seats: Sequence[Seat], *, rounds: int, reducer_device: str = "cpu",
                  num_shards: int = 3, scale: float = 1e-2) -> list[list[RoundTrace]]:
    """`rounds` rounds of the workers in `seats` (all training the same model from the same θ); traces[r][i] is
    worker i after round r. Each worker pushes its Δ as `num_shards` shards, each encoded on its round's device
    from a piecewise read, to reducers on `reducer_device` (every shard's mean encoded by the run's codec there)."""
    workers = [_worker(cfg, seat, seed=i) for i, seat in enumerate(seats)]
    reducer = codec_from_config(cfg.compress, seed=len(seats), device=reducer_device)
    gen = torch.Generator().manual_seed(cfg.train.seed)
    traces: list[list[RoundTrace]] = []
    for r in range(rounds):
        frag = workers[0].fragment()
        numel = workers[0].numel if frag is None else sum(hi - lo for lo, hi in frag)
        moves = [torch.randn(workers[0].numel, generator=gen) * scale for _ in workers]
        bounds = shard_bounds(numel, (1.0,) * num_shards, align=reducer.alignment)
        pushes = []
        for worker, move in zip(workers, moves, strict=True):
            local = worker.theta_global.detach().cpu() + move
            assign_flat(local, worker.params)
            worker._local_version += 1
            read = reader(worker.delta_source())
            codec = worker.codec
            assert codec is not None
            pushes.append([codec.encode_from(functools.partial(_shifted, read, lo), hi - lo) for lo, hi in bounds])
        blobs = _mean(reducer, pushes, bounds)
        row = []
        for worker in workers:
            assert worker.codec is not None
            mean = _sharded(worker.codec, blobs, bounds, numel)
            preview = worker.preview(mean, ())
            worker.apply(AverageResult(round=r, committed=True, mean=mean, members=tuple(map(str, range(len(seats))))))
            buf = worker.outer.momentum_buffer
            row.append(RoundTrace(digest=worker.digest(), preview=preview, hash=worker.global_hash(),
                                  theta_device=worker.theta_global.device,
                                  momentum_device=None if buf is None else buf.device,
                                  residual_device=None if worker.residual is None else worker.residual.device))
        traces.append(row)
    return traces

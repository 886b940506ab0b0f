"""K simulated workers in one process: DiLoCo rounds, or the data-parallel baseline on the same tokens."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from swarmtrain.compress.codec import Codec
from swarmtrain.config import RunConfig, to_dict
from swarmtrain.data.sharding import ShardedBatches, eval_batches
from swarmtrain.diloco.averager import AverageResult
from swarmtrain.diloco.flat import assign_flat, flat_hash, flatten
from swarmtrain.diloco.traffic import allreduce_bytes_per_peer
from swarmtrain.diloco.worker import Carry, DilocoWorker, InnerStats, resolve_device
from swarmtrain.models import build_model

__all__ = ["AverageAll", "RoundRecord", "SimulationResult", "sim_val_batches", "sim_worker", "simulate_ddp",
           "simulate_diloco"]

AverageAll = Callable[[int, Sequence[torch.Tensor]], Sequence[AverageResult]]
OnRound = Callable[["RoundRecord"], None]


@dataclass(frozen=True)
class RoundRecord:
    """One round (H steps of every worker); `tokens` and `bytes_sent` are cumulative."""

    round: int
    tokens: int  # all workers together, since the start
    loss: float  # mean training loss of the round, over workers and steps
    val_loss: float  # of θ_global after the round
    bytes_sent: int  # per worker, since the start
    compute_s: float  # this round, all workers
    eager_scale: float | None = None  # diloco.overlap: worker 0's λ for its next eager estimate (diloco.eager)
    spread: float | None = None  # gossip: the replicas' mean relative L2 distance to their mean φ


@dataclass
class SimulationResult:
    mode: str
    num_workers: int
    num_params: int
    initial_val_loss: float
    rounds: list[RoundRecord] = field(default_factory=list)
    hash: str = ""
    wall_s: float = 0.0
    final_theta: torch.Tensor | None = field(default=None, repr=False)  # flat fp32 weights at the end

    @property
    def final_val_loss(self) -> float:
        return self.rounds[-1].val_loss if self.rounds else self.initial_val_loss

    def to_json(self, cfg: RunConfig) -> dict[str, Any]:
        last = self.rounds[-1] if self.rounds else None
        return {
            "mode": self.mode, "workers": self.num_workers, "num_params": self.num_params,
            "inner_steps": cfg.diloco.inner_steps,
            "codec": cfg.compress.codec if self.mode in ("diloco", "noloco") else "fp32",
            "initial_val_loss": self.initial_val_loss, "final_val_loss": self.final_val_loss,
            "tokens": last.tokens if last else 0, "bytes_sent": last.bytes_sent if last else 0,
            "hash": self.hash, "wall_s": self.wall_s,
            "rounds": [asdict(r) for r in self.rounds], "config": to_dict(cfg),
        }


def sim_val_batches(cfg: RunConfig, val_tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return eval_batches(val_tokens, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len,
                        num_batches=cfg.diloco.eval_batches)


def sim_worker(cfg: RunConfig, tokens: torch.Tensor, *, index: int, num_workers: int, batch_size: int,
            codec: Codec | None, init_theta: torch.Tensor | None, start_step: int) -> DilocoWorker:
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0, got {start_step}")
    batches = ShardedBatches(tokens, worker_index=index, num_workers=num_workers, batch_size=batch_size,
                             seq_len=cfg.data.seq_len, seed=cfg.train.seed, position=start_step)
    model = build_model(cfg.model, seed=cfg.train.seed)  # every worker starts from the same θ
    if init_theta is not None:  # a warm start (e.g. a DDP-pretrained checkpoint), shared by every worker
        assign_flat(init_theta, list(model.parameters()))
    return DilocoWorker(cfg, model=model, batches=batches, device=resolve_device(cfg.train.device),
                        codec=codec, rng_seed=cfg.train.seed * 1000 + index)


def simulate_diloco(
    cfg: RunConfig,
    *,
    train_tokens: torch.Tensor,
    val_tokens: torch.Tensor,
    num_workers: int,
    average_all: AverageAll,
    codec: Codec | None = None,
    on_round: OnRound | None = None,
    init_theta: torch.Tensor | None = None,
    start_step: int = 0,
) -> SimulationResult:
    """`cfg.diloco.rounds` DiLoCo rounds of `num_workers` workers, one after another in this process.

    `codec` is only needed for `compress.error_feedback` (it must be the one `average_all` uses).
    `init_theta` (flat fp32) replaces the seeded init and `start_step` skips that many steps of the
    data stream: a warm start from a checkpoint trained on the stream's first `start_step` steps.
    Records count tokens and bytes from this call's start. Simulated workers all run at one speed,
    so `diloco.pace` "time" trains H steps each, as "steps" does.
    """
    start = time.perf_counter()
    workers = [sim_worker(cfg, train_tokens, index=k, num_workers=num_workers, batch_size=cfg.data.batch_size,
                       codec=codec, init_theta=init_theta, start_step=start_step) for k in range(num_workers)]
    val = sim_val_batches(cfg, val_tokens)
    result = SimulationResult(mode="diloco", num_workers=num_workers, num_params=workers[0].numel,
                              initial_val_loss=workers[0].evaluate(val))
    tokens = bytes_sent = 0
    # With diloco.overlap, round r's average lands during (or after) round r+1's inner steps (`Carry`).
    inflight: tuple[int, Sequence[AverageResult], list[Carry | None], list[InnerStats]] | None = None

    def commit(r: int, outcomes: Sequence[AverageResult], carries: list[Carry | None],
               stats: list[InnerStats]) -> None:
        nonlocal bytes_sent
        for w, outcome, carry in zip(workers, outcomes, carries, strict=True):
            if not w.apply(outcome, carry=carry):
                raise RuntimeError(f"round {r} did not commit in the simulation: {outcome.reason}")
        hashes = {w.global_hash() for w in workers}
        assert len(hashes) == 1, f"round {r}: workers disagree on θ_global"
        bytes_sent += outcomes[0].bytes_sent
        record = RoundRecord(round=r, tokens=tokens, loss=sum(s.loss for s in stats) / num_workers,
                             val_loss=(workers[0].evaluate_global if cfg.diloco.overlap else workers[0].evaluate)(val),
                             bytes_sent=bytes_sent, compute_s=sum(s.compute_s for s in stats),
                             eager_scale=workers[0].eager_scale() if cfg.diloco.overlap else None)
        result.rounds.append(record)
        if on_round is not None:
            on_round(record)

    H, delay = cfg.diloco.round_steps, cfg.diloco.overlap_max_steps
    for r in range(cfg.diloco.rounds):
        if inflight is not None and delay < H:  # the average lands after `delay` steps of this round
            early = [w.train_inner(delay) for w in workers]
            commit(*inflight)
            inflight = None
            stats = [e + w.train_inner(H - delay) for e, w in zip(early, workers, strict=True)]
        else:
            stats = [w.train_inner() for w in workers]
        tokens += sum(s.tokens for s in stats)
        if inflight is not None:
            commit(*inflight)
        carries: list[Carry | None]
        if cfg.diloco.overlap:
            sent = [w.send_overlapped() for w in workers]
            deltas, carries = [d for d, _ in sent], [c for _, c in sent]
        else:
            deltas, carries = [w.delta() for w in workers], [None] * len(workers)
        outcomes = average_all(r, deltas)
        inflight = (r, outcomes, carries, stats)
        if not cfg.diloco.overlap:
            commit(*inflight)
            inflight = None
    if inflight is not None:
        commit(*inflight)
    result.hash = workers[0].global_hash()
    result.final_theta = workers[0].theta_global.detach().cpu().clone()
    result.wall_s = time.perf_counter() - start
    return result


def simulate_ddp(
    cfg: RunConfig,
    *,
    train_tokens: torch.Tensor,
    val_tokens: torch.Tensor,
    num_workers: int,
    wire_codec: Codec | None = None,
    on_round: OnRound | None = None,
    init_theta: torch.Tensor | None = None,
    start_step: int = 0,
) -> SimulationResult:
    """The data-parallel baseline: one optimizer step per step on the union of the K workers' batches.

    Worker k's batch at step t under DiLoCo is slot k of the K×B-window batch that this single
    stream reads at step t, so both modes see exactly the same tokens in the same steps. A round is
    H steps here too (for comparable records); bytes are those of a ring all-reduce of fp32
    gradients every step, each gradient framed by `wire_codec` (give the fp32 codec so that both
    modes pay the same header) or counted as raw 4 bytes per element. `init_theta`/`start_step` as
    in `simulate_diloco`.
    """
    start = time.perf_counter()
    worker = sim_worker(cfg, train_tokens, index=0, num_workers=1, batch_size=num_workers * cfg.data.batch_size,
                     codec=None, init_theta=init_theta, start_step=start_step)
    val = sim_val_batches(cfg, val_tokens)
    result = SimulationResult(mode="ddp", num_workers=num_workers, num_params=worker.numel,
                              initial_val_loss=worker.evaluate(val))
    grad_bytes = 4 * worker.numel if wire_codec is None else len(wire_codec.encode(torch.zeros(worker.numel)))
    per_step = allreduce_bytes_per_peer(contribution_bytes=grad_bytes, result_bytes=grad_bytes, num_peers=num_workers)
    tokens = bytes_sent = 0
    for r in range(cfg.diloco.rounds):
        stats = worker.train_inner()
        tokens += stats.tokens
        bytes_sent += per_step * stats.steps
        record = RoundRecord(round=r, tokens=tokens, loss=stats.loss, val_loss=worker.evaluate(val),
                             bytes_sent=bytes_sent, compute_s=stats.compute_s)
        result.rounds.append(record)
        if on_round is not None:
            on_round(record)
    result.final_theta = flatten(worker.params)
    result.hash = flat_hash(result.final_theta)  # the trained weights: DDP has no θ_global
    result.wall_s = time.perf_counter() - start
    return result

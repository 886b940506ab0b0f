"""K simulated NoLoCo workers in one process: gossip rounds of small groups, real codecs, no all-reduce.

Every round each worker trains its H inner steps, encodes its Δ with the run's codec and its slow weights
φ with `averaging.gossip_weights_codec` (what it would send each partner), and forms its group's means
from its own exact values and its partners' decoded ones (diloco/noloco.py); then every worker takes its
NoLoCo step. Groups come from round/gossip_groups.py over the whole roster (no worker is missing
here). The records' `val_loss` is worker 0's φ; `spread` is the replicas' mean relative L2 distance to
their mean φ; at the end every replica and the replicas' mean are evaluated.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmtrain.compress import get_codec
from swarmtrain.compress.codec import Codec
from swarmtrain.config import RunConfig
from swarmtrain.diloco.flat import assign_flat, flat_hash
from swarmtrain.diloco.noloco import GroupMean, NolocoOuter, group_mean
from swarmtrain.diloco.simulation import OnRound, RoundRecord, SimulationResult, sim_val_batches, sim_worker
from swarmtrain.diloco.worker import DilocoWorker
from swarmtrain.round.gossip_groups import gossip_groups

__all__ = ["GossipSummary", "replica_spread", "simulate_noloco"]


@dataclass
class GossipSummary:
    """What a NoLoCo simulation adds to its SimulationResult."""

    replica_val_losses: list[float] = field(default_factory=list)  # each replica's φ at the end
    mean_replica_val_loss: float = float("nan")  # of the replicas' mean φ
    clipped: int = 0  # partner parts scaled down by averaging.gossip_clip, over the run
    dropped: int = 0  # partner parts left out (non-finite, wrong size)

    def to_json(self) -> dict[str, Any]:
        return {"replica_val_losses": self.replica_val_losses, "mean_replica_val_loss": self.mean_replica_val_loss,
                "clipped": self.clipped, "dropped": self.dropped}


def replica_spread(phis: list[torch.Tensor]) -> float:
    """Mean over replicas of ‖φ_k − φ̄‖ / ‖φ̄‖ (0 when they agree)."""
    mean = torch.stack(phis).mean(dim=0)
    norm = max(float(mean.norm()), 1e-12)
    return sum(float((p - mean).norm()) for p in phis) / len(phis) / norm


def _buffer(worker: DilocoWorker) -> torch.Tensor:
    buf = worker.outer.momentum_buffer  # allocated for averaging.mode = "gossip": checkpoints carry it
    assert buf is not None
    return buf


def simulate_noloco(
    cfg: RunConfig,
    *,
    train_tokens: torch.Tensor,
    val_tokens: torch.Tensor,
    num_workers: int,
    codec: Codec,
    on_round: OnRound | None = None,
    init_theta: torch.Tensor | None = None,
    start_step: int = 0,
) -> tuple[SimulationResult, GossipSummary]:
    """`cfg.diloco.rounds` gossip rounds of `num_workers` workers on the tokens `simulate_diloco` gives them."""
    if num_workers < 2:
        raise ValueError(f"gossip needs at least 2 workers, got {num_workers}")
    start = time.perf_counter()
    avg = cfg.averaging
    workers = [sim_worker(cfg, train_tokens, index=k, num_workers=num_workers, batch_size=cfg.data.batch_size,
                          codec=None, init_theta=init_theta, start_step=start_step) for k in range(num_workers)]
    weights_codec = get_codec(avg.gossip_weights_codec, device=codec.device)
    outers = [NolocoOuter(lr=avg.gossip_lr, momentum=avg.gossip_momentum, buffer=_buffer(w)) for w in workers]
    names = [f"w{k}" for k in range(num_workers)]
    val = sim_val_batches(cfg, val_tokens)
    result = SimulationResult(mode="noloco", num_workers=num_workers, num_params=workers[0].numel,
                              initial_val_loss=workers[0].evaluate(val))
    summary = GossipSummary()
    tokens = 0
    sent = [0] * num_workers  # bytes each worker sent, since the start
    for r in range(cfg.diloco.rounds):
        stats = [w.train_inner() for w in workers]
        tokens += sum(s.tokens for s in stats)
        deltas = [w.delta() for w in workers]
        wire = []  # what each worker's partners decode: (Δ, φ), and the bytes of one copy
        for w, d in zip(workers, deltas, strict=True):
            d_bytes, p_bytes = codec.encode(d), weights_codec.encode(w.theta_global)
            wire.append((codec.decode(d_bytes).reshape(-1), weights_codec.decode(p_bytes).reshape(-1),
                         len(d_bytes) + len(p_bytes)))
        index = {n: k for k, n in enumerate(names)}
        means: list[GroupMean | None] = [None] * num_workers
        for group in gossip_groups(names, round_index=r, size=avg.gossip_group_size, seed=cfg.train.seed):
            for name in group:
                k = index[name]
                parts = [(p, wire[index[p]][0], wire[index[p]][1]) for p in group if p != name]
                means[k] = group_mean(deltas[k], workers[k].theta_global, parts, clip=avg.gossip_clip)
                sent[k] += (len(group) - 1) * wire[k][2]
        for w, outer, gm in zip(workers, outers, means, strict=True):
            assert gm is not None
            summary.clipped += len(gm.clipped)
            summary.dropped += len(gm.dropped)
            w.gossip_step(functools.partial(outer.step, mean_delta=gm.delta, mean_phi=gm.phi))
        record = RoundRecord(round=r, tokens=tokens, loss=sum(s.loss for s in stats) / num_workers,
                             val_loss=workers[0].evaluate(val), bytes_sent=sum(sent) // num_workers,
                             compute_s=sum(s.compute_s for s in stats),
                             spread=replica_spread([w.theta_global for w in workers]))
        result.rounds.append(record)
        if on_round is not None:
            on_round(record)
    summary.replica_val_losses = [w.evaluate(val) for w in workers]
    mean_phi = torch.stack([w.theta_global for w in workers]).mean(dim=0)
    probe = workers[0]
    assign_flat(mean_phi, probe.params)
    summary.mean_replica_val_loss = probe.evaluate(val)
    assign_flat(probe.theta_global, probe.params)
    result.hash = flat_hash(workers[0].theta_global)
    result.final_theta = workers[0].theta_global.detach().cpu().clone()
    result.wall_s = time.perf_counter() - start
    return result, summary

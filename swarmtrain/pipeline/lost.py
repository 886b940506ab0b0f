"""Lost stages: when a stage counts as lost, which server takes it, and CheckFree's rebuild rule, pure.

A stage is **lost** when it had a live stage server and then has none in the live records for
`grace_s` in a row (a server restarting comes back within it; a record of a killed server lingers
until its TTL, so the grace counts from the record's expiry). A stage never seen served (a run
starting, its servers not up yet) is not lost: it is unserved.

**The taker.** Every server applies the same rule to the same records: a candidate is any server
whose stage keeps another server after it leaves (a stage is never emptied to refill another).
Servers of the lost stage's neighbours come first (the taker then holds one of the two states the
rebuild averages), and the lowest peer id among them takes it, so one server takes a lost stage.

**Copies** (`pipeline.lost_stage = "checkpoint"`): every server keeps a copy of the state of each of its
neighbouring stages (`copy_stages`), announced in its record as (stage, round). The taker of a lost stage is
then the spare server holding the freshest copy of it (highest round; neighbours first and the lowest peer
id among equals, `choose_restorer`), and the stage restarts from that copy: first and last stages too.

**The rebuild** (CheckFree, Blagoev et al. 2025): a lost middle stage starts from the weighted
average of its two neighbouring stages' weights, block by block. Both neighbours must hold as many
blocks as the lost stage (transformer blocks all have one shape, so the average is element-wise over
the flat θ); a first or last stage has one neighbour and is not rebuilt this way. CheckFree weights
each neighbour by the norm of its last gradient; the records carry no gradient norms, so the
neighbours weigh equally here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["LiveServer", "LostStageWatch", "choose_restorer", "choose_taker", "copy_stages", "neighbours_of",
           "weighted_average"]


@dataclass(frozen=True)
class LiveServer:
    """One live stage server as its record describes it."""

    peer_id: str
    stage: int
    round: int  # its stage's outer round
    copies: tuple[tuple[int, int], ...] = ()  # (stage, round) of the copies of other stages it keeps


class LostStageWatch:
    """Which stages are lost, from successive looks at the live records (the clock is the caller's)."""

    def __init__(self, *, stages: int, grace_s: float) -> None:
        if stages < 1 or grace_s <= 0:
            raise ValueError(f"LostStageWatch: stages must be >= 1 and grace_s > 0, got {stages} and {grace_s}")
        self.stages = stages
        self.grace_s = grace_s
        self.served = [False] * stages  # seen with a live server at least once
        self.last_round = [0] * stages  # the newest round a server of the stage announced
        self._empty_since: dict[int, float] = {}

    def observe(self, servers: Sequence[LiveServer], *, now: float) -> list[int]:
        """The lost stages after this look, lowest first."""
        present = set()
        for s in servers:
            if 0 <= s.stage < self.stages:
                present.add(s.stage)
                self.served[s.stage] = True
                self.last_round[s.stage] = max(self.last_round[s.stage], s.round)
        lost = []
        for k in range(self.stages):
            if k in present or not self.served[k]:
                self._empty_since.pop(k, None)
                continue
            since = self._empty_since.setdefault(k, now)
            if now - since >= self.grace_s:
                lost.append(k)
        return lost

    def empty_for_s(self, stage: int, *, now: float) -> float:
        """How long `stage` has had no live server (0 while it has one)."""
        since = self._empty_since.get(stage)
        return 0.0 if since is None else now - since


def choose_taker(servers: Sequence[LiveServer], *, lost: int) -> str | None:
    """The peer id of the server that takes stage `lost`, or None when no stage has a server to spare."""
    spare = _spare(servers, lost)
    if not spare:
        return None
    return min(spare, key=lambda s: (abs(s.stage - lost) != 1, s.peer_id)).peer_id


def _spare(servers: Sequence[LiveServer], lost: int) -> list[LiveServer]:
    """The servers that may leave their stage for `lost`: their stage keeps another server."""
    count: dict[int, int] = {}
    for s in servers:
        count[s.stage] = count.get(s.stage, 0) + 1
    return [s for s in servers if s.stage != lost and count[s.stage] >= 2]


def copy_stages(stage: int, *, stages: int) -> list[int]:
    """The stages a server of `stage` keeps copies of: its neighbours."""
    return [k for k in (stage - 1, stage + 1) if 0 <= k < stages]


def choose_restorer(servers: Sequence[LiveServer], *, lost: int) -> tuple[str, int] | None:
    """(peer id, copy round) of the server that restores stage `lost` from its copy: the spare server with
    the freshest copy of it; None when no spare server holds one."""
    held = [(dict(s.copies)[lost], s) for s in _spare(servers, lost) if lost in dict(s.copies)]
    if not held:
        return None
    copy_round, chosen = min(held, key=lambda h: (-h[0], abs(h[1].stage - lost) != 1, h[1].peer_id))
    return chosen.peer_id, copy_round


def neighbours_of(lost: int, *, blocks: Sequence[int]) -> tuple[tuple[int, int] | None, str]:
    """The two stages whose average rebuilds stage `lost` (`blocks[k]`: stage k's block count), or None
    and why it cannot be rebuilt from its neighbours."""
    last = len(blocks) - 1
    if lost <= 0 or lost >= last:
        return None, (f"stage {lost} is the {'first' if lost <= 0 else 'last'} stage: it has one neighbouring "
                      "stage, and a rebuild averages two")
    before, after = lost - 1, lost + 1
    if not blocks[before] == blocks[lost] == blocks[after]:
        return None, (f"stages {before}, {lost} and {after} hold {blocks[before]}, {blocks[lost]} and "
                      f"{blocks[after]} blocks: the average needs as many blocks on each")
    return (before, after), ""


def weighted_average(thetas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Σ w_i θ_i / Σ w_i over flat θs of one length (stages of equal blocks: block by block, element-wise)."""
    if not thetas or len(thetas) != len(weights):
        raise ValueError(f"weighted_average: {len(thetas)} tensors and {len(weights)} weights")
    if any(t.shape != thetas[0].shape for t in thetas):
        raise ValueError(f"weighted_average: shapes differ: {[tuple(t.shape) for t in thetas]}")
    total = float(sum(weights))
    if not total > 0 or any(w < 0 for w in weights):
        raise ValueError(f"weighted_average: weights must be >= 0 with a positive sum, got {list(weights)}")
    out = torch.zeros_like(thetas[0], dtype=torch.float32)
    for theta, w in zip(thetas, weights, strict=True):
        out.add_(theta.to(torch.float32), alpha=w / total)
    return out

"""Which stage server moves to which stage: the rebalancing rule, pure (records in, a decision out).

Every micro-batch passes every stage once, so the pipeline runs at most as fast as its slowest stage.
A stage's **capacity** is the micro-batches per second its servers complete when busy all the time:
Σ 1 / (a server's compute seconds per micro-batch, from its record). Its **load** is the fraction of
the last window its servers spent computing (their mean). The rule, applied every period by every
server to the same records:

* no stage may be empty, and every server's figures must be from its current stage: no server moves
  for `cooldown_s` after any server took its stage (moved, joined, restarted);
* the bottleneck is the stage of least capacity (the earlier on a tie); it must be saturated (load
  at least `SATURATED`), or the trainers, not the stages, bound the pipeline's rate;
* every server of another stage that keeps at least one server is a candidate; its move would take
  its capacity from its stage and give the bottleneck its per-block speed; the move that leaves the
  highest least capacity wins, the lowest peer id among those within `EQUAL` of it (measured figures
  jitter); it must raise the least capacity by at least `margin`, so a move that would only trade the
  bottleneck for another never happens;
* the same move must be called for over `observe_s` in a row (the caller's state) before it is made.

Every server names the same mover, so one server moves a period, not every server of a stage. A server
never measured yet counts at the median per-block speed of those measured.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["EQUAL", "SATURATED", "Decision", "RebalanceRule", "Rebalancer", "ServerLoad", "plan_move"]

SATURATED = 0.5  # the least load of a bottleneck worth moving to
EQUAL = 0.1  # moves whose results differ by less than this fraction count as equally good


@dataclass(frozen=True)
class ServerLoad:
    """One stage server as its record describes it."""

    peer_id: str
    stage: int
    service_s: float  # compute seconds per micro-batch here, forward + backward; 0 = not measured yet
    busy: float  # fraction of its last window spent computing, 0..1
    stage_since: float  # swarm clock: when it took this stage


@dataclass(frozen=True)
class RebalanceRule:
    margin: float  # the least raise of the least capacity a move must bring, a fraction
    cooldown_s: float
    observe_s: float

    def __post_init__(self) -> None:
        if not self.margin > 0:
            raise ValueError(f"RebalanceRule.margin: must be > 0, got {self.margin}")
        if self.cooldown_s < 0 or self.observe_s < 0:
            raise ValueError("RebalanceRule.cooldown_s and observe_s: must be >= 0")


@dataclass(frozen=True)
class Decision:
    """Stay (`move_to` None) or move this server to stage `move_to`; `reason` says why, in words."""

    move_to: int | None
    reason: str
    mover: str = ""  # the server the rule moves (this one or another); "" = none
    source: int = -1  # the stage it leaves
    capacity_per_s: tuple[float, ...] = ()  # each stage's micro-batches a second at full load
    load: tuple[float, ...] = ()  # each stage's mean fraction of time computing
    predicted_per_s: float = 0.0  # the least capacity after the move


def _stay(reason: str, capacity: Sequence[float] = (), load: Sequence[float] = (), predicted: float = 0.0) -> Decision:
    return Decision(None, reason, capacity_per_s=tuple(round(c, 3) for c in capacity),
                    load=tuple(round(u, 3) for u in load), predicted_per_s=round(predicted, 3))


def plan_move(loads: Sequence[ServerLoad], *, blocks: Sequence[int], rule: RebalanceRule, now: float) -> Decision:
    """The move the records call for this period (any server's), or stay; `blocks[k]`: stage k's block count."""
    stages = len(blocks)
    by_stage: list[list[ServerLoad]] = [[] for _ in range(stages)]
    for s in loads:
        if 0 <= s.stage < stages:
            by_stage[s.stage].append(s)
    empty = [k for k in range(stages) if not by_stage[k]]
    if empty:
        return _stay(f"stage {empty[0]} has no server: a lost stage is rebuilt, not rebalanced")
    latest = max(loads, key=lambda s: (s.stage_since, s.peer_id))
    if now - latest.stage_since < rule.cooldown_s:
        return _stay(f"cooldown: {latest.peer_id} took stage {latest.stage} {now - latest.stage_since:.1f} s ago "
                     f"(< {rule.cooldown_s:g} s)")
    per_block = [s.service_s / blocks[s.stage] for s in loads if s.service_s > 0]
    if not per_block:
        return _stay("no server has measured its compute yet")
    typical = statistics.median(per_block)

    def speed(s: ServerLoad, stage: int) -> float:  # micro-batches a second at `stage`, at its per-block speed
        cost = s.service_s / blocks[s.stage] if s.service_s > 0 else typical
        return 1.0 / (cost * blocks[stage])

    capacity = [sum(speed(s, k) for s in by_stage[k]) for k in range(stages)]
    load = [sum(min(max(s.busy, 0.0), 1.0) for s in by_stage[k]) / len(by_stage[k]) for k in range(stages)]
    least = min(capacity)
    bottleneck = capacity.index(least)
    if load[bottleneck] < SATURATED:
        return _stay(f"the slowest stage {bottleneck} computes {load[bottleneck]:.0%} of the time (< "
                     f"{SATURATED:.0%}): the stages do not bound the pipeline", capacity, load)
    moves: list[tuple[float, ServerLoad]] = []
    for s in loads:
        if s.stage == bottleneck or len(by_stage[s.stage]) < 2:
            continue
        after = list(capacity)
        after[s.stage] -= speed(s, s.stage)
        after[bottleneck] += speed(s, bottleneck)
        moves.append((min(after), s))
    if not moves:
        return _stay(f"stage {bottleneck} is the slowest, and no other stage has a server to spare", capacity, load)
    top = max(predicted for predicted, _ in moves)
    # Measured figures jitter: moves within EQUAL of the best are one, and the lowest peer id makes it, so every
    # server names the same mover period after period.
    predicted, mover = min(((p, s) for p, s in moves if p >= top / (1 + EQUAL)), key=lambda m: m[1].peer_id)
    if predicted < (1 + rule.margin) * least:
        return _stay(f"the best move ({mover.peer_id}: stage {mover.stage} -> {bottleneck}) raises the least "
                     f"capacity from {least:.2f} to {predicted:.2f}/s, less than the margin {rule.margin:.0%}",
                     capacity, load, predicted)
    reason = (f"stage {bottleneck} is the bottleneck ({least:.2f} micro-batches/s at {load[bottleneck]:.0%} load); "
              f"{mover.peer_id} leaving stage {mover.stage} raises the least capacity to {predicted:.2f}/s")
    return Decision(bottleneck, reason, mover=mover.peer_id, source=mover.stage,
                    capacity_per_s=tuple(round(c, 3) for c in capacity), load=tuple(round(u, 3) for u in load),
                    predicted_per_s=round(predicted, 3))


class Rebalancer:
    """`plan_move` for server `me`, with the minimum observation time: a move is made only once the records
    called for the same one (same mover, same stages) over `rule.observe_s` in a row. The clock is the caller's."""

    def __init__(self, rule: RebalanceRule, *, me: str, blocks: Sequence[int]) -> None:
        self.rule = rule
        self.me = me
        self.blocks = tuple(blocks)
        self._pending: tuple[str, int, int] | None = None  # (mover, from, to) as last called for
        self._since = 0.0

    def decide(self, loads: Sequence[ServerLoad], *, now: float) -> Decision:
        d = plan_move(loads, blocks=self.blocks, rule=self.rule, now=now)
        if d.move_to is None:
            self._pending = None
            return d
        key = (d.mover, d.source, d.move_to)
        if key != self._pending:
            self._pending, self._since = key, now
        seen_s = now - self._since
        if seen_s < self.rule.observe_s:
            return Decision(None, f"observing for {seen_s:.1f} of {self.rule.observe_s:g} s: {d.reason}",
                            mover=d.mover, source=d.source, capacity_per_s=d.capacity_per_s, load=d.load,
                            predicted_per_s=d.predicted_per_s)
        if d.mover != self.me:
            return Decision(None, f"{d.mover} moves, not this server: {d.reason}", mover=d.mover, source=d.source,
                            capacity_per_s=d.capacity_per_s, load=d.load, predicted_per_s=d.predicted_per_s)
        self._pending = None  # made: the next move is observed afresh
        return d

"""What a stage server does at each look of its decision loop, pure: the live servers' records in, one choice out.

The choices: stay on its stage, move to another (the rebalancing rule of rebalance.py), rebuild a lost stage
from its two neighbours, or restore a lost stage from its own copy (lost.py). A lost stage this server takes
comes first: a rebuild changes the records the rebalancing rule would read, so that rule waits for the next
look. The rules keep the state their rules need between looks (how long each stage has been unserved, the move
called for so far); `warnings` collects what a look found worth logging once (an unserved stage nobody takes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from swarmtrain.discovery import PeerRecord
from swarmtrain.pipeline.lost import LiveServer, LostStageWatch, choose_restorer, choose_taker, neighbours_of
from swarmtrain.pipeline.rebalance import Decision, Rebalancer, ServerLoad

__all__ = ["LOOKS", "Choice", "Move", "Rebuild", "Restore", "ServerRules", "Stay", "describe", "server_loads"]

LOOKS = ("lost", "rebalance", "copies")  # the kinds of look; "copies" refreshes copies beside the choice


@dataclass(frozen=True)
class Stay:
    """The server keeps its stage (`why`: the rebalancing rule's reason, for the debug log)."""

    why: str = ""


@dataclass(frozen=True)
class Move:
    """Rebalancing moves the server to `decision.move_to`."""

    decision: Decision


@dataclass(frozen=True)
class Rebuild:
    """The server rebuilds stage `lost` at round `round` from the average of the two neighbouring stages `pair`,
    taken from their servers among `records`."""

    lost: int
    pair: tuple[int, int]
    records: tuple[PeerRecord, ...]
    lost_s: float
    round: int


@dataclass(frozen=True)
class Restore:
    """The server restores stage `lost` at round `round` from its own copy of it."""

    lost: int
    lost_s: float
    round: int


Choice = Stay | Move | Rebuild | Restore


def describe(choice: Choice) -> str:
    """What `choice` does, for a log line."""
    match choice:
        case Move(decision):
            return f"the move to stage {decision.move_to}"
        case Rebuild(lost, pair):
            return f"rebuilding stage {lost} from stages {pair[0]} and {pair[1]}"
        case Restore(lost):
            return f"restoring stage {lost} from this server's copy"
    return "staying"


def server_loads(peers: Sequence[PeerRecord], stages: int) -> list[ServerLoad]:
    """What the rebalancing rule reads of the live stage servers' records."""
    return [ServerLoad(p.peer_id, s.stage, s.service_s, s.busy, s.stage_since) for p in peers
            if (s := p.server) is not None and s.stage < stages]


@dataclass
class ServerRules:
    """One server's rules: `me` its peer id, `fitting` the stages that fit its memory, `lost_stage` the run's
    `pipeline.lost_stage`, `rebalancer` None without `pipeline.rebalance`."""

    me: str
    stages: int
    blocks: Sequence[int]  # blocks per stage
    fitting: Sequence[int]
    lost_stage: str
    watch: LostStageWatch
    rebalancer: Rebalancer | None
    warnings: list[str] = field(default_factory=list)
    _told: set[tuple[int, str]] = field(default_factory=set)

    def choose(self, due: set[str], records: Sequence[PeerRecord], *, now: float) -> Choice:
        """The choice of a look of the kinds `due` (of LOOKS) at swarm time `now`, from the live records (this
        server's own among them, as of now)."""
        if "lost" in due:
            taken = self._lost(records, now=now)
            if taken is not None:
                return taken
        if "rebalance" not in due or self.rebalancer is None:
            return Stay()
        decision = self.rebalancer.decide(server_loads(records, self.stages), now=now)
        if decision.move_to is None:
            return Stay(decision.reason)
        if decision.move_to not in self.fitting:
            self._warn(-1, f"rebalancing calls this server to stage {decision.move_to}, which does not fit "
                           f"train.memory_budget_mb (stages that fit: {list(self.fitting)}); it stays")
            return Stay(decision.reason)
        return Move(decision)

    def _lost(self, records: Sequence[PeerRecord], *, now: float) -> Rebuild | Restore | None:
        live = [LiveServer(p.peer_id, p.stage, p.round, p.copies) for p in records
                if p.role == "stage_server" and 0 <= p.stage < self.stages]
        for lost in self.watch.observe(live, now=now):
            empty_s = self.watch.empty_for_s(lost, now=now)
            round_ = self.watch.last_round[lost] + 1
            plan, why = self.plan(lost, live)
            if plan == "copy":
                return Restore(lost, lost_s=empty_s, round=round_)
            if isinstance(plan, tuple):
                return Rebuild(lost, plan, tuple(records), lost_s=empty_s, round=round_)
            if why:
                self._warn(lost, f"stage {lost} has had no live server for {empty_s:.1f} s: {why}")
        return None

    def plan(self, lost: int, live: Sequence[LiveServer]) -> tuple[tuple[int, int] | str | None, str]:
        """How this server rebuilds `lost`: from the two neighbouring stages it names, or "copy"; or None and why
        ("" = another server takes it)."""
        if self.lost_stage == "off":
            return None, "pipeline.lost_stage = off: it stays unserved until a server joins it"
        if self.lost_stage == "checkpoint":
            return self._plan_restore(lost, live)
        taker = choose_taker(live, lost=lost)
        if taker is None:
            return None, "no other stage has a server to spare: it stays unserved until a server joins it"
        if taker != self.me:
            return None, ""
        pair, why = neighbours_of(lost, blocks=self.blocks)
        if pair is None:
            return None, f"{why}; it stays unserved until a server joins it"
        if lost not in self.fitting:
            return None, (f"this server would take it, but it does not fit train.memory_budget_mb (stages that fit: "
                          f"{list(self.fitting)}); it stays unserved until a server joins it")
        return pair, ""

    def _plan_restore(self, lost: int, live: Sequence[LiveServer]) -> tuple[str | None, str]:
        """`plan` for `lost_stage = "checkpoint"`: the server with the freshest copy restores the stage."""
        chosen = choose_restorer(live, lost=lost)
        if chosen is None:
            return None, ("no server that its stage can spare holds a copy of it: it stays unserved until a server "
                          "joins it")
        if chosen[0] != self.me:
            return None, ""
        if lost not in self.fitting:
            return None, (f"this server holds the freshest copy, but the stage does not fit train.memory_budget_mb "
                          f"(stages that fit: {list(self.fitting)}); it stays unserved until a server joins it")
        return "copy", ""

    def _warn(self, stage: int, text: str) -> None:
        """Once per stage and reason (a reason with its seconds counted is told once per stage and tail)."""
        key = (stage, text.split(": ", 1)[-1])
        if key not in self._told:
            self._told.add(key)
            self.warnings.append(text)

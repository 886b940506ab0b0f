"""Metrics and status. events.py: the READY/JSON-line stdout protocol; counters.py: per-round costs, StatusSnapshot;
progress.py: a swarm's rounds from its peers' lines; console.py: one peer's progress on a terminal (stderr).
tally.py: a peer's work so far, folded from its event lines; prometheus.py: `/metrics` read from the tally.
"""

from swarmtrain.telemetry.counters import RoundCounters, RoundTotals, StatusSnapshot
from swarmtrain.telemetry.events import (
    EventError,
    EventWriter,
    HealEvent,
    LeaveEvent,
    ReadyLine,
    RoundEvent,
    StageMoveEvent,
    StageRebuildEvent,
    StageRoundEvent,
    StageStepEvent,
    StepEvent,
    format_ready,
    parse_line,
)

__all__ = [
    "EventError",
    "EventWriter",
    "HealEvent",
    "LeaveEvent",
    "ReadyLine",
    "RoundCounters",
    "RoundEvent",
    "RoundTotals",
    "StageMoveEvent",
    "StageRebuildEvent",
    "StageRoundEvent",
    "StageStepEvent",
    "StatusSnapshot",
    "StepEvent",
    "format_ready",
    "parse_line",
]

"""The peer's stdout protocol: one `READY {json}` line, then one JSON object per line per event.

Every daemon writes these lines and every reader (the demo's live view, the system tests, a log
shipper) parses them with `parse_line`, so the schema lives in exactly one place.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

__all__ = [
    "EventError",
    "EventWriter",
    "HealEvent",
    "LeaveEvent",
    "Line",
    "ReadyLine",
    "RoundEvent",
    "StageMoveEvent",
    "StageRebuildEvent",
    "StageRoundEvent",
    "StageStepEvent",
    "StepEvent",
    "format_ready",
    "parse_line",
]

log = logging.getLogger(__name__)

READY_PREFIX = "READY "


class EventError(ValueError):
    """A line that claims to be an event is not valid JSON or misses/mistypes a field."""


@dataclass(frozen=True)
class RoundEvent:
    """One outer round as one peer saw it; `hash` is the hex hash of θ_global after the round."""

    round: int
    committed: bool
    members: tuple[str, ...]
    loss: float | None  # mean inner training loss of this round's steps (None: no steps ran)
    val_loss: float | None  # validation loss of θ_global after the round (None: not evaluated)
    hash: str
    bytes_sent: int
    bytes_received: int
    compute_s: float
    comm_s: float
    peer: str = ""
    reason: str = ""  # why the round aborted, or who failed and was worked around
    steps: int = 0  # inner steps in the Δ sent (reported on its first attempt only, like compute_s)
    alone_s: float = 0.0  # seconds this peer has seen no other live peer (0 until discovery.alone_warning_s)
    val_ppl: float | None = None  # exp(val_loss)
    val_bpb: float | None = None  # val_loss in bits per byte of the validation text (data/evaluation.py)
    spread: float | None = None  # gossip: mean ‖φ_partner − φ‖ / ‖φ‖ over the round's partners (diloco/noloco.py)
    wait_s: float | None = None  # gossip: of comm_s, the seconds spent waiting for the partners' parts
    # The control plane since this peer's previous round line (discovery.DirectoryIo): DHT lookups and stores,
    # the values the lookups returned, and the records among them opened and checked (not from the cache).
    dht_reads: int | None = None
    dht_writes: int | None = None
    dht_slots: int | None = None
    dht_decoded: int | None = None

    event: str = field(default="round", init=False)


@dataclass(frozen=True)
class HealEvent:
    """A peer replaced its state with a live peer's (joined late, restarted, or fell behind)."""

    from_round: int
    to_round: int
    source: str  # peer id of the donor; several, comma-separated, when each served a range of the state
    hash: str
    peer: str = ""
    transfer_s: float = 0.0

    event: str = field(default="heal", init=False)


@dataclass(frozen=True)
class LeaveEvent:
    """A peer stopped: `reason` is "done" (ran its rounds), "signal" (SIGTERM/SIGINT) or an error."""

    round: int
    reason: str
    hash: str = ""
    peer: str = ""
    checkpoint: str = ""  # path of the checkpoint written on the way out, if any
    bytes_sent: int = 0  # data-plane bytes since the last round line (means served to slow members, state)
    bytes_received: int = 0

    event: str = field(default="leave", init=False)


@dataclass(frozen=True)
class StepEvent:
    """One inner step of a pipeline trainer: its micro-batches, how many were re-sent and lost."""

    step: int
    loss: float | None  # mean loss of the step's completed micro-batches (None: all lost)
    samples: int  # sequences whose micro-batch completed
    microbatches: int
    rerouted: int  # calls re-sent to another server of their stage
    lost: int
    stage_latency_s: tuple[float, ...]  # mean seconds of a call to each stage
    peer: str = ""
    lost_reasons: tuple[str, ...] = ()
    at: float = 0.0  # unix seconds when the step ended

    event: str = field(default="step", init=False)


@dataclass(frozen=True)
class StageStepEvent:
    """One inner step of a pipeline stage server."""

    stage: int
    step: int
    samples_per_s: float  # sequences this server trained on per second since its previous step
    forwards: int
    backwards: int
    refused: int  # calls answered with a typed error so far
    peer: str = ""
    at: float = 0.0  # unix seconds when the step ended

    event: str = field(default="stage_step", init=False)


@dataclass(frozen=True)
class StageRoundEvent:
    """One outer round of a pipeline part, as one of its holders saw it: a stage's blocks averaged among
    that stage's servers (`stage` >= 0), or the embeddings and head among the trainers (`stage` = -1).
    `hash` is the hex hash of the part's θ_global after the round (one per committed round and part)."""

    stage: int
    round: int
    committed: bool
    members: tuple[str, ...]
    hash: str
    steps: int  # inner steps in the Δ sent
    bytes_sent: int
    bytes_received: int
    comm_s: float
    peer: str = ""
    reason: str = ""  # why the round aborted, or who failed and was worked around
    at: float = 0.0  # unix seconds when the round ended here

    event: str = field(default="stage_round", init=False)


@dataclass(frozen=True)
class StageMoveEvent:
    """A pipeline stage server moved to the bottleneck stage (rebalancing, docs/pipeline.md#rebalancing)."""

    from_stage: int
    to_stage: int
    reason: str
    capacity_per_s: tuple[float, ...]  # each stage's micro-batches a second at full load, before the move
    load: tuple[float, ...]  # each stage's mean fraction of time computing, before the move
    predicted_per_s: float  # the least stage capacity after the move
    round: int  # the new stage's round whose θ_global it took
    hash: str  # that θ_global's hash, as the stage's servers announced it
    transfer_s: float  # building the new stage and taking its state
    drain_s: float  # answering the old stage's backwards after the switch
    unfinished: int  # old-stage micro-batches whose backward did not come within pipeline.rebalance_drain_s
    peer: str = ""
    at: float = 0.0  # unix seconds of the switch (the record naming the new stage)

    event: str = field(default="stage_move", init=False)


@dataclass(frozen=True)
class StageRebuildEvent:
    """A stage server took a stage that had no live server and rebuilt its weights (docs/pipeline.md#lost-stages)."""

    stage: int  # the lost stage
    from_stage: int  # the stage the server left for it (it kept another server)
    method: str  # "neighbours": the weighted average of the neighbouring stages' θ_global; "checkpoint": a copy
    sources: tuple[str, ...]  # what was used, one entry a source: "stage 0 round 3 <hash12> from <peer>"
    weights: tuple[float, ...]  # each source's weight in the average
    lost_s: float  # how long the stage had no live server when it was taken
    round: int  # the round the rebuilt θ_global starts the stage at
    hash: str  # the rebuilt θ_global's hash
    transfer_s: float  # building the stage and taking its neighbours' states (or installing the copy)
    drain_s: float  # answering the old stage's backwards after the switch
    unfinished: int  # old-stage micro-batches whose backward did not come within pipeline.rebalance_drain_s
    peer: str = ""
    at: float = 0.0  # unix seconds of the switch (the record naming the stage)

    event: str = field(default="stage_rebuild", init=False)


@dataclass(frozen=True)
class ReadyLine:
    """The `READY {json}` line a daemon prints once it is listening; `info` is its JSON payload."""

    info: dict[str, Any]


Event = (RoundEvent | HealEvent | LeaveEvent | StepEvent | StageStepEvent | StageRoundEvent | StageMoveEvent
         | StageRebuildEvent)
Line = Event | ReadyLine

_EVENT_TYPES: dict[str, type[Event]] = {
    "round": RoundEvent,
    "heal": HealEvent,
    "leave": LeaveEvent,
    "step": StepEvent,
    "stage_step": StageStepEvent,
    "stage_round": StageRoundEvent,
    "stage_move": StageMoveEvent,
    "stage_rebuild": StageRebuildEvent,
}


def _jsonable(value: Any) -> Any:
    # JSON has no NaN/Inf: a diverged loss is reported as null rather than as invalid JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, tuple):
        return list(value)
    return value


def to_json(event: Event) -> str:
    """One compact JSON object, `event` first."""
    body = {k: _jsonable(v) for k, v in asdict(event).items() if k != "event"}
    return json.dumps({"event": event.event, **body}, separators=(", ", ": "))


def format_ready(info: dict[str, Any]) -> str:
    return READY_PREFIX + json.dumps(info, separators=(", ", ": "))


_LIST_FIELDS = ("members", "stage_latency_s", "lost_reasons", "capacity_per_s", "load", "sources", "weights")


def _build(cls: type[Event], obj: dict[str, Any]) -> Event:
    fields = {k: v for k, v in obj.items() if k != "event"}
    for name in _LIST_FIELDS:
        if name in fields:
            if not isinstance(fields[name], list):
                raise EventError(f"{obj.get('event')} event: {name!r} must be a list, got {fields[name]!r}")
            fields[name] = tuple(fields[name])
    try:
        return cls(**fields)
    except TypeError as e:
        raise EventError(f"{obj.get('event')} event has wrong fields: {e}") from e


def parse_line(line: str) -> Line | None:
    """Parse one stdout line: a ReadyLine, an event, or None for any other (free-form) line."""
    text = line.strip()
    if text.startswith(READY_PREFIX):
        try:
            info = json.loads(text[len(READY_PREFIX):])
        except json.JSONDecodeError as e:
            raise EventError(f"READY line is not followed by JSON: {text[:200]!r}") from e
        if not isinstance(info, dict):
            raise EventError(f"READY payload must be a JSON object: {text[:200]!r}")
        return ReadyLine(info)
    if not text.startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise EventError(f"event line is not valid JSON: {text[:200]!r}") from e
    kind = obj.get("event") if isinstance(obj, dict) else None
    if kind not in _EVENT_TYPES:
        return None
    return _build(_EVENT_TYPES[kind], obj)


class EventWriter:
    """Writes READY and event lines to a stream (stdout), one line each, flushed, thread-safe."""

    def __init__(self, stream: TextIO, *, listeners: Sequence[Callable[[Event], None]] = ()) -> None:
        """`listeners` see every event written, after its line (a Tally: the peer's stats and metrics)."""
        self._stream = stream
        self._lock = threading.Lock()
        self._gone = False  # the stream's reader went away: lines are dropped
        self.listeners = list(listeners)

    def ready(self, info: dict[str, Any]) -> None:
        self._write(format_ready(info))

    def emit(self, event: Event) -> None:
        self._write(to_json(event))
        for listen in self.listeners:
            listen(event)

    def _write(self, line: str) -> None:
        with self._lock:
            if self._gone:
                return
            try:
                self._stream.write(line + "\n")
                self._stream.flush()
            except (BrokenPipeError, ValueError) as e:  # the reader went away (a closed pipe), or the stream closed
                self._reader_gone(e)

    def _reader_gone(self, error: Exception) -> None:
        """Drop this line and every later one, say so once, and point the stream's descriptor at /dev/null: the
        interpreter's own flush at exit would fail on the dead pipe too. The process goes on (a training peer
        must not stop because its log reader died), and leaves as it would have."""
        self._gone = True
        log.warning("the reader of this process's event lines went away (%s): lines are dropped from now on", error)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            fd = self._stream.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)

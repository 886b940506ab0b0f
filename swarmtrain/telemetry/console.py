"""One peer's progress for a person at a terminal (stderr): a status line at a bounded rate, one line per event.

The console renders from what the peer already produces: its READY payload and event objects
(through `ConsoleEventWriter`, which writes the stdout lines exactly as `EventWriter` does) and
the worker's per-step `InnerStep` records. On a terminal the status line is redrawn in place and
cleared before any other line (events, log records) is written; elsewhere it is a plain line.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

from swarmtrain.telemetry.events import Event, EventWriter, HealEvent, LeaveEvent, RoundEvent
from swarmtrain.telemetry.progress import format_bytes

if TYPE_CHECKING:
    import torch

    from swarmtrain.diloco.worker import InnerStep

__all__ = ["ConsoleEventWriter", "ConsoleProgress", "format_event", "format_ready_info"]

CLEAR_LINE = "\r\x1b[K"  # carriage return, then erase to the end of the line
DEFAULT_WIDTH = 120  # columns when the stream's terminal size cannot be read


class ConsoleProgress:
    """Renders a peer's progress on `stream`; `on_step` and `on_event` may be called from any thread.

    `in_place`: redraw one status line (a terminal) instead of writing a new line per update.
    `interval_s`: at most one status update per interval; events are written when they happen.
    """

    def __init__(self, stream: TextIO, *, in_place: bool, interval_s: float = 1.0, width: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self._stream = stream
        self._in_place = in_place
        self._interval_s = interval_s
        self._width = width
        self._clock = clock
        self._lock = threading.Lock()
        self._status_shown = False
        self._last_status_at = -math.inf
        self._last_round: RoundEvent | None = None
        # The steps since the last status line: their mean loss and token rate.
        self._loss_sum: torch.Tensor | None = None
        self._num_steps = 0
        self._tokens = 0
        self._step_s = 0.0

    # ------------------------------------------------------------------ inputs

    def on_step(self, step: InnerStep) -> None:
        """One inner step (the worker's training thread); a status line at most every `interval_s`."""
        with self._lock:
            self._loss_sum = step.loss if self._loss_sum is None else self._loss_sum + step.loss
            self._num_steps += 1
            self._tokens += step.tokens
            self._step_s += step.step_s
            now = self._clock()
            if now - self._last_status_at < self._interval_s:
                return
            self._last_status_at = now
            line = self._status_line(step)
            self._loss_sum, self._num_steps, self._tokens, self._step_s = None, 0, 0, 0.0
            self._write_status(line)

    def on_ready(self, info: dict[str, Any]) -> None:
        self._write_line(format_ready_info(info))

    def on_event(self, event: Event) -> None:
        with self._lock:
            if isinstance(event, RoundEvent):
                self._last_round = event
        self._write_line(format_event(event))

    # ------------------------------------------------------------------ output

    def clear_status(self) -> None:
        """Erase the in-place status line, so that the next line another writer prints starts clean."""
        with self._lock:
            self._clear_locked()

    @contextlib.contextmanager
    def active(self) -> Iterator[ConsoleProgress]:
        """While active, records of the root logger's handlers on this stream first clear the status line."""
        guard = _ClearStatusFilter(self)
        handlers = [h for h in logging.getLogger().handlers
                    if isinstance(h, logging.StreamHandler) and h.stream is self._stream]
        for h in handlers:
            h.addFilter(guard)
        try:
            yield self
        finally:
            for h in handlers:
                h.removeFilter(guard)
            self.clear_status()

    def _status_line(self, step: InnerStep) -> str:
        if step.span_s is None:
            where = f"step {step.step}/{step.max_steps}"
        else:
            where = f"step {step.step}, {step.compute_s:.1f}/{step.span_s:.1f} s"
        parts = [f"round {step.round}", where]
        if self._loss_sum is not None and self._num_steps:
            parts.append(f"loss {float(self._loss_sum) / self._num_steps:.3f}")  # waits for the device, once per line
        if self._step_s > 0:
            parts.append(f"{_si(self._tokens / self._step_s)} tok/s")
        if self._last_round is not None:
            parts.append(f"last round sent {format_bytes(self._last_round.bytes_sent)} "
                         f"recv {format_bytes(self._last_round.bytes_received)}")
        return " | ".join(parts)

    def _write_status(self, line: str) -> None:
        if self._in_place:
            width = self._columns() - 1  # a line that wraps could not be redrawn in place
            self._stream.write(CLEAR_LINE + line[:width])
            self._status_shown = True
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def _write_line(self, line: str) -> None:
        with self._lock:
            self._clear_locked()
            self._stream.write(line + "\n")
            self._stream.flush()

    def _clear_locked(self) -> None:
        if self._status_shown:
            self._stream.write(CLEAR_LINE)
            self._stream.flush()
            self._status_shown = False

    def _columns(self) -> int:
        if self._width is not None:
            return self._width
        try:
            return os.get_terminal_size(self._stream.fileno()).columns
        except (OSError, ValueError):
            return DEFAULT_WIDTH


class _ClearStatusFilter(logging.Filter):
    """Lets every record through after clearing the console's status line (filters run before a handler writes)."""

    def __init__(self, console: ConsoleProgress) -> None:
        super().__init__()
        self._console = console

    def filter(self, record: logging.LogRecord) -> bool:
        self._console.clear_status()
        return True


class ConsoleEventWriter(EventWriter):
    """An EventWriter whose lines also go to a ConsoleProgress; the stream gets exactly EventWriter's bytes."""

    def __init__(self, stream: TextIO, console: ConsoleProgress) -> None:
        super().__init__(stream)
        self.console = console

    def ready(self, info: dict[str, Any]) -> None:
        super().ready(info)
        self.console.on_ready(info)

    def emit(self, event: Event) -> None:
        super().emit(event)
        self.console.on_event(event)


def format_ready_info(info: dict[str, Any]) -> str:
    """The READY payload of a peer as one line."""
    params = info.get("num_params")
    return (f"ready: peer {info.get('peer_id', '?')} of run {info.get('run_id', '?')} at round {info.get('round', '?')}"
            f" | endpoint {info.get('endpoint', '?')}"
            + (f" | {_si(params)} params" if isinstance(params, int) else ""))


def format_event(event: Event) -> str:
    """One line per round outcome, heal or leave."""
    if isinstance(event, RoundEvent):
        return _format_round(event)
    if isinstance(event, HealEvent):
        return (f"healed: round {event.from_round} -> {event.to_round} from {event.source} "
                f"| hash {event.hash[:12]} | {event.transfer_s:.1f} s")
    assert isinstance(event, LeaveEvent), event
    parts = [f"left at round {event.round}: {event.reason}"]
    if event.hash:
        parts.append(f"hash {event.hash[:12]}")
    if event.checkpoint:
        parts.append(f"checkpoint {event.checkpoint}")
    if event.bytes_sent or event.bytes_received:
        parts.append(f"sent {format_bytes(event.bytes_sent)} recv {format_bytes(event.bytes_received)}")
    return " | ".join(parts)


def _format_round(e: RoundEvent) -> str:
    outcome = "committed" if e.committed else "aborted"
    if e.reason:
        outcome += f" ({e.reason})"
    members = len(e.members)
    parts = [f"round {e.round} {outcome}", f"{members} member{'' if members == 1 else 's'}"]
    if e.loss is not None:
        parts.append(f"loss {e.loss:.3f}")
    if e.val_loss is not None:
        parts.append(f"val {e.val_loss:.3f}")
    if e.val_bpb is not None:
        parts.append(f"{e.val_bpb:.3f} bpb")
    parts += [f"hash {e.hash[:12]}", f"sent {format_bytes(e.bytes_sent)} recv {format_bytes(e.bytes_received)}",
              f"compute {e.compute_s:.1f} s comm {e.comm_s:.1f} s"]
    return " | ".join(parts)


def _si(value: float) -> str:
    """18234 -> '18.2k', 850.4 -> '850' (k, M, G)."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"

"""A swarm's progress from its peers' event lines: per-round summaries (agreement of hashes, loss, bytes)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from swarmtrain.telemetry.events import HealEvent, LeaveEvent, Line, RoundEvent

__all__ = ["RoundSummary", "SwarmProgress", "format_bytes", "format_round"]


@dataclass(frozen=True)
class RoundSummary:
    """Every peer's report of one round (peer name -> event)."""

    round: int
    reports: dict[str, RoundEvent]

    @property
    def committed(self) -> dict[str, RoundEvent]:
        return {name: e for name, e in self.reports.items() if e.committed}

    @property
    def hashes(self) -> set[str]:
        return {e.hash for e in self.committed.values()}

    @property
    def agree(self) -> bool:
        """All committed peers hold the same θ_global (vacuously true when none committed)."""
        return len(self.hashes) <= 1

    @property
    def loss(self) -> float | None:
        return _mean([e.loss for e in self.reports.values()])

    @property
    def val_loss(self) -> float | None:
        return _mean([e.val_loss for e in self.committed.values()])

    @property
    def bytes_sent(self) -> int:
        return sum(e.bytes_sent for e in self.reports.values())


def _mean(values: Sequence[float | None]) -> float | None:
    finite = [v for v in values if v is not None]
    return statistics.fmean(finite) if finite else None


@dataclass
class SwarmProgress:
    """Collects event lines from named peers; a round is complete once every active peer passed it
    (committed it, healed past it, or reported a later round)."""

    peers: Sequence[str]
    rounds: dict[int, dict[str, RoundEvent]] = field(default_factory=dict)
    latest: dict[str, int] = field(default_factory=dict)  # peer -> newest round it committed or healed past
    left: dict[str, LeaveEvent] = field(default_factory=dict)
    heals: list[tuple[str, HealEvent]] = field(default_factory=list)
    _emitted: int = -1  # rounds <= this were already returned as complete

    def add(self, peer: str, line: Line) -> list[RoundSummary]:
        """Record one line from `peer`; return the rounds it completed, oldest first."""
        if isinstance(line, RoundEvent):
            self.rounds.setdefault(line.round, {})[peer] = line
            # An aborted attempt is not the round's end on that peer: it retries (or heals past it).
            passed = line.round if line.committed else line.round - 1
            self.latest[peer] = max(self.latest.get(peer, -1), passed)
        elif isinstance(line, HealEvent):
            self.heals.append((peer, line))
            self.latest[peer] = max(self.latest.get(peer, -1), line.to_round - 1)
        elif isinstance(line, LeaveEvent):
            self.left[peer] = line
        return self._complete(final=False)

    def peer_exited(self, peer: str) -> list[RoundSummary]:
        """A peer is gone (exited or killed): rounds no longer wait for it."""
        self.left.setdefault(peer, LeaveEvent(round=self.latest.get(peer, -1), reason="exited"))
        return self._complete(final=False)

    def finish(self) -> list[RoundSummary]:
        """All rounds not returned yet, complete or not."""
        return self._complete(final=True)

    @property
    def done(self) -> bool:
        return all(p in self.left for p in self.peers)

    def _complete(self, *, final: bool) -> list[RoundSummary]:
        active = [p for p in self.peers if p not in self.left]
        out: list[RoundSummary] = []
        for r in sorted(k for k in self.rounds if k > self._emitted):
            if not final and any(self.latest.get(p, -1) < r for p in active):
                break
            out.append(RoundSummary(r, dict(self.rounds[r])))
            self._emitted = r
        return out


def format_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def format_round(s: RoundSummary, *, num_peers: int, elapsed_s: float) -> str:
    """One line of the live view."""
    loss = f"{s.loss:.3f}" if s.loss is not None else "  -  "
    val = f"{s.val_loss:.3f}" if s.val_loss is not None else "  -  "
    if not s.committed:
        agree = "aborted"
    elif s.agree:
        agree = f"hashes agree ({next(iter(s.hashes))[:12]})"
    else:
        agree = f"HASHES DIFFER: {sorted(h[:12] for h in s.hashes)}"
    return (f"round {s.round:3d} | committed {len(s.committed)}/{num_peers} | loss {loss} | val {val} | "
            f"{agree} | sent {format_bytes(s.bytes_sent)} | t={elapsed_s:5.1f}s")

"""The outer round as one state machine: pure code, an injected clock, no I/O.

The DiLoCo worker role (roles/worker.py, and peer/overlap.py under `diloco.overlap`) asks `next()` for an
action, performs it (inner steps, matchmaking and the all-reduce, a state download, a wait) and
reports how it went through one event method; the machine decides what comes next. Its phases:

    TRAINING ──Δ──> MATCHING ──group──> REDUCING ──> COMMITTED ──> TRAINING (next round)
        ^              │                    │
        │              └─no group───────────┴──> ABORTED ──> HEALING (swarm ahead, or θ hash differs)
        │                                            │   └──> WAITING (until the missed attempt ends
        └──────── resynchronised / healed <──────────┘               or the swarm passes the round)

What it decides:
* the heal check: at the top of every round except right after a commit (nobody can be past a
  round the peer just committed), and right after an abort that named the group's θ hash;
* retries: a trained Δ is averaged again after an aborted attempt (never retrained), unless the
  peer healed meanwhile; after a local fault (a NaN Δ, a codec error, an exception in its own
  all-reduce) the round's progress is dropped (the daemon resynchronises θ_local) and the round
  is trained again after a heal check;
* backoff: after an abort the peer waits until the aborted attempt can no longer commit without it
  (`retry_at`, from matchmaking's fence) or the swarm passes the round, whichever is first;
* the end: `rounds` committed (then the daemon lingers for stragglers), or a stop.

Under `diloco.overlap` the average of round r runs in the background while round r+1 trains
(`Launch`, then `Settle`); an abort keeps those steps and the aborted Δ in θ_local, and the next
attempt sends them together.

Safety does not live here: it is the decision among the round's voters (round/ballots.py, acceptor.py;
docs/protocol.md#the-decision), which holds whatever this machine or a clock does. The machine is about
liveness and about never averaging a Δ taken from a θ_global the swarm no longer holds. Every phase change
is reported as one `Transition`.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TypeVar

__all__ = [
    "Action", "Average", "Finish", "Heal", "Launch", "Phase", "RoundMachine", "RoundMachineError", "Settle", "Train",
    "Transition",
    "Wait",
]


class Phase(enum.StrEnum):
    STARTING = "starting"
    TRAINING = "training"
    MATCHING = "matching"
    REDUCING = "reducing"
    COMMITTED = "committed"
    ABORTED = "aborted"
    HEALING = "healing"
    WAITING = "waiting"
    DONE = "done"


@dataclass(frozen=True)
class Heal:
    """Look for live peers ahead (or, with `want_hash`, holding that θ_global) and adopt their state;
    report with `healed`. Under overlap, a heal of at most `keep_progress_rounds` keeps unsent steps."""

    want_hash: str = ""
    keep_progress_rounds: int = 0


@dataclass(frozen=True)
class Train:
    """Run round `round`'s inner steps and take Δ; report with `trained` (or `stopped`)."""

    round: int


@dataclass(frozen=True)
class Average:
    """Average the trained Δ of `round` (matchmaking, then the all-reduce) and apply a commit; report
    with `matched` when a group forms, then `averaged` (or `failed` for a fault of this peer's own).
    `attempt` counts this peer's tries at the round, from 0."""

    round: int
    attempt: int


@dataclass(frozen=True)
class Launch:
    """Overlap: start averaging round `round`'s Δ in the background; report with `launched`."""

    round: int
    attempt: int


@dataclass(frozen=True)
class Settle:
    """Overlap: conclude the average in flight; with `train_meanwhile`, run the next round's inner
    steps until it lands. Report with `averaged`."""

    round: int
    train_meanwhile: bool


@dataclass(frozen=True)
class Wait:
    """Wait until `until` (swarm clock) or, with `watch`, until a live peer is past `round`; report with
    `waited`."""

    round: int
    until: float
    watch: bool = True


@dataclass(frozen=True)
class Finish:
    """Stop the round loop: "done" (every round committed; linger for stragglers) or "signal"."""

    reason: str


Action = Heal | Train | Average | Launch | Settle | Wait | Finish
ActionT = TypeVar("ActionT", bound=Action)


@dataclass(frozen=True)
class Transition:
    """One phase change, as logged: `at` is the swarm clock, `attempt` this peer's try at the round."""

    round: int
    attempt: int
    source: Phase
    target: Phase
    reason: str
    at: float

    def line(self) -> str:
        """One JSON object on one line (`event` = "transition")."""
        return json.dumps({"event": "transition", **asdict(self), "at": round(self.at, 3)}, ensure_ascii=False)


class RoundMachineError(RuntimeError):
    """An event arrived that the current action does not expect (a bug in the daemon driving it)."""


class RoundMachine:
    """See the module docstring. `round` mirrors the worker's round (θ_global's round)."""

    def __init__(self, *, round_index: int, rounds: int, clock: Callable[[], float], overlap: bool = False,
                 unsent: bool = False, on_transition: Callable[[Transition], None] | None = None) -> None:
        """`unsent`: θ_local already holds trained steps no average carries (a peer resumed under overlap)."""
        self.round = round_index
        self.rounds = rounds
        self.clock = clock
        self.overlap = overlap
        self.on_transition = on_transition
        self.phase = Phase.STARTING
        self.attempt = 0
        self._delta_round: int | None = None  # classic: the round whose Δ is trained and not yet committed
        self._unsent = unsent  # overlap: θ_local holds steps no average carries yet
        self._in_flight = False  # overlap: an average runs in the background
        self._skip_heal_check = False  # right after a commit
        self._retry_at = 0.0  # of the last aborted attempt
        self._stop = False
        self._next: Action = self._top()

    # ------------------------------------------------------------------ driving

    def next(self) -> Action:
        """The action to perform now. After a stop request: conclude an average in flight, then Finish."""
        action = self._next
        if self._stop and not isinstance(action, Finish):
            action = Settle(self.round, train_meanwhile=False) if self._in_flight else Finish("signal")
            self._next = action
        if isinstance(action, Train):
            self._enter(Phase.TRAINING)
        elif isinstance(action, Average | Launch):
            self._enter(Phase.MATCHING)
        elif isinstance(action, Wait):
            self._enter(Phase.WAITING, f"until {action.until:.3f} or the swarm passes round {action.round}")
        elif isinstance(action, Finish):
            self._enter(Phase.DONE, action.reason)
        return action

    def request_stop(self) -> None:
        self._stop = True

    def set_unsent(self, unsent: bool) -> None:
        """Overlap: θ_local holds trained steps no average carries (a resumed peer), before the first action."""
        if self.phase != Phase.STARTING:
            raise RoundMachineError("set_unsent after the machine started")
        self._unsent = unsent
        self._next = self._top()

    # ------------------------------------------------------------------ events

    def stopped(self) -> None:
        """The action was cut short by a stop (inner steps, a wait)."""
        self._stop = True
        self._next = Finish("signal")

    def healed(self, *, round_index: int | None, kept_progress: bool = False, source: str = "") -> None:
        """A `Heal` ended: `round_index` is the round adopted from `source`, or None when none was."""
        action = self._expect(Heal)
        if round_index is not None:
            self._enter(Phase.HEALING, f"from {source} at round {round_index}")
            self._new_round(round_index)
            if not kept_progress:
                self._unsent = False
            self._next = self._decide()
        elif action.want_hash:  # left out for its θ and no donor delivered: wait out the attempt
            self._next = self._wait()
        elif self._retry_at > self.clock():
            # A wait ended early (a peer looked past the round) and the heal found nothing to take (no donor
            # reached, or another read shows nobody ahead): the fence is waited out, not watched again, or
            # two views of a stale or partitioned DHT would make the peer attempt the round back to back.
            self._next = Wait(self.round, self._retry_at, watch=False)
        else:
            self._next = self._decide()

    def trained(self, *, problem: str = "") -> None:
        """`Train` ended with Δ; `problem` says why Δ is unusable (non-finite), "" when it is fine."""
        self._expect(Train)
        if problem:
            self._abort_locally(problem)
        elif self.overlap:
            self._unsent = True
            self._next = Launch(self.round, self.attempt)
        else:
            self._delta_round = self.round
            self._next = Average(self.round, self.attempt)

    def matched(self, *, group: str) -> None:
        """The round's group formed (`group`: an id or member list, for the log); the all-reduce starts."""
        if self.phase == Phase.MATCHING:
            self._enter(Phase.REDUCING, group)

    def launched(self, *, problem: str = "") -> None:
        """Overlap: the background average started, or (`problem`) Δ was unusable."""
        self._expect(Launch)
        if problem:
            self._abort_locally(problem)
            return
        self._unsent, self._in_flight = False, True
        self._next = Settle(self.round, train_meanwhile=self.round + 1 < self.rounds)

    def averaged(self, *, committed: bool, reason: str = "", retry_at: float = 0.0, heal_to_hash: str = "",
                 trained_meanwhile: bool = False) -> None:
        """The round's average ended: committed (the daemon applied the mean), or aborted with `reason`;
        `retry_at` (swarm clock) fences the next attempt, `heal_to_hash` names the group's θ_global when
        this peer was left out for holding another. Overlap: `trained_meanwhile` = the next round's steps ran."""
        self._expect(Average if not self.overlap else Settle)
        self._in_flight = False
        if trained_meanwhile:
            self._unsent = True
        if committed:
            self._enter(Phase.COMMITTED, reason)
            self._new_round(self.round + 1)
            self._skip_heal_check = True
            if self.overlap and self._unsent and not self._stop and self.round < self.rounds:
                self._next = Launch(self.round, self.attempt)  # the steps trained meanwhile go out now
            else:
                self._next = self._top()
            return
        self._enter(Phase.ABORTED, reason)
        self.attempt += 1
        self._retry_at = retry_at
        if self.overlap:
            self._unsent = True  # the aborted Δ went back into θ_local
        self._next = Heal(want_hash=heal_to_hash) if heal_to_hash else self._wait()

    def failed(self, *, reason: str) -> None:
        """This peer's own side of the average failed (a codec error, a bug): its round's progress is
        dropped (the daemon resynchronises θ_local from θ_global) and the round trained again."""
        self._expect(Average)
        self._abort_locally(f"local error: {reason}")

    def waited(self) -> None:
        """A `Wait` ended (its time passed or the swarm moved past the round): check for a heal, retry."""
        self._expect(Wait)
        self._next = self._top()

    # ------------------------------------------------------------------ decisions

    def _top(self) -> Action:
        """The top of a round: a heal check unless the peer just committed, then `_decide`."""
        if self._skip_heal_check:
            self._skip_heal_check = False
            return self._decide()
        return Heal(keep_progress_rounds=1 if self.overlap else 0)

    def _decide(self) -> Action:
        if self.round >= self.rounds:
            return Finish("done")
        if self.overlap:
            return Launch(self.round, self.attempt) if self._unsent else Train(self.round)
        if self._delta_round == self.round:
            return Average(self.round, self.attempt)  # the same Δ again: never retrained
        return Train(self.round)

    def _wait(self) -> Action:
        if self._retry_at > self.clock():
            return Wait(self.round, self._retry_at)
        return self._top()

    def _abort_locally(self, reason: str) -> None:
        self._enter(Phase.ABORTED, reason)
        self._delta_round, self._unsent, self._skip_heal_check = None, False, False
        self.attempt += 1
        self._next = self._top()

    def _new_round(self, round_index: int) -> None:
        if round_index != self.round:
            self.attempt, self._retry_at = 0, 0.0
        self.round = round_index
        self._delta_round = None

    def _expect(self, kind: type[ActionT]) -> ActionT:
        if not isinstance(self._next, kind):
            raise RoundMachineError(f"event for {kind.__name__} while the current action is {self._next!r}")
        return self._next

    def _enter(self, phase: Phase, reason: str = "") -> None:
        if phase == self.phase:
            return
        transition = Transition(round=self.round, attempt=self.attempt, source=self.phase, target=phase,
                                reason=reason, at=self.clock())
        self.phase = phase
        if self.on_transition is not None:
            self.on_transition(transition)

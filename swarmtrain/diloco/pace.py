"""Round pace (`diloco.pace`): how many inner steps a peer takes in a round, or for how long it trains.

With "steps" every peer takes H = `diloco.inner_steps` steps, and a synchronous round waits for
the slowest peer. With "time" every member of a round's group trains the next round for the same
span, H / (the group's median announced step rate), so the swarm still takes about H steps per
peer but nobody waits: a faster peer takes more steps, a slower one fewer. The span comes from the
group's records, which are identical on every member, so every member computes the same span. The
median, not the mean, so that one member announcing an absurd rate cannot stretch or shrink every
round. The mean Δ stays unweighted: Δ is a sum over a peer's steps, so a peer with more steps
already moves the mean more, in proportion to the tokens it trained.

Equal spans of compute do not end at equal times: each round also holds each peer's own idle time
(hand-offs, a last step past the span, a core shared with others), so the members' sends drift apart
like a random walk until the earliest one waits for the mean. With `diloco.pace_align` = g each
member announces in its match entry how long its last committed round's mean took to come back after
its Δ (`comm_s`, on its own clock: no clock sync is involved). That time is the same landing moment
minus each member's send, so a member whose time was longer than the group's median sent earlier than
the median member by about the difference; it lengthens its next span by g times it (shortens, when
shorter), capped at a quarter of the span. Its announcement reaches the others one round later and the
shift applies to the round under way when the commit lands, two rounds after the send it corrects. With
that delay any g below 1 damps a one-off offset, and a steady drift of v a round (a peer with more idle
time every round) settles at an offset of v / g instead of growing: g = 0.5 is a good middle.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from swarmtrain.config import DilocoConfig
from swarmtrain.diloco.averager import AverageResult

__all__ = ["PACE_ALIGN_MAX_SHARE", "PACE_MAX_STEPS_FACTOR", "PREMATCH_LEAD_S", "Pace", "RoundBudget", "align_shift",
           "span_from_rates"]

log = logging.getLogger(__name__)

PACE_MAX_STEPS_FACTOR = 4  # with pace "time", a peer takes at most this many times H steps in a round
# With pace "time" a peer enters matchmaking this long before its span ends (at most a quarter of the
# span), so the round's group is formed while its last inner steps run; every member ends its span
# within a step of the others, so none of them waits long for the others' shards.
PREMATCH_LEAD_S = 1.0
PACE_ALIGN_MAX_SHARE = 0.25  # `diloco.pace_align` shifts a span by at most this share of it


@dataclass
class RoundBudget:
    """One round's inner steps: at most `max_steps`, and with a span, until `span_s` of compute is spent.

    A timed round ends at the step boundary nearest the span: it stops once another step (at the
    round's mean step time so far) would end further past the span than stopping now falls short.
    """

    max_steps: int
    span_s: float | None = None
    steps: int = 0
    compute_s: float = 0.0
    # (compute_s, call): `add` calls it once, on the training thread, when that much compute is spent
    alarm: tuple[float, Callable[[], None]] | None = field(default=None, repr=False)
    # `add` calls it once, on the training thread, after the first step: the round's length is known then
    first_step: Callable[[RoundBudget], None] | None = field(default=None, repr=False)

    def add(self, *, steps: int, compute_s: float) -> None:
        self.steps += steps
        self.compute_s += compute_s
        if self.first_step is not None:
            first, self.first_step = self.first_step, None
            first(self)
        if self.alarm is not None and self.compute_s >= self.alarm[0]:
            call, self.alarm = self.alarm[1], None
            call()

    def left_s(self) -> float:
        """Compute seconds this round's steps should still take, at their mean step time so far (0 before one)."""
        if not self.steps:
            return 0.0
        at_rate = self.steps_left() * self.compute_s / self.steps
        return at_rate if self.span_s is None else min(at_rate, max(0.0, self.span_s - self.compute_s))

    def set_alarm(self, at_s: float, call: Callable[[], None]) -> None:
        """Have `add` call `call` once the round's compute reaches `at_s` (the step that crosses it calls
        it, between two steps): a time-paced round starts matchmaking without ending its training call."""
        self.alarm = (at_s, call)

    def match_at_s(self) -> float | None:
        """Compute time after which matchmaking starts (None: at the end of the round's steps)."""
        if self.span_s is None:
            return None
        return self.span_s - min(PREMATCH_LEAD_S, self.span_s / 4)

    def rate(self) -> float:
        """Inner steps per second so far (0 before the first step)."""
        return self.steps / self.compute_s if self.steps and self.compute_s > 0 else 0.0

    def resize(self, other: RoundBudget) -> None:
        """Take `other`'s limits, keeping what was spent (a span learned mid-round applies to it)."""
        self.max_steps, self.span_s = other.max_steps, other.span_s

    def cut_to(self, span_s: float) -> None:
        """End the round after at most `span_s` of compute (a peer joining a round already under way)."""
        self.span_s = span_s if self.span_s is None else min(self.span_s, span_s)

    def steps_left(self) -> int:
        if self.steps >= self.max_steps:
            return 0
        if self.span_s is not None and self.steps and self.compute_s * (1 + 0.5 / self.steps) >= self.span_s:
            return 0
        return self.max_steps - self.steps


def span_from_rates(rates: Sequence[float], *, inner_steps: int) -> float | None:
    """The time-paced round span: `inner_steps` at the members' median rate (None: no rate known)."""
    known = [r for r in rates if r > 0]
    if not known:
        return None
    return inner_steps / statistics.median(known)


def align_shift(own_lag_s: float, lags_s: Sequence[float], *, gain: float, span_s: float) -> float:
    """Seconds to add to this member's next span (`diloco.pace_align`): `gain` × (its announced lag − the
    group's median lag), capped at `PACE_ALIGN_MAX_SHARE` of the span; 0 unless it and one other announced one."""
    known = [x for x in lags_s if x > 0]
    if own_lag_s <= 0 or len(known) < 2:
        return 0.0
    cap = PACE_ALIGN_MAX_SHARE * span_s
    return max(-cap, min(cap, gain * (own_lag_s - statistics.median(known))))


class Pace:
    """One peer's round budgets: fixed H steps, or a span learned from each committed round's group."""

    def __init__(self, cfg: DilocoConfig) -> None:
        self.inner_steps = cfg.round_steps  # a round's H: inner_steps / fragments
        self.timed = cfg.pace == "time"
        self.span_s: float | None = None  # None until a committed round announced rates: H steps then
        self.last_rate = 0.0  # steps/s over this peer's last whole round (0: none trained yet)
        self.align = cfg.pace_align if self.timed else 0.0
        self.lag_s = 0.0  # how long this peer's last committed mean took after its Δ: announced (pace_align)
        self.shift_s = 0.0  # added to this peer's span (pace_align)

    def prematch_rate(self, budget: RoundBudget) -> float:
        """The rate to announce when matching before the round's steps are done: the last whole
        round's. The part of a round before matchmaking runs faster than its last second, during
        which matchmaking competes for the CPU; spans sized from that part came out ~2% short."""
        return self.last_rate or budget.rate()

    def expected_round_s(self) -> float:
        """Compute seconds this peer's next round should take (0: unknown): the span, else H at its last rate."""
        if self.timed and self.span_s is not None:
            return self.span_s + self.shift_s
        return self.inner_steps / self.last_rate if self.last_rate > 0 else 0.0

    def budget(self) -> RoundBudget:
        if not self.timed or self.span_s is None:
            return RoundBudget(max_steps=self.inner_steps)
        return RoundBudget(max_steps=PACE_MAX_STEPS_FACTOR * self.inner_steps, span_s=self.span_s + self.shift_s)

    def observe(self, result: AverageResult, *, peer_id: str = "", comm_s: float = 0.0) -> None:
        """Learn the next rounds' span from a committed round's group (kept when it announced none), and with
        `pace_align` this peer's (`peer_id`) shift from the lags its members announced; `comm_s` is how long
        this round's mean took here, the lag to announce next."""
        if not self.timed or not result.committed:
            return
        span = span_from_rates(result.steps_per_s, inner_steps=self.inner_steps)
        if span is not None:
            self.span_s = span
            log.debug("round %d: next rounds train for %.3fs (median of %d rates)", result.round, span,
                      len(result.steps_per_s))
        if self.align and self.span_s is not None:  # a round without lags resets the shift: no stale correction
            lags = result.lags_s if len(result.lags_s) == len(result.members) else ()
            own = dict(zip(result.members, lags, strict=False)).get(peer_id, 0.0)  # () when it has none
            self.shift_s = align_shift(own, lags, gain=self.align, span_s=self.span_s)
        if comm_s > 0:
            self.lag_s = comm_s

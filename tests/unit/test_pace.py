"""diloco.pace: the round budget's stopping rule, the span learned from a group, the shift that lines members'
sends up (diloco.pace_align), and train_inner under a budget."""

from __future__ import annotations

import asyncio
import io
import json
import time

import pytest
import torch

from swarmtrain.config import ConfigError, load_config
from swarmtrain.data import ShardedBatches
from swarmtrain.diloco import DilocoWorker
from swarmtrain.diloco.averager import AverageResult
from swarmtrain.diloco.pace import PACE_MAX_STEPS_FACTOR, Pace, RoundBudget, align_shift, span_from_rates
from swarmtrain.discovery import GroupRecord, RecordError
from swarmtrain.discovery.records import decode_record
from swarmtrain.models import build_model
from swarmtrain.peer.part import WorkerPart
from swarmtrain.round.group import Group, Member
from swarmtrain.telemetry.events import EventWriter

pytestmark = pytest.mark.unit


def test_span_is_h_steps_at_the_median_rate_and_ignores_unknown_rates() -> None:
    assert span_from_rates([10.0, 20.0, 40.0], inner_steps=50) == pytest.approx(2.5)
    assert span_from_rates([10.0, 0.0, 30.0], inner_steps=50) == pytest.approx(2.5)  # median of 10 and 30
    assert span_from_rates([10.0, 20.0, 1e12], inner_steps=50) == pytest.approx(2.5), "one absurd rate is outvoted"
    assert span_from_rates([0.0, 0.0], inner_steps=50) is None
    assert span_from_rates([], inner_steps=50) is None


def test_a_timed_budget_stops_at_the_step_boundary_nearest_its_span() -> None:
    b = RoundBudget(max_steps=100, span_s=1.0)
    for _ in range(9):
        b.add(steps=1, compute_s=0.105)
    assert b.steps_left() == 91  # 0.945 s spent: a 10th step ends at 1.05, 0.05 past; stopping is 0.055 short
    b.add(steps=1, compute_s=0.105)
    assert b.steps_left() == 0
    capped = RoundBudget(max_steps=3, span_s=100.0)
    capped.add(steps=3, compute_s=0.3)
    assert capped.steps_left() == 0, "the step cap holds however much span is left"
    plain = RoundBudget(max_steps=5)
    plain.add(steps=4, compute_s=50.0)
    assert plain.steps_left() == 1, "without a span only the step count matters"


def test_the_budget_alarm_fires_once_on_the_step_that_crosses_it() -> None:
    fired: list[tuple[int, float]] = []
    b = RoundBudget(max_steps=100, span_s=1.0)
    b.set_alarm(0.3, lambda: fired.append((b.steps, b.compute_s)))
    b.add(steps=1, compute_s=0.2)
    assert fired == []
    b.add(steps=1, compute_s=0.2)
    assert fired == [(2, pytest.approx(0.4))] and b.alarm is None
    b.add(steps=1, compute_s=0.2)
    assert len(fired) == 1, "once"


def test_a_training_call_runs_through_the_alarm() -> None:
    worker = _worker()
    budget = RoundBudget(max_steps=4, span_s=1e9)
    steps_seen: list[int] = []
    budget.set_alarm(0.0, lambda: steps_seen.append(budget.steps))
    stats = worker.train_inner(4, budget=budget)
    assert stats.steps == 4 and steps_seen == [1], "the alarm rang after the first step and the call went on"


def test_between_runs_after_every_step_but_the_last_can_end_the_call_and_is_not_compute() -> None:
    worker = _worker()
    calls: list[int] = []

    def between() -> bool:
        calls.append(budget.steps)
        time.sleep(0.05)  # far longer than a step of the tiny model
        return len(calls) == 3

    budget = RoundBudget(max_steps=10, span_s=1e9)
    stats = worker.train_inner(10, budget=budget, between=between)
    assert calls == [1, 2, 3] and stats.steps == 3, "after steps 1, 2 and 3; True after the third ends the call"
    assert stats.compute_s < 0.1 and budget.compute_s < 0.1, (stats.compute_s, budget.compute_s)
    calls.clear()
    stats = worker.train_inner(2, between=lambda: calls.append(0) is not None)
    assert stats.steps == 2 and calls == [0], "not after the call's last step"


def _committed(rates: tuple[float, ...], *, committed: bool = True) -> AverageResult:
    members = tuple(f"p{i}" for i in range(len(rates)))
    return AverageResult(round=3, committed=committed, mean=None, members=members, steps_per_s=rates)


def test_pace_learns_the_span_from_committed_rounds_only() -> None:
    timed = Pace(load_config(overrides=["diloco.pace=time", "diloco.inner_steps=10"]).diloco)
    assert timed.budget() == RoundBudget(max_steps=10), "H steps until a round announced rates"
    timed.observe(_committed((4.0, 5.0, 6.0), committed=False))
    assert timed.budget().span_s is None
    timed.observe(_committed((4.0, 5.0, 6.0)))
    assert timed.budget() == RoundBudget(max_steps=PACE_MAX_STEPS_FACTOR * 10, span_s=2.0)
    timed.observe(_committed((0.0, 0.0)))
    assert timed.budget().span_s == 2.0, "a round with no rates keeps the span"
    fixed = Pace(load_config(overrides=["diloco.inner_steps=10"]).diloco)
    fixed.observe(_committed((4.0, 5.0, 6.0)))
    assert fixed.budget() == RoundBudget(max_steps=10)


def test_matching_early_announces_the_last_whole_rounds_rate() -> None:
    pace = Pace(load_config(overrides=["diloco.pace=time"]).diloco)
    budget = RoundBudget(max_steps=200, span_s=10.0)
    budget.add(steps=40, compute_s=5.0)
    assert pace.prematch_rate(budget) == 8.0, "no whole round yet: the rate so far"
    pace.last_rate = 7.5
    assert pace.prematch_rate(budget) == 7.5


def test_the_shift_is_a_share_of_the_lag_past_the_median_capped_at_a_quarter_span() -> None:
    lags = (1.2, 0.4, 0.5, 0.6)  # the first member sent ~0.65 s before the median one
    assert align_shift(1.2, lags, gain=0.25, span_s=4.0) == pytest.approx(0.25 * (1.2 - 0.55))
    assert align_shift(0.4, lags, gain=0.25, span_s=4.0) == pytest.approx(0.25 * (0.4 - 0.55)), "the last: shorter"
    assert align_shift(1.2, lags, gain=1.0, span_s=2.0) == pytest.approx(0.5), "capped at a quarter of the span"
    assert align_shift(0.4, (0.4, 9.0, 9.0), gain=1.0, span_s=2.0) == pytest.approx(-0.5)
    assert align_shift(0.0, lags, gain=0.25, span_s=4.0) == 0.0, "its own lag unknown: no shift"
    assert align_shift(0.7, (0.7, 0.0, 0.0), gain=0.25, span_s=4.0) == 0.0, "nobody else's known: no shift"


def test_an_aligned_pace_shifts_its_own_span_by_its_announced_lag() -> None:
    pace = Pace(load_config(overrides=["diloco.pace=time", "diloco.inner_steps=10", "diloco.pace_align=0.5"]).diloco)
    result = AverageResult(round=3, committed=True, mean=None, members=("a", "me", "z"), steps_per_s=(5.0, 5.0, 5.0),
                           lags_s=(0.5, 1.5, 0.7))
    pace.observe(result, peer_id="me", comm_s=0.9)
    assert pace.shift_s == pytest.approx(0.5 * (1.5 - 0.7)) and pace.lag_s == 0.9, "0.9: announced next"
    assert pace.budget().span_s == pytest.approx(2.0 + 0.4) and pace.expected_round_s() == pytest.approx(2.4)
    pace.observe(AverageResult(round=4, committed=True, mean=None, members=("a", "me"), steps_per_s=(5.0, 5.0)),
                 peer_id="me", comm_s=0.8)
    assert pace.shift_s == 0.0 and pace.lag_s == 0.8, "a round without lags: no stale shift"
    off = Pace(load_config(overrides=["diloco.pace=time", "diloco.inner_steps=10"]).diloco)
    off.observe(result, peer_id="me", comm_s=0.9)
    assert off.shift_s == 0.0 and off.budget().span_s == pytest.approx(2.0), "pace_align = 0: off"
    with pytest.raises(ConfigError, match=r"diloco\.pace_align"):
        load_config(overrides=["diloco.pace_align=1"])


def test_pace_must_be_steps_or_time() -> None:
    with pytest.raises(ConfigError, match=r"diloco\.pace"):
        load_config(overrides=["diloco.pace=fast"])


def test_members_announce_their_rate_and_lag_in_the_signed_group_record() -> None:
    members = (Member("a", "127.0.0.1:1", steps_per_s=12.5, lag_s=0.75), Member("b", "127.0.0.1:2", steps_per_s=0.0))
    record = GroupRecord(run_id="r", round=1, leader_id="a", members=members, window_close_at=5.0)
    assert decode_record(GroupRecord, record.encode(), run_id="r", signer_id="a").members == members
    lying = json.loads(record.encode())
    lying["members"][0]["steps_per_s"] = -3.0
    with pytest.raises(RecordError, match="steps_per_s"):
        decode_record(GroupRecord, json.dumps(lying).encode(), run_id="r", signer_id="a")
    lying["members"][0]["steps_per_s"] = 12.5
    lying["members"][0]["lag_s"] = -0.5
    with pytest.raises(RecordError, match="lag_s"):
        decode_record(GroupRecord, json.dumps(lying).encode(), run_id="r", signer_id="a")
    older = json.loads(record.encode())
    del older["members"][1]["lag_s"]  # a peer from before pace_align announces none: unknown
    assert decode_record(GroupRecord, json.dumps(older).encode(), run_id="r", signer_id="a").members == members
    other = (Member("a", "127.0.0.1:1", steps_per_s=13.0, lag_s=0.75), members[1])
    assert Group("r", 1, members).group_id != Group("r", 1, other).group_id
    other = (Member("a", "127.0.0.1:1", steps_per_s=12.5, lag_s=0.5), members[1])
    assert Group("r", 1, members).group_id != Group("r", 1, other).group_id


def _worker() -> DilocoWorker:
    cfg = load_config(overrides=["model.preset=tiny", "data.seq_len=16", "data.batch_size=2", "diloco.inner_steps=4"])
    tokens = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))
    batches = ShardedBatches(tokens, worker_index=0, num_workers=1, batch_size=2, seq_len=16, seed=0)
    return DilocoWorker(cfg, model=build_model(cfg.model, seed=0), batches=batches, device=torch.device("cpu"))


def test_train_inner_ends_when_its_budget_is_spent_and_counts_every_step() -> None:
    worker = _worker()
    spent = RoundBudget(max_steps=20, span_s=1e-9)
    stats = worker.train_inner(20, budget=spent)
    assert (stats.steps, spent.steps, worker.inner_step) == (1, 1, 1), "at least one step, then the span is spent"
    roomy = RoundBudget(max_steps=5, span_s=1e9)
    stats = worker.train_inner(20, budget=roomy)
    assert (stats.steps, roomy.steps, worker.inner_step) == (5, 5, 6)
    assert roomy.compute_s == pytest.approx(stats.compute_s, rel=0.5)


def test_the_budget_tells_once_after_its_first_step_how_long_the_rest_should_take() -> None:
    told: list[float] = []
    b = RoundBudget(max_steps=5, first_step=lambda budget: told.append(budget.left_s()))
    assert b.left_s() == 0.0, "nothing timed yet"
    b.add(steps=1, compute_s=0.5)
    b.add(steps=1, compute_s=0.5)
    assert told == [pytest.approx(2.0)] and b.first_step is None, "4 steps left at 0.5 s, told once"
    timed = RoundBudget(max_steps=100, span_s=3.0)
    timed.add(steps=1, compute_s=0.5)
    assert timed.left_s() == pytest.approx(2.5), "a span ends the round before its step cap"


@pytest.mark.parametrize("announced", [False, True])
def test_a_peer_announces_the_end_of_its_steps_once_the_first_one_is_timed(announced: bool) -> None:
    """A peer with no end of steps announced (restarted from its checkpoint: its pace is not known yet) announces
    one after its first step, so that the others' matchmaking does not hold its window open for a peer that
    cannot post in time; one that announced its end (from its last round's pace) keeps it."""
    worker = _worker()
    clock = [1000.0]
    part = WorkerPart(worker.cfg, worker=worker, writer=EventWriter(io.StringIO()), pace=Pace(worker.cfg.diloco),
                      val_batches=[], peer_id=lambda: "p0", member=lambda r, rate: None,  # type: ignore[arg-type,return-value]
                      prematch=lambda r, m: None, announce=lambda: None, now=lambda: clock[0], alone_s=lambda: 0.0)
    if announced:
        part.round_ends_at = 1005.0
    stats = asyncio.run(part.train_steps(asyncio.Event()))
    assert stats is not None and stats.steps == 4
    if announced:
        assert part.round_ends_at == 1005.0
    else:  # the first step timed: 3 steps left at its time, from the clock as it read then
        assert 1000.0 < part.round_ends_at < 1000.0 + 3 * stats.compute_s + 1.0, part.round_ends_at

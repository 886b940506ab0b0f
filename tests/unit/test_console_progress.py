"""The peer's console progress: what it prints for a run of events and steps, its rate bound, and
that stdout (the JSON lines) is exactly what it is without it."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from swarmtrain.config import RunConfig
from swarmtrain.data import ShardedBatches, load_corpus
from swarmtrain.diloco import DilocoWorker
from swarmtrain.diloco.flat import flatten
from swarmtrain.diloco.pace import RoundBudget
from swarmtrain.diloco.worker import InnerStep
from swarmtrain.models import build_model
from swarmtrain.telemetry import EventWriter, HealEvent, LeaveEvent, RoundEvent
from swarmtrain.telemetry.console import CLEAR_LINE, ConsoleEventWriter, ConsoleProgress

pytestmark = pytest.mark.unit

HASH = "1a2b3c4d5e6f7a8b9c0d"
READY = {"peer_id": "QmPeerA", "endpoint": "10.0.0.2:7000", "run_id": "demo", "maddrs": ["/ip4/10.0.0.2/tcp/7001"],
         "round": 0, "hash": HASH, "num_params": 1_234_567}
COMMITTED = RoundEvent(round=0, committed=True, members=("QmPeerA", "QmPeerB", "QmPeerC"), loss=3.41234,
                       val_loss=None, hash=HASH, bytes_sent=1_200_000, bytes_received=2_500_000, compute_s=4.81,
                       comm_s=0.93, peer="QmPeerA", steps=50)
ABORTED = RoundEvent(round=1, committed=False, members=("QmPeerA",), loss=3.2, val_loss=None, hash=HASH,
                     bytes_sent=0, bytes_received=0, compute_s=4.7, comm_s=5.0, peer="QmPeerA",
                     reason="only 1 of min_peers=2 joined")
HEAL = HealEvent(from_round=1, to_round=4, source="QmPeerB", hash="ffee" * 5, peer="QmPeerA", transfer_s=2.34)
LEAVE = LeaveEvent(round=20, reason="done", hash=HASH, peer="QmPeerA", checkpoint="/ck/round-20",
                   bytes_sent=4000, bytes_received=0)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _step(step: int, *, loss: float, round_index: int = 0, tokens: int = 256, step_s: float = 0.01,
          max_steps: int = 50, span_s: float | None = None, compute_s: float = 0.0) -> InnerStep:
    return InnerStep(round=round_index, step=step, max_steps=max_steps, span_s=span_s, compute_s=compute_s,
                     tokens=tokens, step_s=step_s, loss=torch.tensor(loss))


def test_a_run_renders_as_lines() -> None:
    out, clock = io.StringIO(), FakeClock()
    console = ConsoleProgress(out, in_place=False, interval_s=1.0, clock=clock)
    console.on_ready(READY)
    console.on_step(_step(1, loss=3.5))
    clock.t += 0.5
    console.on_step(_step(2, loss=3.0))  # within the interval: only counted
    clock.t += 0.5
    console.on_step(_step(3, loss=2.0))
    console.on_event(COMMITTED)
    clock.t += 1.0
    console.on_step(_step(1, loss=2.5, round_index=1, tokens=1000, step_s=0.05))
    console.on_event(ABORTED)
    console.on_event(HEAL)
    console.on_event(LEAVE)
    assert out.getvalue().splitlines() == [
        "ready: peer QmPeerA of run demo at round 0 | endpoint 10.0.0.2:7000 | 1.2M params",
        "round 0 | step 1/50 | loss 3.500 | 25.6k tok/s",
        "round 0 | step 3/50 | loss 2.500 | 25.6k tok/s",  # the mean of steps 2 and 3, their token rate
        "round 0 committed | 3 members | loss 3.412 | hash 1a2b3c4d5e6f | sent 1.2 MB recv 2.5 MB "
        "| compute 4.8 s comm 0.9 s",
        "round 1 | step 1/50 | loss 2.500 | 20.0k tok/s | last round sent 1.2 MB recv 2.5 MB",
        "round 1 aborted (only 1 of min_peers=2 joined) | 1 member | loss 3.200 | hash 1a2b3c4d5e6f "
        "| sent 0 B recv 0 B | compute 4.7 s comm 5.0 s",
        "healed: round 1 -> 4 from QmPeerB | hash ffeeffeeffee | 2.3 s",
        "left at round 20: done | hash 1a2b3c4d5e6f | checkpoint /ck/round-20 | sent 4.0 kB recv 0 B",
    ]


def test_status_lines_are_bounded_in_rate() -> None:
    out, clock = io.StringIO(), FakeClock()
    console = ConsoleProgress(out, in_place=False, interval_s=1.0, clock=clock)
    for i in range(1, 101):  # 32 steps a second: a line at 0 s, 1 s, 2 s and 3 s
        console.on_step(_step(i, loss=1.0, max_steps=100))
        clock.t += 1 / 32
    assert [line.split(" | ")[1] for line in out.getvalue().splitlines()] == [
        "step 1/100", "step 33/100", "step 65/100", "step 97/100"]


def test_a_time_paced_round_shows_its_compute_against_the_span() -> None:
    out = io.StringIO()
    ConsoleProgress(out, in_place=False, clock=FakeClock()).on_step(
        _step(140, loss=2.0, max_steps=200, span_s=19.04, compute_s=12.31))
    assert out.getvalue().startswith("round 0 | step 140, 12.3/19.0 s | loss 2.000")


def test_in_place_status_is_redrawn_and_cleared_before_other_lines() -> None:
    out, clock = io.StringIO(), FakeClock()
    console = ConsoleProgress(out, in_place=True, interval_s=1.0, width=33, clock=clock)
    console.on_step(_step(1, loss=3.5))
    clock.t += 1.0
    console.on_step(_step(2, loss=3.0))
    console.on_event(COMMITTED)
    first, second = "round 0 | step 1/50 | loss 3.500", "round 0 | step 2/50 | loss 3.000"  # cut to width - 1
    assert out.getvalue() == (CLEAR_LINE + first + CLEAR_LINE + second + CLEAR_LINE
                              + "round 0 committed | 3 members | loss 3.412 | hash 1a2b3c4d5e6f | sent 1.2 MB "
                                "recv 2.5 MB | compute 4.8 s comm 0.9 s\n")
    with console.active():
        pass  # nothing shown: leaving writes nothing
    assert out.getvalue().endswith("\n")


def test_log_records_on_the_same_stream_start_on_a_clean_line() -> None:
    out = io.StringIO()
    console = ConsoleProgress(out, in_place=True, width=200, clock=FakeClock())
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("log: %(message)s"))  # no level name: importing hivemind renames them
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with console.active():
            console.on_step(_step(1, loss=3.5))
            logging.getLogger("swarmtrain.test").warning("a peer is slow")
            console.on_step(_step(2, loss=3.5))  # within the interval: not redrawn
        logging.getLogger("swarmtrain.test").warning("after")
    finally:
        root.removeHandler(handler)
    text = out.getvalue()
    assert text.endswith(CLEAR_LINE + "log: a peer is slow\nlog: after\n"), repr(text)
    assert handler.filters == []


def test_interval_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        ConsoleProgress(io.StringIO(), in_place=False, interval_s=-1.0)


def test_stdout_is_byte_for_byte_the_event_writers() -> None:
    plain, teed, console_out = io.StringIO(), io.StringIO(), io.StringIO()
    writers = [EventWriter(plain), ConsoleEventWriter(teed, ConsoleProgress(console_out, in_place=True))]
    for w in writers:
        w.ready(READY)
        for event in (COMMITTED, ABORTED, HEAL, LEAVE):
            w.emit(event)
    assert teed.getvalue() == plain.getvalue()
    assert plain.getvalue().count("\n") == 5 and "\x1b" not in plain.getvalue()
    assert console_out.getvalue().count("\n") == 5  # and the console got every line


def _worker(cfg: RunConfig, steps: list[InnerStep] | None) -> DilocoWorker:
    tokens = load_corpus(cfg.data).train
    batches = ShardedBatches(tokens, worker_index=0, num_workers=1, batch_size=cfg.data.batch_size,
                             seq_len=cfg.data.seq_len, seed=cfg.train.seed)
    return DilocoWorker(cfg, model=build_model(cfg.model, seed=cfg.train.seed), batches=batches,
                        device=torch.device("cpu"), on_step=None if steps is None else steps.append)


def test_the_worker_reports_every_inner_step_without_changing_training(tiny_config: RunConfig) -> None:
    seen: list[InnerStep] = []
    observed, plain = _worker(tiny_config, seen), _worker(tiny_config, None)
    budget = RoundBudget(max_steps=4)
    stats = [w.train_inner(2, budget=b) for w, b in ((observed, budget), (plain, RoundBudget(max_steps=4)))]
    assert stats[0].loss == stats[1].loss and torch.equal(flatten(observed.params), flatten(plain.params))
    rest = observed.train_inner(5, budget=budget)  # the round's budget ends it after 2 more steps
    assert rest.steps == 2
    assert [(s.round, s.step, s.max_steps, s.span_s) for s in seen] == [(0, k, 4, None) for k in (1, 2, 3, 4)]
    assert sum(s.tokens for s in seen) == stats[0].tokens + rest.tokens
    assert float(sum(s.loss for s in seen[:2])) / 2 == pytest.approx(stats[0].loss, rel=1e-5)
    assert seen[-1].compute_s == pytest.approx(budget.compute_s) and all(s.step_s > 0 for s in seen)
    unbudgeted: list[InnerStep] = []
    observed.on_step = unbudgeted.append
    observed.train_inner(3)
    assert [(s.step, s.max_steps) for s in unbudgeted] == [(1, 3), (2, 3), (3, 3)]

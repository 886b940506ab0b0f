"""The dashboard's parts without a swarm: peer stats on the wire, the tally of a peer's lines, which records
are absurd, the SQLite history (deltas, totals, retention, a restart) and query parameters."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmtrain.dashboard.app import QueryError, int_param
from swarmtrain.dashboard.history import History, Sample
from swarmtrain.dashboard.validate import problems
from swarmtrain.discovery import PeerRecord, RecordError
from swarmtrain.discovery.stats import PeerStats
from swarmtrain.telemetry import HealEvent, RoundEvent, StageRoundEvent, StepEvent
from swarmtrain.telemetry.tally import Tally

pytestmark = pytest.mark.unit


def _record(**stats: object) -> PeerRecord:
    return PeerRecord(run_id="r", peer_id="p1", endpoint="127.0.0.1:5", round=3, stats=PeerStats(**stats))  # type: ignore[arg-type]


def test_stats_travel_in_the_record_and_bad_types_refuse_it() -> None:
    rec = _record(loss=2.5, tokens=10, abort_reason="too few peers", version="0.1.0")
    assert PeerRecord.from_json(rec.to_json()) == rec
    old = {k: v for k, v in rec.to_json().items() if k != "stats"}
    assert PeerRecord.from_json(old).stats is None  # a peer from before stats
    for bad in ({"tokens": "many"}, {"tokens": 1.5}, {"loss": True}, {"version": "x" * 500}, []):
        with pytest.raises(RecordError, match="stats"):
            PeerRecord.from_json({**old, "stats": bad})


def test_the_tally_adds_up_the_lines() -> None:
    t = Tally(tokens_per_step=100, seq_len=8)

    def round_line(r: int, committed: bool, sent: int, steps: int, comm_s: float) -> RoundEvent:
        return RoundEvent(round=r, committed=committed, members=("a",), loss=3.0 - r if committed else None,
                          val_loss=None, hash="", bytes_sent=sent, bytes_received=sent // 2, compute_s=2.0,
                          comm_s=comm_s, steps=steps, reason="" if committed else "late")

    for e in (round_line(0, True, 1000, 5, 0.2), round_line(1, False, 10, 5, 3.0), round_line(1, True, 500, 0, 0.1),
              HealEvent(from_round=2, to_round=7, source="x", hash="")):
        t.observe(e)
    s = t.stats()
    assert (s.rounds_committed, s.rounds_aborted, s.heals) == (2, 1, 1)
    assert (s.bytes_sent, s.bytes_received, s.tokens) == (1510, 755, 1000)
    assert s.loss == 2.0 and s.abort_reason == "late" and t.round == 7 and t.steps == 10
    assert t.allreduce_s.n == 3 and t.allreduce_s.total == pytest.approx(3.3)
    assert dict(t.allreduce_s.cumulative())["0.25"] == 2 and dict(t.allreduce_s.cumulative())["+Inf"] == 3
    pipe = Tally(seq_len=8)  # a trainer's steps and its part's rounds
    pipe.observe(StepEvent(step=1, loss=4.0, samples=16, microbatches=4, rerouted=0, lost=0, stage_latency_s=()))
    pipe.observe(StageRoundEvent(stage=-1, round=0, committed=True, members=("a", "b"), hash="h", steps=1,
                                 bytes_sent=7, bytes_received=7, comm_s=0.5))
    assert (pipe.stats().tokens, pipe.stats().loss, pipe.stats().rounds_committed, pipe.round) == (128, 4.0, 1, 1)


def test_absurd_values_make_a_record_invalid_and_sane_ones_do_not() -> None:
    assert problems(_record(loss=2.5, tokens=100, tokens_per_s=5e4), median_round=3) == []
    got = problems(_record(loss=1e9, tokens=-5, tokens_per_s=1e12, comm_s=-1.0), median_round=3)
    assert [g.split()[0] for g in got] == ["loss", "tokens", "tokens_per_s", "comm_s"]
    far = PeerRecord(run_id="r", peer_id="p1", endpoint="127.0.0.1:5", round=10**6)
    assert problems(far, median_round=3) and "ahead" in problems(far, median_round=3)[0]


def _sample(peer: str, r: int, *, tokens: int = 10, nbytes: int = 100, h: str = "aa") -> Sample:
    return Sample(peer, -2, r, float(r), h, 3.0, None, tokens, 1.0, nbytes, 1.0, 0.5)


def test_history_keeps_the_newest_rounds_and_its_totals_across_a_restart(tmp_path: Path) -> None:
    db = tmp_path / "h.sqlite"
    h = History(db, retention_rounds=3)
    h.add([_sample("a", r) for r in range(6)] + [_sample("b", 5, h="bb")],
          aborts=[("a", -2, 4, 4.0, "late"), ("a", -2, 1, 1.0, "old")])
    h.see([(_record(), "")], at=9.0)
    rows = h.rounds(since=0, limit=100)
    assert [r["round"] for r in rows] == [3, 4, 5]  # rounds 0-2 trimmed
    assert rows[-1]["hashes"] == ["aa", "bb"] and rows[-1]["members"] == 2 and rows[-1]["tokens"] == 20
    assert rows[1]["aborts"] == [{"peer": "a", "at": 4.0, "reason": "late"}]
    assert h.totals() == {"samples": 7.0, "aborts": 2.0, "tokens": 70.0, "bytes": 700.0}  # totals outlive trimming
    h.add([_sample("a", 5)])  # the same (peer, part, round) again: kept once
    assert h.rounds(since=5, limit=1)[0]["members"] == 2
    h.close()
    again = History(db, retention_rounds=3)
    assert [r["round"] for r in again.rounds(since=4, limit=100)] == [4, 5] and again.peers()[0]["peer_id"] == "p1"
    again.close()


def test_query_parameters_are_checked() -> None:
    assert int_param({}, "since", default=0, lo=0, hi=10) == 0
    assert int_param({"since": "7"}, "since", default=0, lo=0, hi=10) == 7
    for raw in ("x", "1.5", "-1", "11", ""):
        with pytest.raises(QueryError, match="since"):
            int_param({"since": raw}, "since", default=0, lo=0, hi=10)


def test_the_stored_allreduce_histogram_matches_the_live_one() -> None:
    """A restarted coordinator counts its all-reduce histogram in SQL: the same buckets as observing each."""
    from swarmtrain.telemetry.tally import Histogram

    seconds = [0.0, 0.01, 0.05, 0.3, 7.0, 500.0, 0.012]  # 0: a peer's first sample, not a round
    h = History(":memory:", retention_rounds=100)
    h.add([Sample("a", -2, r, 0.0, "x", None, None, 1, 1.0, 1, 1.0, c) for r, c in enumerate(seconds)])
    live = Histogram()
    for c in seconds:
        if c > 0:
            live.observe(c)
    assert h.comm_histogram(live.bounds) == (live.counts, pytest.approx(live.total))


def test_gossip_spread_is_averaged_per_round_and_an_older_history_file_gains_its_columns(tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "old.sqlite"
    old = sqlite3.connect(db)  # a history written before the spread columns existed
    old.executescript("CREATE TABLE rounds (round INTEGER NOT NULL, part INTEGER NOT NULL, members INTEGER NOT NULL, "
                      "hashes TEXT NOT NULL, loss_sum REAL NOT NULL, loss_n INTEGER NOT NULL, val_sum REAL NOT NULL, "
                      "val_n INTEGER NOT NULL, tokens INTEGER NOT NULL, bytes INTEGER NOT NULL, "
                      "comm_sum REAL NOT NULL, compute_s REAL NOT NULL, first_at REAL NOT NULL, "
                      "PRIMARY KEY (round, part));"
                      "INSERT INTO rounds VALUES (0, -2, 1, '[\"aa\"]', 3.0, 1, 0, 0, 10, 100, 0.5, 1.0, 0.0);")
    old.close()
    h = History(db, retention_rounds=10)
    spread = [Sample("a", -2, 1, 1.0, "aa", 3.0, None, 10, 1.0, 100, 1.0, 0.5, 0.02),
              Sample("b", -2, 1, 1.0, "bb", 3.0, None, 10, 1.0, 100, 1.0, 0.5, 0.04), _sample("c", 1, h="cc")]
    h.add(spread)
    rows = h.rounds(since=0, limit=10)
    assert rows[0]["round"] == 0 and rows[0]["spread"] is None  # the old row, read through the new columns
    assert rows[1]["spread"] == pytest.approx(0.03) and rows[1]["members"] == 3  # c reported none: not counted
    h.close()


def test_the_tally_keeps_the_last_known_spread() -> None:
    t = Tally(tokens_per_step=1)
    for spread in (0.5, None):
        t.observe(RoundEvent(round=0, committed=True, members=("a", "b"), loss=1.0, val_loss=None, hash="",
                             bytes_sent=0, bytes_received=0, compute_s=1.0, comm_s=0.1, spread=spread))
    assert t.stats().spread == 0.5
    rec = _record(spread=0.25)
    assert PeerRecord.from_json(rec.to_json()).stats.spread == 0.25  # type: ignore[union-attr]

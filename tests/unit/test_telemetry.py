"""The stdout event protocol, the per-round counters and the demo's progress aggregation."""

from __future__ import annotations

import io
import json
import logging
import threading

import pytest

from swarmtrain.telemetry import (
    EventError,
    EventWriter,
    HealEvent,
    LeaveEvent,
    ReadyLine,
    RoundCounters,
    RoundEvent,
    parse_line,
)
from swarmtrain.telemetry.progress import SwarmProgress, format_round

pytestmark = pytest.mark.unit


def _round(r: int, *, h: str = "ab", committed: bool = True, loss: float | None = 2.0) -> RoundEvent:
    return RoundEvent(round=r, committed=committed, members=("p1", "p2"), loss=loss, val_loss=1.5, hash=h,
                      bytes_sent=10, bytes_received=12, compute_s=0.5, comm_s=0.25, peer="p1")


def test_round_line_has_the_issue_schema_and_round_trips() -> None:
    out = io.StringIO()
    EventWriter(out).emit(_round(3))
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1
    obj = json.loads(text)
    required = {"event", "round", "committed", "members", "loss", "val_loss", "hash", "bytes_sent",
                "bytes_received", "compute_s", "comm_s"}
    assert required <= obj.keys()
    assert obj["event"] == "round" and obj["members"] == ["p1", "p2"]
    assert parse_line(text) == _round(3)


def test_non_finite_loss_is_written_as_null() -> None:
    out = io.StringIO()
    EventWriter(out).emit(_round(0, loss=float("nan")))
    assert json.loads(out.getvalue())["loss"] is None
    parsed = parse_line(out.getvalue())
    assert isinstance(parsed, RoundEvent) and parsed.loss is None


def test_ready_heal_and_leave_lines_parse() -> None:
    out = io.StringIO()
    w = EventWriter(out)
    w.ready({"peer_id": "p1", "endpoint": "127.0.0.1:5000", "maddrs": ["/ip4/127.0.0.1/tcp/1"]})
    w.emit(HealEvent(from_round=0, to_round=7, source="p2", hash="cd"))
    w.emit(LeaveEvent(round=7, reason="signal", checkpoint="/tmp/x"))
    lines = [parse_line(x) for x in out.getvalue().splitlines()]
    assert lines[0] == ReadyLine({"peer_id": "p1", "endpoint": "127.0.0.1:5000", "maddrs": ["/ip4/127.0.0.1/tcp/1"]})
    assert lines[1] == HealEvent(from_round=0, to_round=7, source="p2", hash="cd")
    assert lines[2] == LeaveEvent(round=7, reason="signal", checkpoint="/tmp/x")


@pytest.mark.parametrize("line", ["READY {not json", "READY [1, 2]", '{"event": "round", "round": 1}',
                                  '{"event": "round", "members": "p1"}', "{broken"])
def test_malformed_event_lines_raise_event_error(line: str) -> None:
    with pytest.raises(EventError):
        parse_line(line)


@pytest.mark.parametrize("line", ["", "hello", '{"event": "something-else"}', '{"no_event": 1}'])
def test_other_lines_are_ignored(line: str) -> None:
    assert parse_line(line) is None


def test_writer_never_interleaves_lines_across_threads() -> None:
    out = io.StringIO()
    w = EventWriter(out)
    threads = [threading.Thread(target=lambda: [w.emit(_round(i)) for i in range(200)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = out.getvalue().splitlines()
    assert len(lines) == 800 and all(isinstance(parse_line(x), RoundEvent) for x in lines)


def test_counters_take_resets_the_round_but_keeps_lifetime() -> None:
    c = RoundCounters()
    c.add(bytes_sent=100, bytes_received=50, tokens=1000)
    with c.timed("compute"):
        pass
    first = c.take()
    assert (first.bytes_sent, first.bytes_received, first.tokens) == (100, 50, 1000)
    assert first.compute_s >= 0 and first.comm_s == 0
    c.add(bytes_sent=1)
    assert c.take().bytes_sent == 1
    assert c.lifetime.bytes_sent == 101
    with pytest.raises(ValueError, match="kind"), c.timed("io"):
        pass
    with pytest.raises(ValueError, match=">= 0"):
        c.add(bytes_sent=-1)


def test_progress_completes_a_round_once_every_active_peer_passed_it() -> None:
    p = SwarmProgress(["a", "b", "c"])
    assert p.add("a", _round(0)) == []
    assert p.add("b", _round(0)) == []
    done = p.add("c", _round(0, h="ab"))
    assert [s.round for s in done] == [0] and done[0].agree and len(done[0].committed) == 3
    # c dies: round 1 completes without it
    p.add("a", _round(1))
    p.add("b", _round(1, h="ff"))
    done = p.peer_exited("c")
    assert [s.round for s in done] == [1] and not done[0].agree
    assert "HASHES DIFFER" in format_round(done[0], num_peers=3, elapsed_s=1.0)


def test_progress_heal_counts_as_having_passed_the_skipped_rounds() -> None:
    p = SwarmProgress(["a", "b"])
    p.add("a", _round(0))
    p.add("a", _round(1))
    assert p.add("b", HealEvent(from_round=0, to_round=2, source="a", hash="ab")) != []
    p.add("a", LeaveEvent(round=1, reason="done"))
    p.add("b", LeaveEvent(round=1, reason="done"))
    assert p.done and p.finish() == []
    aborted = _round(5, committed=False)
    p2 = SwarmProgress(["a"])
    assert p2.add("a", aborted) == []  # the peer retries the round: not over yet
    (s,) = p2.add("a", LeaveEvent(round=5, reason="signal"))  # it left without committing it
    assert s.agree and "aborted" in format_round(s, num_peers=1, elapsed_s=0.0)


def test_progress_shows_a_round_that_aborted_then_committed_as_committed() -> None:
    p = SwarmProgress(["a", "b"])
    for peer in "ab":
        assert p.add(peer, _round(0, committed=False)) == []
    assert p.add("a", _round(0)) == []
    (s,) = p.add("b", _round(0))
    assert len(s.committed) == 2 and "committed 2/2" in format_round(s, num_peers=2, elapsed_s=0.0)


def test_a_writer_whose_reader_went_away_drops_its_lines_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    """A closed log pipe made the next line raise BrokenPipeError out of whatever emitted it: a leaving peer
    then skipped stopping its DHT and hung at exit."""
    class DeadPipe(io.StringIO):
        writes = 0

        def write(self, s: str) -> int:
            DeadPipe.writes += 1
            raise BrokenPipeError(32, "Broken pipe")

    writer = EventWriter(DeadPipe())
    seen: list[object] = []
    writer.listeners.append(seen.append)
    with caplog.at_level(logging.WARNING):
        writer.ready({"role": "peer"})
        writer.emit(LeaveEvent(round=1, reason="signal"))
        writer.emit(LeaveEvent(round=2, reason="signal"))
    assert DeadPipe.writes == 1 and len(seen) == 2  # one failed write, then none; listeners still see events
    assert sum("went away" in r.getMessage() for r in caplog.records) == 1

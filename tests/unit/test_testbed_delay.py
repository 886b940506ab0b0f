"""The user-space delay line of the testbed's forwarder: order, release times, its byte limit; the arguments of
`swarmtrain testbed forward`, which runs it."""

from __future__ import annotations

import pytest

from swarmtrain.daemon.cli import main
from swarmtrain.testbed.delay import DelayLine


def test_frames_leave_in_order_each_after_the_delay() -> None:
    line = DelayLine(0.05)
    assert line.next_due() is None and line.pop_due(now=100.0) == []
    line.push(b"a" * 10, now=1.0)
    line.push(b"b" * 20, now=1.02)
    assert line.next_due() == pytest.approx(1.05) and line.held_bytes == 30
    assert line.pop_due(now=1.0499) == []
    assert line.pop_due(now=1.05) == [b"a" * 10]
    assert line.next_due() == pytest.approx(1.07)
    line.push(b"c", now=1.06)
    assert line.pop_due(now=2.0) == [b"b" * 20, b"c"]
    assert line.held_bytes == 0 and line.next_due() is None


def test_a_full_line_drops_what_does_not_fit_and_takes_frames_again_once_drained() -> None:
    line = DelayLine(0.01, limit_bytes=100)
    assert line.push(b"x" * 60, now=0.0)
    assert not line.push(b"y" * 50, now=0.0)  # 110 > 100: dropped, the held frame is untouched
    assert line.push(b"z" * 40, now=0.0)
    assert line.pop_due(now=1.0) == [b"x" * 60, b"z" * 40]
    assert line.push(b"y" * 50, now=1.0)


def test_a_zero_delay_releases_at_once_and_a_negative_one_is_refused() -> None:
    line = DelayLine(0.0)
    line.push(b"f", now=3.0)
    assert line.pop_due(now=3.0) == [b"f"]
    with pytest.raises(ValueError, match="delay_s"):
        DelayLine(-0.001)


@pytest.mark.parametrize("argv, message", [
    (["--delay-ms", "10", "--port", "h0"], "DEV:TAP"),
    (["--delay-ms", "-1", "--port", "h0:t0"], "must be in"),
    (["--port", "h0:t0"], "--delay-ms"),
])
def test_the_forwarder_refuses_bad_arguments_by_name(argv: list[str], message: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["testbed", "forward", *argv])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err

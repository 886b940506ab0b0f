"""`swarmtrain demo --peers 2 --rounds 2` end to end: exits 0 with a summary of agreeing committed rounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmtrain.testing.procs import ProcessSet

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]


def test_demo_two_peers_two_rounds(procs: ProcessSet, tmp_path: Path) -> None:
    demo = procs.spawn("demo", "demo", "--peers", "2", "--rounds", "2", "--log-dir", str(tmp_path / "demo-logs"))
    rc = demo.proc.wait(timeout=240)
    demo.close()
    out = "\n".join(demo.raw_tail)
    assert rc == 0, out
    round_lines = [x for x in demo.raw_tail if x.startswith("round ")]
    assert len(round_lines) == 2 and all("committed 2/2" in x and "hashes agree" in x for x in round_lines), out
    assert "rounds committed: 2; rounds where hashes differed: 0" in out
    assert "result: OK" in out
    logs = sorted(p.name for p in (tmp_path / "demo-logs").iterdir())
    assert logs == ["coordinator.log", "dashboard.sqlite", "peer0.log", "peer1.log"]  # the dashboard's history too
    assert any(x.startswith("dashboard: http://127.0.0.1:") for x in demo.raw_tail), out


def test_pipeline_demo_kills_a_server_and_loses_no_microbatch(procs: ProcessSet, tmp_path: Path) -> None:
    demo = procs.spawn("demo", "demo", "--pipeline", "--rounds", "3", "--log-dir", str(tmp_path / "pipe-logs"))
    rc = demo.proc.wait(timeout=240)
    demo.close()
    out = "\n".join(demo.raw_tail)
    assert rc == 0, out
    assert "killed s1a (SIGKILL)" in out and "result: OK" in out, out
    summary = next(x for x in demo.raw_tail if "micro-batches sent" in x)
    assert summary.strip().startswith("micro-batches sent 240, completed 240,") and summary.endswith("lost 0"), out
    logs = sorted(p.name for p in (tmp_path / "pipe-logs").iterdir())
    assert logs == ["coordinator.log", "dashboard.sqlite", "s0a.log", "s0b.log", "s1a.log", "s1b.log", "t0.log",
                    "t1.log"]

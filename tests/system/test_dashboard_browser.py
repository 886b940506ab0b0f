"""The dashboard page in a real browser (headless Chromium; CI installs Debian's `chromium`): served by a
running 3-peer swarm, the page's script renders the peers table, the charts and the rounds timeline (read
back from the DOM) and a screenshot is saved as a test artifact; with 200 live peers and 10,000 rounds of
history it renders all of them."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest

from swarmtrain.config import load_config
from swarmtrain.dashboard import Collector, Dashboard, History
from swarmtrain.discovery import InMemoryDiscovery
from swarmtrain.roles import Peer
from swarmtrain.telemetry import EventWriter
from swarmtrain.testing.cluster import TINY_RUN, EventLog, LoopbackServices, publish_run, run_peer
from swarmtrain.testing.dashboard import chromium, fill_history, rendered, synthetic_peers

pytestmark = [pytest.mark.system, pytest.mark.timeout(300),
              pytest.mark.skipif(chromium() is None, reason="no Chromium here (CI installs Debian's chromium)")]

KEY = "browser key"
RUN = [*TINY_RUN, "diloco.inner_steps=20", "averaging.matchmaking_timeout_s=1.0", "averaging.allreduce_timeout_s=10",
       "averaging.contribution_window_s=3", "discovery.heartbeat_s=0.2", "discovery.record_ttl_s=3.0",
       "rpc.call_timeout_s=3.0", "diloco.rounds=200"]
ARTIFACTS = Path(os.environ.get("SWARMTRAIN_TEST_ARTIFACTS", "test-artifacts"))


def _rows(dom: str, table: str) -> int:
    body = re.search(rf'<table id="{table}">.*?<tbody>(.*?)</tbody>', dom, re.S)
    return body.group(1).count("<tr") if body else -1


def test_page_of_a_running_swarm_renders_peers_charts_and_rounds(tmp_path: Path) -> None:
    async def main() -> dict[str, str]:
        services = LoopbackServices()
        cfg = await publish_run(services.registry, RUN, run_key=KEY)
        local = load_config(overrides=[f"rpc.run_key={KEY!r}", "discovery.heartbeat_s=0.2",
                                       "discovery.record_ttl_s=3.0"])
        logs = {n: EventLog() for n in "abc"}
        peers = [Peer(local, writer=EventWriter(logs[n]), services=services) for n in "abc"]
        stop = asyncio.Event()
        runs = [asyncio.create_task(run_peer(p, stop)) for p in peers]
        coordinator = InMemoryDiscovery(services.registry, run_id=cfg.train.run_id, record_ttl_s=3.0,
                                        peer_id="coordinator", run_key=KEY)
        collector = Collector(coordinator, History(tmp_path / "d.sqlite", retention_rounds=1000), cfg.dashboard,
                              record_ttl_s=3.0, io_timeout_s=3.0)
        dashboard = Dashboard(collector, host="127.0.0.1", port=0, poll_s=0.2)
        port = await dashboard.start()
        while not all(len([e for e in log.rounds() if e.committed]) >= 3 for log in logs.values()):
            assert not any(r.done() and r.exception() for r in runs), [r.exception() for r in runs if r.done()]
            await asyncio.sleep(0.1)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page = await rendered(f"http://127.0.0.1:{port}/", screenshot=ARTIFACTS / "dashboard-3-peers.png")
        stop.set()
        await asyncio.gather(*runs)
        await dashboard.close()
        return page

    page = asyncio.run(main())
    assert page["peers"] == "3" and _rows(page["dom"], "peers") == 3, page["dom"][:2000]
    assert page["charts"] == "3" and page["dom"].count('class="uplot') >= 3
    assert int(page["rounds"]) >= 3 and _rows(page["dom"], "rounds") >= 3
    assert "θ hashes disagree" not in page["dom"] and 'class="none"' in page["dom"]  # no alerts
    shot = ARTIFACTS / "dashboard-3-peers.png"
    assert shot.stat().st_size > 20_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_page_renders_200_peers_and_10000_rounds(tmp_path: Path) -> None:
    async def main() -> dict[str, str]:
        services = LoopbackServices()
        cfg = await publish_run(services.registry, RUN, run_key=KEY)
        await synthetic_peers(services.registry, run_id=cfg.train.run_id, run_key=KEY, count=200, round_index=10_000)
        history = History(tmp_path / "big.sqlite", retention_rounds=10_000)
        fill_history(history, rounds=10_000, peers_per_round=2)
        coordinator = InMemoryDiscovery(services.registry, run_id=cfg.train.run_id, record_ttl_s=3600.0,
                                        peer_id="coordinator", run_key=KEY)
        dashboard = Dashboard(Collector(coordinator, history, cfg.dashboard, record_ttl_s=3600.0, io_timeout_s=5.0),
                              host="127.0.0.1", port=0, poll_s=5.0)
        port = await dashboard.start()
        page = await rendered(f"http://127.0.0.1:{port}/", budget_ms=15000)
        await dashboard.close()
        return page

    page = asyncio.run(main())
    assert page["peers"] == "200" and _rows(page["dom"], "peers") == 200
    assert page["rounds"] == "10000" and page["charts"] == "3"
    assert _rows(page["dom"], "rounds") == 200  # the timeline shows the newest 200; the charts hold all

"""Dashboard load benchmark: the coordinator's API latency and the page's render time in headless Chromium
with PEERS live peer records and ROUNDS rounds of history (a sample from every peer in every round).

    python benchmarks/dashboard.py --peers 200 --rounds 10000 --requests 50

Targets (docs/dashboard.md): every API route answers in < 100 ms, the page renders (peers table, charts
and rounds timeline all drawn) in < 2 s: measured as headless Chromium's wall time to load the page and
run it to idle, less its time for a static file of the same server (browser start-up), loads alternating.
The history is filled through the same History.add the coordinator uses; the records are announced on an
in-memory DHT; the server is the real aiohttp app.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROUTES = ("/api/health", "/api/status", "/api/peers", "/api/rounds?since=0&limit=10000", "/metrics")


def _get_ms(url: str) -> float:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as resp:
        resp.read()
    return 1000 * (time.perf_counter() - start)


async def _load_s(url: str, exe: str) -> tuple[float, dict[str, str]]:
    """Wall seconds for headless Chromium to load `url`, run its script until idle (virtual time lets its
    timers fire without waiting) and dump the DOM; with the body's data-* attributes the page set."""
    from swarmtrain.testing.dashboard import CHROMIUM_ARGS, body_data

    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(exe, *CHROMIUM_ARGS, "--virtual-time-budget=3000", "--dump-dom", url,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    dom = (await asyncio.wait_for(proc.communicate(), timeout=120))[0].decode()
    return time.perf_counter() - start, body_data(dom)


async def run(peers: int, rounds: int, requests: int, renders: int) -> dict[str, Any]:
    from swarmtrain.config import load_config
    from swarmtrain.dashboard import Collector, Dashboard, History
    from swarmtrain.discovery import InMemoryDiscovery, InMemoryRegistry
    from swarmtrain.testing.dashboard import chromium, fill_history, synthetic_peers

    cfg = load_config()
    registry = InMemoryRegistry()
    await synthetic_peers(registry, run_id=cfg.train.run_id, run_key="", count=peers, round_index=rounds)
    db = Path(tempfile.mkdtemp(prefix="swarmtrain-dashboard-bench-")) / "history.sqlite"
    history = History(db, retention_rounds=rounds)
    start = time.perf_counter()
    fill_history(history, rounds=rounds, peers_per_round=peers)
    fill_s = time.perf_counter() - start
    coordinator = InMemoryDiscovery(registry, run_id=cfg.train.run_id, record_ttl_s=3600.0, peer_id="coordinator")
    dashboard = Dashboard(Collector(coordinator, history, cfg.dashboard, record_ttl_s=3600.0, io_timeout_s=10.0),
                          host="127.0.0.1", port=0, poll_s=3600.0)
    port = await dashboard.start()
    base = f"http://127.0.0.1:{port}"
    latency: dict[str, dict[str, float]] = {}
    for route in ROUTES:
        ms = [await asyncio.to_thread(_get_ms, base + route) for _ in range(requests)]
        latency[route] = {"p50_ms": statistics.median(ms), "p99_ms": sorted(ms)[int(0.99 * (len(ms) - 1))],
                          "max_ms": max(ms)}
        print(f"{route:40s} p50 {latency[route]['p50_ms']:7.1f} ms  p99 {latency[route]['p99_ms']:7.1f} ms", flush=True)
    exe = chromium()
    render: dict[str, Any] = {"chromium": exe is not None}
    if exe is not None:
        # The page against a static file of the same server, loads alternating: the difference is what the
        # page's fetches, script, tables and charts cost on top of starting a browser.
        page, plain, attrs = [], [], {}
        for _ in range(renders):
            took, attrs = await _load_s(base + "/", exe)
            page.append(took)
            plain.append((await _load_s(base + "/static/vendor/uPlot.min.css", exe))[0])
        render.update(page_s=page, plain_s=plain, render_s=statistics.median(page) - statistics.median(plain),
                      peers_rendered=attrs.get("peers"), rounds_rendered=attrs.get("rounds"),
                      charts=attrs.get("charts"))
        print(f"page load {statistics.median(page):.2f} s, a static file {statistics.median(plain):.2f} s: the page "
              f"renders in {render['render_s']:.2f} s ({attrs.get('peers')} peers, {attrs.get('rounds')} rounds, "
              f"{attrs.get('charts')} charts)", flush=True)
    await dashboard.close()
    return {"peers": peers, "rounds": rounds, "samples": peers * rounds, "fill_s": fill_s,
            "db_bytes": db.stat().st_size, "latency": latency, "render": render}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=10000)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--renders", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "dashboard.json"))
    args = ap.parse_args()
    result = {"command": " ".join(sys.argv), **asyncio.run(run(args.peers, args.rounds, args.requests, args.renders))}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()

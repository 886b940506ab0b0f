"""Dashboards for tests and benchmarks: a synthetic swarm's records and history, and a headless Chromium that
loads a page and reports what its script rendered."""

from __future__ import annotations

import asyncio
import random
import re
import shutil
from pathlib import Path

from swarmtrain.dashboard.history import History, Sample
from swarmtrain.discovery import InMemoryDiscovery, InMemoryRegistry, PeerRecord
from swarmtrain.discovery.stats import PeerStats

__all__ = ["CHROMIUM_ARGS", "body_data", "chromium", "fill_history", "rendered", "synthetic_peers"]

CHROMIUM_ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
                 "--window-size=1400,2000")


def chromium() -> str | None:
    """The path of a Chromium (Debian's `chromium`), or None."""
    return next((p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))), None)


async def synthetic_peers(registry: InMemoryRegistry, *, run_id: str, run_key: str, count: int, round_index: int,
                          seed: int = 0) -> list[InMemoryDiscovery]:
    """`count` live worker records at `round_index`, all with one θ hash, plausible stats."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        d = InMemoryDiscovery(registry, run_id=run_id, record_ttl_s=3600.0, run_key=run_key)
        stats = PeerStats(loss=2.0 + rng.random(), val_loss=2.1 + rng.random(), tokens=1000 * round_index,
                          tokens_per_s=rng.uniform(1e3, 5e4), bytes_sent=10**6 * round_index,
                          bytes_received=10**6 * round_index, compute_s=10.0 * round_index,
                          comm_s=rng.uniform(0.5, 2.0) * round_index, rounds_committed=round_index, version="0.1.0")
        await d.announce(PeerRecord(run_id=run_id, peer_id=d.peer_id, endpoint=f"10.0.{i // 250}.{i % 250}:7000",
                                    round=round_index, state_hash="cd" * 32, heartbeat_at=d.now(), stats=stats),
                         timeout_s=1.0)
        out.append(d)
    return out


def fill_history(history: History, *, rounds: int, peers_per_round: int, seed: int = 0) -> None:
    """`rounds` rounds of `peers_per_round` samples each, a loss that falls, an abort every 100 rounds."""
    rng = random.Random(seed)
    for r in range(rounds):
        loss = 5.0 / (1 + r / 500) + rng.random() * 0.05
        samples = [Sample(f"p{i}", -2, r, 1000.0 + r, f"{r:064x}", loss, loss + 0.05 if r % 10 == 0 else None,
                          4096, 2e4, 2_000_000, 1.0, rng.uniform(0.1, 0.5)) for i in range(peers_per_round)]
        history.add(samples, [("p0", -2, r, 1000.0 + r, "late")] if r % 100 == 0 else [])


def body_data(dom: str) -> dict[str, str]:
    """The `data-*` attributes of a dumped page's body (what the page's script set once it rendered)."""
    body = re.search(r"<body([^>]*)>", dom)
    return dict(re.findall(r'data-([\w-]+)="([^"]*)"', body.group(1))) if body else {}


async def rendered(url: str, *, screenshot: Path | None = None, budget_ms: int = 8000) -> dict[str, str]:
    """Load `url` in headless Chromium (its timers run `budget_ms` of virtual time) and return the body's
    `data-*` attributes the page's script sets once it rendered (peers, charts, rounds), plus the DOM; with
    `screenshot`, also save a PNG of the page there."""
    exe = chromium()
    if exe is None:
        raise FileNotFoundError("no Chromium on this machine (Debian: apt-get install chromium)")
    proc = await asyncio.create_subprocess_exec(exe, *CHROMIUM_ARGS, f"--virtual-time-budget={budget_ms}",
                                                "--dump-dom", url, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.DEVNULL)
    dom = (await asyncio.wait_for(proc.communicate(), timeout=120))[0].decode()
    attrs = body_data(dom)
    if screenshot is not None:
        shot = await asyncio.create_subprocess_exec(exe, *CHROMIUM_ARGS, f"--virtual-time-budget={budget_ms}",
                                                    f"--screenshot={screenshot}", url,
                                                    stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.DEVNULL)
        await asyncio.wait_for(shot.wait(), timeout=120)
    return {**attrs, "dom": dom}

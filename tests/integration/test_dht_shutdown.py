"""A real hivemind DHT closes within its bound: asked first, killed with its p2pd when it does not answer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time

import pytest

from swarmtrain.config import DiscoveryConfig
from swarmtrain.discovery.hivemind_dht import CLOSE_MARGIN_S, HivemindDiscovery
from swarmtrain.proctree import descendants, running
from swarmtrain.testing.wait import wait_until

pytestmark = pytest.mark.integration

GRACE_S = 0.5



def _kill(pids: list[int]) -> None:
    """Cleanup when an assertion failed: a stopped DHT process would hang the interpreter's exit."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def _started(grace_s: float = GRACE_S) -> tuple[HivemindDiscovery, list[int]]:
    d = await HivemindDiscovery.create(DiscoveryConfig(shutdown_timeout_s=grace_s), run_id="shutdown")
    pids = [d.dht.pid, *descendants(d.dht.pid)]
    assert len(pids) == 2, f"expected the DHT process and its p2pd, found {pids}"
    return d, pids


def test_a_healthy_dht_stops_when_asked(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="swarmtrain.discovery.hivemind_dht")

    async def main() -> tuple[list[int], float]:
        d, pids = await _started(grace_s=10.0)
        t0 = time.monotonic()
        await d.aclose()
        return pids, time.monotonic() - t0

    pids, elapsed = asyncio.run(main())
    try:
        assert elapsed < 10.0, f"a healthy DHT took {elapsed:.2f}s to stop"
        assert not any(running(p) for p in pids)
        assert "stopped" in caplog.text and "forced" not in caplog.text
    finally:
        _kill(pids)


def test_a_stopped_dht_is_killed_with_its_p2pd_within_the_bound(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> tuple[list[int], float]:
        d, pids = await _started()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)  # a hang: the DHT and p2pd hold their sockets and answer nothing
        t0 = time.monotonic()
        await d.aclose()
        return pids, time.monotonic() - t0

    pids, elapsed = asyncio.run(main())
    try:
        assert GRACE_S <= elapsed < GRACE_S + CLOSE_MARGIN_S
        wait_until(lambda: not any(running(p) for p in pids), timeout_s=5, what="DHT and p2pd gone")
        assert f"forced SIGTERM, SIGKILL, SIGKILL to p2pd (pid {pids[1]}); all gone" in caplog.text
    finally:
        _kill(pids)


def test_a_cancelled_close_still_kills_the_dht() -> None:
    async def main() -> list[int]:
        d, pids = await _started()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(d.aclose(), timeout=GRACE_S / 5)
        return pids

    pids = asyncio.run(main())
    try:
        wait_until(lambda: not any(running(p) for p in pids), timeout_s=5, what="DHT and p2pd gone")
    finally:
        _kill(pids)


def test_a_dht_killed_mid_report_does_not_silence_the_next_one() -> None:
    """hivemind's DHT processes report to their parent through one pipe under one process-shared lock. A DHT
    SIGKILLed while it held that lock (the lock is taken here by hand, as such a DHT would leave it) must
    not leave every later DHT of this process up but never heard from: with no DHT open, the next starts
    afresh."""
    from hivemind.utils.mpfuture import MPFuture

    held = MPFuture._update_lock
    assert held.acquire(timeout=5)
    try:
        async def main() -> str:
            d = await HivemindDiscovery.create(DiscoveryConfig(), run_id="r", start_timeout_s=20)
            try:
                return d.peer_id
            finally:
                await d.aclose()

        assert asyncio.run(main())
    finally:
        held.release()

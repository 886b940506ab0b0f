"""`swarmtrain coordinator` as a real subprocess: READY line, signed run record, round tracking, clean SIGTERM."""

from __future__ import annotations

import asyncio
import signal

import pytest

from swarmtrain.config import DiscoveryConfig, load_config
from swarmtrain.discovery import PeerRecord
from swarmtrain.discovery.hivemind_dht import HivemindDiscovery
from swarmtrain.models.spec import resolve_run
from swarmtrain.testing.procs import ProcessSet

pytestmark = pytest.mark.system

SETS = ["discovery.heartbeat_s=0.3", "discovery.record_ttl_s=5", "averaging.min_peers=3", "train.run_id=coordtest"]


def test_coordinator_publishes_the_run_tracks_the_round_and_exits_cleanly(procs: ProcessSet) -> None:
    coord, join = procs.coordinator(SETS, timeout_s=90.0)
    info = coord.wait_ready(timeout_s=1.0)
    assert info["role"] == "coordinator" and info["run_id"] == "coordtest" and join.endswith(f"/p2p/{info['peer_id']}")
    nonce = info["run_nonce"]
    assert isinstance(nonce, str) and len(nonce) == 16  # drawn at start: a new run of "coordtest"
    # Published resolved: the model's signature and fingerprint, the tokenizer's hash (models/spec.py)
    expected = resolve_run(load_config(overrides=[*SETS, f"train.run_nonce={nonce!r}"]))
    assert expected.model.fingerprint and expected.data.tokenizer_hash == "bytes"

    async def main() -> None:
        d = await HivemindDiscovery.create(DiscoveryConfig(initial_peers=(join,), record_ttl_s=5), run_id="coordtest")
        try:
            run = await d.fetch_run(coordinator_id=str(info["peer_id"]), timeout_s=10)
            assert run is not None and run.run_config() == expected and run.round == 0
            await d.announce(PeerRecord(run_id="coordtest", peer_id=d.peer_id, endpoint="127.0.0.1:9", round=4,
                                        heartbeat_at=d.now()), timeout_s=10)
            deadline = d.now() + 15
            while (run := await d.fetch_run(timeout_s=10)) is None or run.round != 4:
                assert d.now() < deadline, f"run record never reached round 4: {run}"
                await asyncio.sleep(0.1)
        finally:
            await d.aclose()

    asyncio.run(main())
    coord.proc.send_signal(signal.SIGTERM)
    assert coord.proc.wait(timeout=30) == 0
    assert "Traceback" not in coord.log_path.read_text()

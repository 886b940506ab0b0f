"""Real peers (in-process cluster: real matchmaking, real all-reduce over loopback gRPC, in-memory DHT) with the
sparse codec and Streaming DiLoCo fragments: every round commits with one θ_global, and each round's bytes are
those of one fragment's sparse contributions."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from swarmtrain.config import load_config
from swarmtrain.models import build_model
from swarmtrain.roles import Peer
from swarmtrain.telemetry import EventWriter
from swarmtrain.testing.cluster import (
    TINY_RUN,
    EventLog,
    LoopbackServices,
    hashes_by_round,
    publish_run,
    run_peer,
    story,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROUNDS = 6
RUN = [
    *TINY_RUN, "averaging.matchmaking_timeout_s=1.0", "averaging.allreduce_timeout_s=10",
    "averaging.contribution_window_s=3", "discovery.heartbeat_s=0.2", "discovery.record_ttl_s=3.0",
    "rpc.call_timeout_s=3.0", f"diloco.rounds={ROUNDS}", "model.n_layer=2", "diloco.inner_steps=4",
    "diloco.fragments=2", "compress.codec=sparse", "compress.error_feedback=true", "compress.density=0.02",
    "compress.chunk_size=1024", "compress.error_feedback_decay=0.95",
]


@pytest.mark.parametrize("overlap", [False, True], ids=["classic", "overlap"])
def test_sparse_fragment_rounds_commit_with_one_theta(tmp_path: Path, overlap: bool) -> None:
    run = [*RUN, f"diloco.overlap={'true' if overlap else 'false'}", "diloco.overlap_max_steps=1"]

    async def main() -> dict[str, EventLog]:
        services = LoopbackServices()
        await publish_run(services.registry, run)
        outs = {n: EventLog() for n in "abc"}
        stop = asyncio.Event()
        peers = {n: Peer(load_config(overrides=[f"checkpoint.dir={str(tmp_path / n)!r}"]),
                         writer=EventWriter(outs[n]), services=services) for n in "abc"}
        tasks = [asyncio.create_task(run_peer(peers[n], stop)) for n in "abc"]
        assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=150) == ["done"] * 3
        return outs

    outs = asyncio.run(main())
    told = story(outs)
    by_round = hashes_by_round(outs)
    assert sorted(by_round) == list(range(ROUNDS)) and all(len(h) == 1 for h in by_round.values()), told
    cfg = load_config(overrides=run)
    numel = sum(p.numel() for p in build_model(cfg.model, seed=0).parameters())
    committed = [e for out in outs.values() for e in out.rounds() if e.committed]
    assert committed, told
    # a fragment is about half of θ, sent at 2% density: a round's bytes stay far below int8's ~1.06 B/value
    assert all(e.bytes_sent < 0.2 * numel for e in committed), [(e.round, e.bytes_sent) for e in committed]

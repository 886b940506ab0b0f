"""Coordinator + 2 real peer processes holding the run key, and an outsider: a real hivemind node without the
key, joined to the same DHT, that publishes all the while a peer record far ahead (with an endpoint to heal
from), a second run record, match entries and groups. The peers keep committing rounds with one θ_global hash,
in groups of their own, and never dial the outsider's endpoint."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict

import pytest

from swarmtrain.config import DiscoveryConfig, load_config, to_dict
from swarmtrain.discovery import GroupRecord, MatchEntry, PeerRecord, RunRecord
from swarmtrain.discovery.hivemind_dht import HivemindDiscovery
from swarmtrain.process.children import Child
from swarmtrain.round.group import Member
from swarmtrain.telemetry.events import RoundEvent
from swarmtrain.testing.endpoints import DialCounter
from swarmtrain.testing.procs import ProcessSet, wait_round

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]

KEY = "a long random run key"
RUN = [
    "model.preset=tiny", "data.max_corpus_bytes=400000", "data.seq_len=32", "data.batch_size=4",
    "inner.warmup_steps=1", "diloco.inner_steps=5", "diloco.rounds=10000", "diloco.eval_batches=1",
    "averaging.min_peers=2", "averaging.matchmaking_timeout_s=1.0", "averaging.allreduce_timeout_s=4.0",
    "averaging.contribution_window_s=1.0", "discovery.heartbeat_s=0.5", "discovery.record_ttl_s=3.0",
    "rpc.call_timeout_s=2.0", "rpc.retries=1", "rpc.backoff_s=0.05", "train.threads=1",
]
START_S, ROUND_S = 120.0, 60.0


def _rounds(child: Child) -> list[RoundEvent]:
    return [x for x in child.snapshot() if isinstance(x, RoundEvent)]


async def _steer(join: str, peers: list[Child], endpoint: str, stop: threading.Event, started: threading.Event,
                 published: threading.Event) -> str:
    """Publish everything an outsider can, every half second, until `stop`; returns the outsider's id."""
    cfg = load_config(overrides=RUN)
    run_id = cfg.train.run_id
    d = await HivemindDiscovery.create(DiscoveryConfig(initial_peers=(join,), record_ttl_s=3.0), run_id=run_id)
    try:
        me = Member(peer_id=d.peer_id, endpoint=endpoint, bandwidth_bytes_per_s=1e9, state_hash="ab" * 32)
        started.set()
        while not stop.is_set():
            now = d.now()
            await d.publish_run(RunRecord(run_id=run_id, coordinator_id=d.peer_id, config=to_dict(cfg), round=26,
                                          updated_at=now), timeout_s=2.0)
            await d.announce(PeerRecord(run_id=run_id, peer_id=d.peer_id, endpoint=endpoint, round=10**6,
                                        state_hash="ab" * 32, heartbeat_at=now), timeout_s=2.0)
            current = max((e.round for p in peers for e in _rounds(p)), default=0)
            for round_index in range(current, current + 3):
                await d.post_entry(MatchEntry(run_id=run_id, round=round_index, member=me, posted_at=now),
                                   keep_s=30.0, timeout_s=2.0)
                await d.post_group(GroupRecord(run_id=run_id, round=round_index, leader_id=d.peer_id, members=(me,),
                                               window_close_at=now + 5.0), keep_s=30.0, timeout_s=2.0)
            published.set()
            await asyncio.sleep(0.5)
        return d.peer_id
    finally:
        await d.aclose()


def test_a_hivemind_node_without_the_run_key_steers_nothing(procs: ProcessSet, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMTRAIN_RUN_KEY", KEY)  # the coordinator and the peers inherit it; the outsider has none
    _, join = procs.coordinator(RUN, timeout_s=START_S)
    dialed, stop, started, published = DialCounter(), threading.Event(), threading.Event(), threading.Event()
    peers: list[Child] = []  # filled once the outsider publishes: they start into its records
    result: list[str] = []
    outsider = threading.Thread(target=lambda: result.append(asyncio.run(
        _steer(join, peers, dialed.endpoint, stop, started, published))), daemon=True)
    outsider.start()
    try:
        assert published.wait(START_S), "the outsider's DHT did not start"
        peers.extend(procs.peer(n, join) for n in ("a", "b"))
        marks = [0, 0]
        for _ in range(3):  # three committed rounds of both peers while the outsider publishes
            for i, p in enumerate(peers):
                marks[i], _event = wait_round(p, lambda e: e.committed and len(e.members) == 2, timeout_s=ROUND_S,
                                              start=marks[i], what="a committed round of the two peers")
                marks[i] += 1
    finally:
        stop.set()
        outsider.join(30)
        dialed.close()
    assert result, "the outsider's thread did not finish"
    by_round: dict[int, set[str]] = defaultdict(set)
    for p in peers:
        for e in _rounds(p):
            if e.committed:
                by_round[e.round].add(e.hash)
                assert result[0] not in e.members
    assert by_round and all(len(h) == 1 for h in by_round.values()), dict(by_round)
    assert dialed.count == 0
    assert all(e.round < 10**6 for p in peers for e in _rounds(p))  # nobody healed to the outsider's round

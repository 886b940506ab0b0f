"""Coordinator + 3 real peer processes with diloco.pace=time: rounds sized by a shared span, groups formed early.

Over the real control and data planes (hivemind DHT, gRPC all-reduce), each time-paced peer enters
matchmaking during its round's last inner steps (`prematch`) and averages once its Δ is ready.
Asserts every round commits with all three peers and one θ_global hash, and that the rounds after
the first were sized by time (step counts that differ from H and between peers), not by H.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from swarmtrain.telemetry.events import LeaveEvent, RoundEvent
from swarmtrain.testing.procs import ProcessSet

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]

H, ROUNDS = 20, 6
RUN = [
    "model.preset=tiny", "data.max_corpus_bytes=400000", "data.seq_len=32", "data.batch_size=4",
    "inner.warmup_steps=1", f"diloco.inner_steps={H}", f"diloco.rounds={ROUNDS}", "diloco.eval_batches=1",
    "diloco.pace=time", "averaging.min_peers=3", "averaging.matchmaking_timeout_s=5.0",
    "discovery.heartbeat_s=0.5", "discovery.record_ttl_s=5.0", "rpc.call_timeout_s=3.0", "train.threads=1",
]
START_S, RUN_S = 120.0, 180.0


def test_time_paced_peers_commit_every_round_together(procs: ProcessSet) -> None:
    _, join = procs.coordinator(RUN, timeout_s=START_S)
    peers = [procs.peer(n, join) for n in ("a", "b", "c")]
    for p in peers:
        p.wait_ready(timeout_s=START_S)
    for p in peers:
        _, leave = p.wait_for(lambda x: isinstance(x, LeaveEvent), timeout_s=RUN_S, what=f"{p.name} done")
        assert isinstance(leave, LeaveEvent) and leave.reason == "done", p.diagnostics()
    hashes: dict[int, set[str]] = defaultdict(set)
    steps: dict[int, list[int]] = defaultdict(list)
    for p in peers:
        rounds = [x for x in p.snapshot() if isinstance(x, RoundEvent)]
        assert [e.round for e in rounds if e.committed] == list(range(ROUNDS)), p.diagnostics()
        for e in rounds:
            if e.committed:
                assert len(e.members) == 3, (p.name, e.round, e.members, e.reason)
                hashes[e.round].add(e.hash)
            steps[e.round].append(e.steps)
    assert all(len(h) == 1 for h in hashes.values()), dict(hashes)
    assert steps[0] == [H, H, H], "no rates are known before the first round commits"
    later = [s for r in range(1, ROUNDS) for s in steps[r]]
    assert all(1 <= s <= 4 * H for s in later), dict(steps)
    assert any(s != H for s in later), f"time-paced rounds should not all be exactly H steps: {dict(steps)}"

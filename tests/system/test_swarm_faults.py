"""Coordinator + 3 real peer processes: SIGKILL one mid-round, SIGSTOP one past the deadline, heal both.

Asserts the fault-tolerance contract: the survivors keep committing rounds, every committed round has one
θ_global hash on every committed peer, and the killed peer restarts from its checkpoint, heals and
reports the swarm's hash within 2 rounds of the heal it commits after. Synchronisation is by reading the
peers' stdout lines with deadlines only.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from swarmtrain.process.children import Child
from swarmtrain.telemetry.events import HealEvent, LeaveEvent, RoundEvent
from swarmtrain.testing.procs import ProcessSet, sigcont, sigkill, sigstop, wait_round

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]

# Tiny model, 5 inner steps per round, sub-second windows: a round takes ~1-2 s on 2 cores.
TINY_RUN = [
    "model.preset=tiny", "data.max_corpus_bytes=400000", "data.seq_len=32", "data.batch_size=4",
    "inner.warmup_steps=1", "diloco.inner_steps=5", "diloco.rounds=10000", "diloco.eval_batches=1",
    "averaging.min_peers=2", "averaging.matchmaking_timeout_s=1.0", "averaging.allreduce_timeout_s=4.0",
    "averaging.contribution_window_s=1.0",
    "discovery.heartbeat_s=0.5", "discovery.record_ttl_s=3.0", "rpc.call_timeout_s=2.0", "rpc.retries=1",
    "rpc.backoff_s=0.05", "train.threads=1",
]
START_S = 120.0  # a process start (torch import + DHT) on a busy 2-core machine
ROUND_S = 60.0  # generous per-wait deadline: rounds take seconds, aborted ones up to the all-reduce timeout


def _committed_by(child: Child, names: set[str], *, start: int) -> tuple[int, RoundEvent]:
    """The next committed round of `child` whose group is exactly the peers in `names`."""
    return wait_round(child, lambda e: e.committed and len(e.members) == len(names), timeout_s=ROUND_S,
                      start=start, what=f"a committed round among {len(names)} peers")


def _next_index(child: Child) -> int:
    return len(child.snapshot())


def _assert_hashes_agree(procs: ProcessSet) -> int:
    """Every round committed anywhere maps to one θ_global hash; returns the number of such rounds."""
    by_round: dict[int, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for child in procs.children:
        for line in child.snapshot():
            if isinstance(line, RoundEvent) and line.committed:
                by_round[line.round][line.hash].add(f"{child.name}({line.peer[:8]})")
    disagreeing = {r: dict(h) for r, h in by_round.items() if len(h) > 1}
    assert not disagreeing, f"committed peers disagree on θ_global: {disagreeing}"
    return len(by_round)


def test_swarm_survives_kill_and_stop_and_the_killed_peer_heals(procs: ProcessSet, tmp_path: Path) -> None:
    _, join = procs.coordinator(TINY_RUN, timeout_s=START_S)
    ckpt = {n: tmp_path / f"ckpt-{n}" for n in ("a", "b", "c")}
    peers = {n: procs.peer(n, join, checkpoint_dir=ckpt[n]) for n in ("a", "b", "c")}
    ids = {n: str(p.wait_ready(timeout_s=START_S)["peer_id"]) for n, p in peers.items()}
    a, b, c = peers["a"], peers["b"], peers["c"]

    # 1. all three commit a round together.
    _, first = _committed_by(a, set(ids.values()), start=0)
    assert set(first.members) == set(ids.values())

    # 2. SIGKILL c in the middle of a round (a has just finished one; c is in its all-reduce or inner steps).
    wait_round(a, lambda e: e.round > first.round, timeout_s=ROUND_S, what="the round after the first")
    sigkill(c)
    mark_a, mark_b = _next_index(a), _next_index(b)
    for _ in range(2):  # a and b keep committing without c
        mark_a, ev_a = _committed_by(a, {ids["a"], ids["b"]}, start=mark_a)
        mark_b, ev_b = _committed_by(b, {ids["a"], ids["b"]}, start=mark_b)
        mark_a, mark_b = mark_a + 1, mark_b + 1
        assert ids["c"] not in ev_a.members and ids["c"] not in ev_b.members

    # 3. c restarts from its checkpoint (same peer id), heals from a live peer and agrees within 2 rounds.
    c2 = procs.peer("c", join, checkpoint_dir=ckpt["c"])
    assert c2.wait_ready(timeout_s=START_S)["peer_id"] == ids["c"], "a restarted peer keeps its identity"
    swarm_round_at_restart = max(e.round for e in _rounds(a)) + 1
    back_at, back = wait_round(c2, lambda e: e.committed, timeout_s=ROUND_S, what="c's first committed round")
    # Its first heals may be rounds learned from their certificates (the others keep the material since their
    # oldest checkpoint), then a download; on a loaded machine the restarted process can reach its first
    # round's window late and heal once more before it commits. The promise is about the heal it commits after.
    heals = [x for x in c2.snapshot()[:back_at] if isinstance(x, HealEvent)]
    assert heals and heals[-1].to_round >= swarm_round_at_restart, heals
    assert all(h.to_round > h.from_round for h in heals), heals
    last = heals[-1]
    assert back.round <= last.to_round + 2, (
        f"c healed to rounds {[h.to_round for h in heals]} but first committed {back.round}")
    # a's round may show an aborted attempt first (a shard that missed its window on a loaded box)
    # before the retry commits: the commit is what must agree.
    _, same_a = wait_round(a, lambda e: e.round == back.round and e.committed, timeout_s=ROUND_S,
                           what=f"a's round {back.round} committed")
    assert same_a.hash == back.hash

    # 4. SIGSTOP b past every deadline (3 rounds > record TTL and all-reduce timeout): a and c keep
    #    committing without it; SIGCONT, b heals and rejoins.
    sigstop(b)
    mark_a, mark_c = _next_index(a), _next_index(c2)
    for _ in range(3):
        mark_a, ev_a = _committed_by(a, {ids["a"], ids["c"]}, start=mark_a)
        mark_c, _ = _committed_by(c2, {ids["a"], ids["c"]}, start=mark_c)
        mark_a, mark_c = mark_a + 1, mark_c + 1
        assert ids["b"] not in ev_a.members
    resumed_at = _next_index(b)
    sigcont(b)
    _, b_back = wait_round(b, lambda e: e.committed and len(e.members) == 3, timeout_s=ROUND_S * 2,
                           start=resumed_at, what="b back in a 3-peer committed round")
    # c may show an aborted attempt of that round first (its line carries the θ_global it started from)
    _, same_c = wait_round(c2, lambda e: e.round == b_back.round and e.committed, timeout_s=ROUND_S,
                           what=f"c's round {b_back.round} committed")
    assert same_c.hash == b_back.hash

    assert _assert_hashes_agree(procs) >= 6
    for p in (a, b, c2):
        assert p.alive, f"{p.name} died: {p.diagnostics()}"

    # 5. SIGTERM is a graceful leave: exit 0, a leave line, a checkpoint on disk.
    assert a.terminate(timeout_s=ROUND_S) == 0
    _, leave = a.wait_for(lambda x: isinstance(x, LeaveEvent), timeout_s=1.0, what="a leave line")
    assert isinstance(leave, LeaveEvent) and leave.reason == "signal" and Path(leave.checkpoint).is_file()


def _rounds(child: Child) -> list[RoundEvent]:
    return [x for x in child.snapshot() if isinstance(x, RoundEvent)]

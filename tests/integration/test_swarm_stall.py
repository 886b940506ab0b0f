"""A reducer that stalls after the others served their means delays its round but never blocks it
(in-process cluster: real matchmaking, real all-reduce over loopback gRPC, in-memory DHT).

Round STALLED's first session: c's reducer holds every request for its mean far past the round's
deadline (a SIGSTOP, a GC pause, a cut link), while a's and b's reducers serve theirs. Nobody can
complete that session, so nobody asks for votes for it; the retry (a new group, same Δs) gets every
vote and commits, and so do the rounds after it. Before votes fenced a round, a reducer that had
served a mean refused every later attempt of its round, and the swarm stayed at round STALLED.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from swarmtrain.config import load_config
from swarmtrain.roles import Peer
from swarmtrain.telemetry import EventWriter
from swarmtrain.testing import FaultPlan
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

ROUNDS, STALLED = 5, 2
ALLREDUCE_S = 6.0
# The matchmaking window outlasts the spread of the members' ends of a failed attempt on a loaded machine: a
# member whose abort came a few hundred ms after the others' still meets them in the retry's window instead of
# healing past the round and chasing the next windows.
RUN = [
    *TINY_RUN, "averaging.matchmaking_timeout_s=2.0", f"averaging.allreduce_timeout_s={ALLREDUCE_S}",
    "averaging.contribution_window_s=2", "discovery.heartbeat_s=0.2", "discovery.record_ttl_s=3.0",
    "rpc.call_timeout_s=2.0", f"diloco.rounds={ROUNDS}",
]


def test_a_reducer_stalling_after_the_others_served_delays_its_round_but_never_blocks_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="swarmtrain.driver")
    plan = FaultPlan()

    def stall_c(peer: Peer) -> None:
        # every request for c's mean in the round's first session (one per member) waits past the deadline
        plan.add(peer=peer.discovery.peer_id, round=STALLED, call="mean", action="delay",  # type: ignore[union-attr]
                 delay_s=3 * ALLREDUCE_S, times=3)

    async def main() -> dict[str, EventLog]:
        services = LoopbackServices(faults=plan)
        await publish_run(services.registry, RUN)
        logs = {n: EventLog() for n in "abc"}
        peers = {n: Peer(load_config(overrides=[f"checkpoint.dir={str(tmp_path / n)!r}"]),
                         writer=EventWriter(logs[n]), services=services) for n in "abc"}
        stop = asyncio.Event()
        tasks = [asyncio.create_task(run_peer(peers[n], stop, started=stall_c if n == "c" else None)) for n in "abc"]
        try:
            assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=150) == ["done"] * 3
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        return logs

    logs = asyncio.run(main())
    rounds, told = {n: log.rounds() for n, log in logs.items()}, story(logs)
    assert sum(1 for site, _ in plan.hits if site.call == "mean") == 3, f"the stall never happened: {told}"
    by_round = hashes_by_round(logs)
    assert sorted(by_round) == list(range(ROUNDS)) and all(len(h) == 1 for h in by_round.values()), told
    for n, events in rounds.items():
        stalled = [e for e in events if e.round == STALLED]
        assert stalled[0].committed is False and stalled[-1].committed, (n, told)
        assert [e.round for e in events if e.committed] == list(range(ROUNDS)), (n, told)
        # (a member whose retried push missed a short window still commits the others' mean)
        assert all(len(e.members) >= 2 for e in events if e.committed), (n, told)
    # The round machine logged each step of the stalled round on every peer: a group formed and reduced,
    # the session aborted, and a later attempt of the same round (same Δ, not retrained) committed.
    transitions: dict[str, list[dict[str, object]]] = {}
    for record in caplog.records:
        peer, _, line = record.getMessage().partition(": ")
        if line.startswith('{"event": "transition"'):
            transitions.setdefault(peer, []).append(json.loads(line))
    assert len(transitions) == 3, told
    for peer, steps in transitions.items():
        path = [(t["target"], t["attempt"]) for t in steps if t["round"] == STALLED]
        assert ("reducing", 0) in path and ("aborted", 0) in path, (peer, path)
        assert path[-1][0] == "committed" and path[-1][1] >= 1, (peer, path)
        assert ("training", 1) not in path, (peer, path)  # the retry averaged the Δ it had trained

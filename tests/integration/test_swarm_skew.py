"""Clock skew within the tolerance changes nothing (in-process cluster: real matchmaking and all-reduce
over loopback gRPC, in-memory DHT; each peer's machine clock is offset from the registry's).

One peer's clock runs SKEW_S ahead, one SKEW_S behind, one is right, and the record TTL is shorter than
the two skewed clocks are apart: each peer estimates the swarm's clock from the others' heartbeats and
stamps and compares times on it, so once the three have met, every round commits with all three and
one θ_global. Without the correction the skewed peers are late for the windows the others open.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from swarmtrain.config import load_config
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
from swarmtrain.testing.wait import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROUNDS, SKEW_S, MIN_TOGETHER = 8, 5.0, 4
# The matchmaking window outlasts a heal on a loaded machine: a peer that healed into a round (it was late
# for the previous one, or joined) still meets the others in that round's window instead of chasing them. A
# round's inner steps (60, about a second) outlast a heal too: with 3 steps two peers ran a round every 0.15 s,
# a peer that healed was behind again before it could post, and early close does not wait for a peer behind the
# round without steps under way, so it chased them to the end in about half the runs.
RUN = [
    *TINY_RUN, "averaging.matchmaking_timeout_s=4", "averaging.allreduce_timeout_s=10", "diloco.inner_steps=60",
    "averaging.contribution_window_s=3", "discovery.heartbeat_s=0.25", "discovery.record_ttl_s=8",
    "rpc.call_timeout_s=3.0", f"diloco.rounds={ROUNDS}",
]


def test_clocks_skewed_within_the_tolerance_commit_every_round_together(tmp_path: Path) -> None:
    async def main() -> dict[str, EventLog]:
        services = LoopbackServices(skews_s=[SKEW_S, -SKEW_S, 0.0])
        await publish_run(services.registry, RUN)
        logs = {n: EventLog() for n in "abc"}
        peers = {n: Peer(load_config(overrides=[f"checkpoint.dir={str(tmp_path / n)!r}"]),
                         writer=EventWriter(logs[n]), services=services) for n in "abc"}
        stop = asyncio.Event()
        tasks = []
        for n in "abc":  # started one after the other: the skews go to a, b, c in that order
            tasks.append(asyncio.create_task(run_peer(peers[n], stop)))
            await asyncio.to_thread(lambda p=peers[n]: _wait_started(p))
        try:
            assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=150) == ["done"] * 3
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        # the clocks the peers stamp with (machine clock + correction) agree, on some common time
        swarm = {n: skew + p.discovery.clock_offset_s  # type: ignore[union-attr]
                 for (n, p), skew in zip(peers.items(), (SKEW_S, -SKEW_S, 0.0), strict=True)}
        assert max(swarm.values()) - min(swarm.values()) < SKEW_S / 2, swarm
        return logs

    logs = asyncio.run(main())
    rounds, told = {n: log.rounds() for n, log in logs.items()}, story(logs)
    by_round = hashes_by_round(logs)
    assert sorted(by_round) == list(range(ROUNDS)) and all(len(h) == 1 for h in by_round.values()), told
    # Peers start one after the other, each alone until the next arrives: the first rounds may go on
    # without a late starter (it heals), and on a loaded machine the three may take a few rounds to meet. Once
    # they have committed a round together, every later round commits with all three.
    together = [r for r in range(ROUNDS)
                if all(any(e.committed and e.round == r and len(e.members) == 3 for e in events)
                       for events in rounds.values())]
    assert together and together[0] <= ROUNDS - MIN_TOGETHER, ("the three never settled", told)
    for n, events in rounds.items():
        committed = [e for e in events if e.committed and e.round >= together[0]]
        assert [e.round for e in committed] == list(range(together[0], ROUNDS)), (n, together[0], told)
        assert all(len(e.members) == 3 for e in committed), (n, told)

def _wait_started(peer: Peer) -> None:
    wait_until(lambda: peer.discovery is not None, timeout_s=60, what="the peer's discovery")

"""θ_global agreement at run time, on the in-process cluster (real matchmaking, real all-reduce over
loopback gRPC, in-memory DHT): a peer whose θ_global went astray is left out of the next group and
heals to the swarm's, instead of averaging with it and staying apart for good."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest

from swarmtrain.config import load_config
from swarmtrain.roles import Peer
from swarmtrain.telemetry import EventWriter, HealEvent
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

ROUNDS, BAD_ROUND = 5, 2
RUN = [
    *TINY_RUN, "averaging.matchmaking_timeout_s=1.0", "averaging.allreduce_timeout_s=10",
    "averaging.contribution_window_s=3", "discovery.heartbeat_s=0.2", "discovery.record_ttl_s=3.0",
    "rpc.call_timeout_s=3.0", f"diloco.rounds={ROUNDS}",
]


def _corrupt_at(peer: Peer, round_index: int) -> None:
    """When `peer` reaches `round_index`, its θ_global is perturbed in place (as a bad heal would leave it)."""
    assert peer.worker is not None
    worker, train = peer.worker, peer.worker.train_inner
    done = False

    def train_then_corrupt(*args: object, **kwargs: object) -> object:
        nonlocal done
        if worker.round == round_index and not done:
            done = True
            bad = worker.theta_global.clone()
            bad[:100] += 0.01
            worker.adopt_global(round_index=worker.round, theta_global=bad,
                                outer_momentum=worker.outer.state_tensors().get("momentum"))
            assert peer.part is not None  # its next match entry announces the corrupted state's digest
        return train(*args, **kwargs)  # type: ignore[arg-type]

    worker.train_inner = train_then_corrupt  # type: ignore[method-assign,assignment]


def test_a_peer_with_a_corrupted_theta_is_left_out_and_heals(tmp_path: Path) -> None:
    async def main() -> dict[str, EventLog]:
        services = LoopbackServices()
        await publish_run(services.registry, RUN)
        outs = {n: EventLog() for n in "abc"}
        stop = asyncio.Event()
        peers = {n: Peer(load_config(overrides=[f"checkpoint.dir={str(tmp_path / n)!r}"]),
                         writer=EventWriter(outs[n]), services=services) for n in "abc"}
        corrupt = functools.partial(_corrupt_at, round_index=BAD_ROUND)
        tasks = [asyncio.create_task(run_peer(peers[n], stop, started=corrupt if n == "c" else None)) for n in "abc"]
        assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=150) == ["done"] * 3
        return outs

    outs = asyncio.run(main())
    told = story(outs)
    rounds = {n: out.rounds() for n, out in outs.items()}
    left_out = [e for e in rounds["c"] if not e.committed and "θ_global differs" in e.reason]
    assert left_out and left_out[0].round == BAD_ROUND, told
    heals = [e for e in outs["c"].events() if isinstance(e, HealEvent)]
    assert any(h.from_round == BAD_ROUND and h.source != "certificate" for h in heals), told
    by_round = hashes_by_round(outs)
    assert sorted(by_round) == list(range(ROUNDS)) and all(len(h) == 1 for h in by_round.values()), told
    assert any(e.committed and e.round > BAD_ROUND and len(e.members) == 3 for e in rounds["c"]), \
        f"c never averaged with the swarm again: {told}"

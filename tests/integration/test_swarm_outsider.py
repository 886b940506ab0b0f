"""Neither outsiders nor a lying donor steer a keyed swarm (in-process cluster: real matchmaking and all-reduce over
loopback gRPC, in-memory DHT). A peer without the run key and a peer left over from another run (another key, round
26) publish, all run long: a peer record far ahead with a θ to heal from, a second run record, match entries
with the smallest id (the leader's) and groups naming the honest peers. The honest peers commit every round
with one hash and without them, and never dial their endpoint. A key holder that serves another θ_global
than the one it and the swarm announce is refused by a joiner, which heals from an honest donor."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmtrain.config import load_config, to_dict
from swarmtrain.discovery import GroupRecord, InMemoryDiscovery, MatchEntry, PeerRecord, RunRecord
from swarmtrain.roles import Peer
from swarmtrain.round.group import Member
from swarmtrain.sync.transfer import StateSnapshot
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
from swarmtrain.testing.endpoints import DialCounter

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROUNDS = 4
KEY = "the run's secret"
RUN = [
    *TINY_RUN, "averaging.matchmaking_timeout_s=1.0", "averaging.allreduce_timeout_s=10",
    "averaging.contribution_window_s=3", "discovery.heartbeat_s=0.2", "discovery.record_ttl_s=3.0",
    "rpc.call_timeout_s=3.0", f"diloco.rounds={ROUNDS}",
]


async def _steer(intruder: InMemoryDiscovery, peers: dict[str, Peer], endpoint: str, *, ahead: int,
                 done: asyncio.Event) -> None:
    """Everything an intruder can publish, again and again until `done`."""
    cfg = load_config(overrides=RUN)
    run_id, me = cfg.train.run_id, intruder.peer_id
    mine = Member(peer_id=me, endpoint=endpoint, client_mode=False, bandwidth_bytes_per_s=1e9, state_hash="ab" * 32)
    while not done.is_set():
        now = intruder.now()
        await intruder.publish_run(RunRecord(run_id=run_id, coordinator_id=me, config=to_dict(cfg), round=ahead,
                                             updated_at=now), timeout_s=1.0)
        await intruder.announce(PeerRecord(run_id=run_id, peer_id=me, endpoint=endpoint, round=ahead,
                                           state_hash="ab" * 32, heartbeat_at=now), timeout_s=1.0)
        honest = [p.discovery.peer_id for p in peers.values() if p.discovery is not None]
        members = tuple(sorted([mine, *(Member(peer_id=h, endpoint=endpoint, client_mode=False,
                                               bandwidth_bytes_per_s=1e9) for h in honest)],
                               key=lambda m: m.peer_id))
        for round_index in range(ROUNDS):
            for attempt in range(3):
                await intruder.post_entry(MatchEntry(run_id=run_id, round=round_index, member=mine, posted_at=now,
                                                     attempt=attempt), keep_s=60.0, timeout_s=1.0)
                await intruder.post_group(GroupRecord(run_id=run_id, round=round_index, leader_id=me, members=members,
                                                      window_close_at=now + 5.0, attempt=attempt),
                                          keep_s=60.0, timeout_s=1.0)
        await asyncio.sleep(0.1)


def test_records_of_peers_without_the_run_key_steer_nothing(tmp_path: Path) -> None:
    listener = DialCounter()

    async def main() -> dict[str, EventLog]:
        services = LoopbackServices()
        cfg = await publish_run(services.registry, RUN, run_key=KEY)
        outs = {n: EventLog() for n in "abc"}
        peers = {n: Peer(load_config(overrides=[f"checkpoint.dir={str(tmp_path / n)!r}", f"rpc.run_key={KEY!r}"]),
                         writer=EventWriter(outs[n]), services=services) for n in "abc"}
        # "000" sorts before every honest id: it would lead every group it entered.
        outsider = InMemoryDiscovery(services.registry, run_id=cfg.train.run_id, record_ttl_s=3.0, peer_id="000")
        stranger = InMemoryDiscovery(services.registry, run_id=cfg.train.run_id, record_ttl_s=3.0, peer_id="001",
                                     run_key="another run's key")
        stop, done = asyncio.Event(), asyncio.Event()
        intruders = [asyncio.create_task(_steer(outsider, peers, listener.endpoint, ahead=10**6, done=done)),
                     asyncio.create_task(_steer(stranger, peers, listener.endpoint, ahead=26, done=done))]
        tasks = [asyncio.create_task(run_peer(peers[n], stop)) for n in "abc"]
        try:
            assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=150) == ["done"] * 3
        finally:
            done.set()
            await asyncio.gather(*intruders)
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        listener.close()
    told = story(outs)
    by_round = hashes_by_round(outs)
    assert sorted(by_round) == list(range(ROUNDS)) and all(len(h) == 1 for h in by_round.values()), told
    for out in outs.values():
        committed = [e for e in out.rounds() if e.committed]
        assert [e.round for e in committed] == list(range(ROUNDS)), told
        assert all(len(e.members) == 3 and not {"000", "001"} & set(e.members) for e in committed), told
    assert listener.count == 0


def _lie(peer: Peer) -> None:
    """From now on `peer` (a key holder) announces the swarm's state but serves θ_global + 0.01."""
    assert peer.plane is not None
    states = peer.plane.states  # type: ignore[attr-defined]
    honest = states._live

    @contextlib.contextmanager
    def lying() -> Iterator[tuple[object, StateSnapshot] | None]:
        with honest() as live:
            if live is None:
                yield None
                return
            key, snapshot = live
            bad = {name: t + 0.01 for name, t in snapshot.params.items()}
            yield ("lie", key), dataclasses.replace(snapshot, params=bad)

    states.serve(lying)


@pytest.mark.parametrize("donors", [1, 3])
def test_a_joiner_refuses_a_donor_serving_another_theta_and_heals_from_an_honest_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, donors: int) -> None:
    """d joins late. The donor it asks first (its order is a hash of the two ids) announces the swarm's
    (round, θ hash) but serves another θ_global. One donor at a time: refused by hash, and d heals from
    the next donor. Three at once: the liar's blob is not the one the two others serve, so d takes a
    range from each of the honest two and never the liar's bytes. Then d commits with the swarm.

    The run lasts until d has committed a round (every peer is stopped then), not a fixed number of
    rounds: on a loaded machine d can meet the swarm mid-transition twice, heal twice, and so need
    several rounds before its first commit. `rounds` only bounds the run."""
    rounds, join_at = 40, 2
    run = [*RUN[:-1], f"diloco.rounds={rounds}"]
    caplog.set_level(logging.INFO, logger="swarmtrain.driver")

    async def main() -> tuple[dict[str, EventLog], str]:
        services = LoopbackServices()
        await publish_run(services.registry, run, run_key=KEY)
        outs = {n: EventLog() for n in "abcd"}
        peers = {n: Peer(load_config(overrides=[f"checkpoint.dir={str(tmp_path / n)!r}", f"rpc.run_key={KEY!r}"]),
                         writer=EventWriter(outs[n]), services=services) for n in "abcd"}
        stop = asyncio.Event()
        tasks = [asyncio.create_task(run_peer(peers[n], stop)) for n in "abc"]
        while not any(e.committed and e.round >= join_at for e in outs["a"].rounds()):
            await asyncio.sleep(0.05)
        d_id = services.registry.new_peer_id()  # the id d's discovery would take: take it for d by hand
        services.ids["d"] = d_id
        peers["d"] = Peer(load_config(overrides=[f"checkpoint.dir={str(tmp_path / 'd')!r}", f"rpc.run_key={KEY!r}",
                                                 "discovery.identity_path='d'", f"rpc.state_donors={donors}"]),
                          writer=EventWriter(outs["d"]), services=services)
        ids = {n: peers[n].discovery.peer_id for n in "abc"}  # type: ignore[union-attr]
        first = min(ids, key=lambda n: hashlib.sha256(f"{d_id}|{ids[n]}".encode()).digest())
        _lie(peers[first])
        tasks.append(asyncio.create_task(run_peer(peers["d"], stop)))
        deadline = asyncio.get_running_loop().time() + 120
        while not any(e.committed for e in outs["d"].rounds()):
            ended = [t for t in tasks if t.done()]
            assert not ended, (f"a peer ended before d committed: {[t.result() for t in ended]}", story(outs))
            assert asyncio.get_running_loop().time() < deadline, ("d committed no round in 120 s", story(outs))
            await asyncio.sleep(0.05)
        stop.set()
        assert await asyncio.wait_for(asyncio.gather(*tasks), timeout=60) == ["signal"] * 4
        return outs, ids[first]

    outs, liar = asyncio.run(main())
    told = story(outs)
    heals = [e for e in outs["d"].events() if isinstance(e, HealEvent)]
    assert heals and liar not in heals[0].source.split(","), told
    if donors == 1:
        refused = [r.getMessage() for r in caplog.records if "the swarm announces: refused" in r.getMessage()]
        assert any(liar in m for m in refused), refused
    else:
        assert len(heals[0].source.split(",")) == 2, told  # a range from each honest donor
    by_round = hashes_by_round(outs)
    assert all(len(h) == 1 for h in by_round.values()), told
    assert any(e.committed for e in outs["d"].rounds()), told

"""The Peer composition root on the in-process cluster (real matchmaking, all-reduce and round decision over
loopback gRPC, the in-memory DHT twin, a coordinator that fixes round 0's voters): rounds agree, a late
joiner heals, stop checkpoints, a restart resumes, a finisher serves its state, data slots are the run's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest
import torch
from peer_harness import (
    RUN,
    live_records,
    peer_config,
    run_alone_then_stop,
    run_started_apart,
    run_with_late_joiner,
    until,
)

from swarmtrain.config import ConfigError, load_config
from swarmtrain.data import ShardedBatches, load_corpus
from swarmtrain.discovery import InMemoryDiscovery, PeerRecord
from swarmtrain.peer import merge_run_config
from swarmtrain.peer.services import PeerError
from swarmtrain.roles import Peer
from swarmtrain.sync.checkpoint import load_latest_checkpoint
from swarmtrain.telemetry import EventWriter, HealEvent, LeaveEvent, ReadyLine
from swarmtrain.testing.cluster import (
    EventLog,
    LoopbackServices,
    hashes_by_round,
    publish_run,
    run_peer,
    story,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_peers_agree_and_a_late_joiner_heals_to_the_swarm() -> None:
    async def main() -> None:
        logs, peers = await run_with_late_joiner(RUN)
        told = story(logs)
        ids = {n: p.discovery.peer_id for n, p in peers.items() if p.discovery is not None}

        heals = [e for e in logs["c"].events() if isinstance(e, HealEvent)]
        assert heals and heals[0].from_round == 0 and heals[-1].to_round >= 2, told
        # It learns what it can from certificates, then downloads the newest state from a and b.
        transfers = [e for e in heals if e.source != "certificate"]
        assert transfers and set(transfers[0].source.split(",")) <= {ids["a"], ids["b"]}, told
        # Every heal lands on a state the swarm committed: its digest is that commit's.
        committed = {e.round + 1: e.hash for n in "ab" for e in logs[n].rounds() if e.committed}
        assert all(committed[e.to_round] == e.hash for e in heals), told
        by_round = hashes_by_round(logs)
        assert sorted(by_round) == [0, 1, 2, 3, 4] and all(len(h) == 1 for h in by_round.values()), told
        assert any(e.committed and len(e.members) == 3 for e in logs["c"].rounds()), f"c rejoined the group: {told}"
        # Every round line says what the control plane cost since the line before; a committed round's holds at
        # least the round's entry (a store) and the reads of the attempt's entries and of the live peers.
        for log in logs.values():
            for e in log.rounds():
                assert None not in (e.dht_reads, e.dht_writes, e.dht_slots, e.dht_decoded), e
                if e.committed:
                    assert e.dht_reads and e.dht_reads >= 2 and e.dht_writes and e.dht_slots, e
        leaves = [e for log in logs.values() for e in log.events() if isinstance(e, LeaveEvent)]
        assert {e.reason for e in leaves} == {"done"} and len({e.hash for e in leaves}) == 1, leaves

    asyncio.run(main())


def test_peers_that_started_apart_meet_in_one_attempt() -> None:
    """a aborts round 0 alone and keeps retrying it with the Δ it trained; b starts later and joins a retry."""

    async def main() -> None:
        logs, _ = await run_started_apart([*RUN, "diloco.rounds=2"])
        told = story(logs)
        committed = {n: [(e.round, e.hash) for e in log.rounds() if e.committed] for n, log in logs.items()}
        assert committed["a"] == committed["b"] and [r for r, _ in committed["a"]] == [0, 1], told
        retries = [e for e in logs["a"].rounds() if e.round == 0]
        assert len(retries) >= 2 and retries[0].compute_s > 0 and all(e.compute_s == 0 for e in retries[1:]), \
            f"a retried round 0 without training it again: {told}"

    asyncio.run(main())


def test_stop_checkpoints_and_a_restarted_peer_resumes_with_its_id(tmp_path: Path) -> None:
    async def main() -> None:
        log, peer, services = await run_alone_then_stop(tmp_path, RUN)
        (leave,) = [e for e in log.events() if isinstance(e, LeaveEvent)]
        # the leave line names the checkpoint written on leaving: the newest in the directory
        assert leave.reason == "signal" and Path(leave.checkpoint).is_file()
        saved = load_latest_checkpoint(tmp_path / "p")
        assert saved is not None and saved.path == Path(leave.checkpoint)
        assert (saved.meta["worker"]["round"], saved.meta["hash"]) == (leave.round, leave.hash)
        assert await live_records(services.registry, peer.cfg.train.run_id) == (), "leaving withdraws the record"

        log2 = EventLog()
        again = Peer(peer_config(tmp_path / "p"), writer=EventWriter(log2), services=services)
        info = await again.start()
        try:
            assert (info["peer_id"], info["round"], info["hash"]) == (peer._peer_id, leave.round, leave.hash)
            (record,) = await live_records(services.registry, peer.cfg.train.run_id)
            assert (record.peer_id, record.round, record.state_hash) == (peer._peer_id, leave.round, leave.hash)
        finally:
            await again.aclose("signal")
        assert isinstance(log2.events()[0], ReadyLine)

    asyncio.run(main())


def test_a_peers_data_plane_serves_on_the_peers_own_event_loop(tmp_path: Path) -> None:
    """One loop per process: the node's server and channels run on the loop the peer runs on, with no thread of
    their own, and a blocking call from that loop is refused instead of waiting for itself."""

    async def main() -> None:
        services = LoopbackServices()
        await publish_run(services.registry, [*RUN, "averaging.min_peers=1"])
        before = {t.ident for t in threading.enumerate()}
        peer = Peer(peer_config(tmp_path / "p"), writer=EventWriter(EventLog()), services=services)
        await peer.start()
        try:
            assert peer.plane is not None
            node = peer.plane.node
            assert node.running and node.loop is asyncio.get_running_loop()
            started = [t.name for t in threading.enumerate() if t.ident not in before]
            assert not [name for name in started if name.startswith("rpc-")], started
            state, served = await peer.plane.fetch_state([peer.endpoint])  # served and fetched on this one loop
            assert served == (peer.endpoint,) and state.round == 0
            with pytest.raises(RuntimeError, match="would block it"):
                node.run(asyncio.sleep(0), timeout_s=1.0)
        finally:
            await peer.aclose("signal")
        assert not node.running

    asyncio.run(main())


def test_a_restarted_peer_shows_its_certificates_and_announces_the_retirements_its_votes_hold(
        tmp_path: Path) -> None:
    """A leave stores the voter's retirement before it announces the departure: a process killed between the
    two left the others counting a voter that grants nothing more (here the departure record is deleted, as
    if never stored). The restarted peer announces it; and it shows learners the certificates it resumed with,
    not only those of rounds it commits after the restart."""
    async def main() -> None:
        log, peer, services = await run_alone_then_stop(tmp_path, RUN)
        (leave,) = [e for e in log.events() if isinstance(e, LeaveEvent)]
        run_id = peer.cfg.train.run_id
        reader = InMemoryDiscovery(services.registry, run_id=run_id, record_ttl_s=60.0, peer_id="reader")
        (departure,) = await reader.departures(timeout_s=5.0)
        (retired,) = departure.retirements[""]
        services.registry.delete(reader._key("departures"), peer._peer_id)
        assert await reader.departures(timeout_s=5.0) == ()

        again = Peer(peer_config(tmp_path / "p"), writer=EventWriter(EventLog()), services=services)
        await again.start()
        try:
            async def announced() -> bool:
                return any(retired in d.retirements.get("", ()) for d in await reader.departures(timeout_s=5.0))

            deadline = asyncio.get_running_loop().time() + 30.0
            while not await announced():
                assert asyncio.get_running_loop().time() < deadline, "the stored retirement was not announced"
                await asyncio.sleep(0.05)
            assert again.plane is not None
            cert = again.plane.averager.voter.certificates.get(leave.round - 1)
            assert cert is not None and cert.value.result == leave.hash  # the round that led to its state
        finally:
            await again.aclose("signal")

    asyncio.run(main())


def test_a_peer_alone_that_left_and_came_back_commits_the_round_it_left(tmp_path: Path) -> None:
    """The only voter of its round left gracefully (retiring its incarnation) with nobody else at the round:
    restarted from its directory it votes as its next incarnation, which its retirement names as the round's
    successor. Before, the round had no voter left and the peer waited for good."""
    async def main() -> None:
        log, _, services = await run_alone_then_stop(tmp_path, RUN)
        (leave,) = [e for e in log.events() if isinstance(e, LeaveEvent)]
        log2, stop = EventLog(), asyncio.Event()
        again = Peer(peer_config(tmp_path / "p"), writer=EventWriter(log2), services=services)
        task = asyncio.create_task(run_peer(again, stop))
        try:
            await until(lambda: any(e.committed and e.round == leave.round for e in log2.rounds()), timeout_s=60,
                        what="the round it left committed", tasks=[task], logs={"p": log2})
        finally:
            stop.set()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_a_checkpoint_of_another_run_with_the_same_run_id_is_refused_naming_both_nonces(tmp_path: Path) -> None:
    """A checkpoint directory left by an older run of the same run_id (and model) at a later round: the
    new run's nonce differs, so the peer refuses it instead of resuming the old run's weights."""
    async def main() -> None:
        _, peer, _ = await run_alone_then_stop(tmp_path, [*RUN, "train.run_nonce=old"])
        saved = sorted(p.name for p in (tmp_path / "p").iterdir())
        services = LoopbackServices()
        await publish_run(services.registry, [*RUN, "train.run_nonce=new"])
        again = Peer(peer_config(tmp_path / "p"), writer=EventWriter(EventLog()), services=services)
        with pytest.raises(PeerError, match=r"another run of 'swarmtrain' \(nonce 'old', this run's is 'new'\)"):
            await again.start()
        await again.aclose("error")
        assert sorted(p.name for p in (tmp_path / "p").iterdir()) == saved  # nothing written over it
        assert peer.cfg.train.run_nonce == "old"

    asyncio.run(main())


def test_a_finished_peer_serves_state_until_a_straggler_behind_the_last_round_catches_up(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="swarmtrain.driver")

    async def main() -> None:
        services = LoopbackServices()
        cfg = await publish_run(services.registry, [*RUN, "diloco.rounds=2", "averaging.min_peers=1"])
        run_id = cfg.train.run_id
        straggler = InMemoryDiscovery(services.registry, run_id=run_id, record_ttl_s=60.0, peer_id="straggler")

        async def announce(round_index: int) -> None:
            await straggler.announce(PeerRecord(run_id=run_id, peer_id="straggler", endpoint="127.0.0.1:1",
                                                round=round_index, heartbeat_at=straggler.now()), timeout_s=1.0)

        log, stop = EventLog(), asyncio.Event()
        peer = Peer(peer_config(tmp_path / "p"), writer=EventWriter(log), services=services)
        task = asyncio.create_task(run_peer(peer, stop))
        try:
            # Once the peer is past round 0 (not before: a worker at round 0 would be one of its voters), a
            # worker record at round 1 shows up: it missed the last round and can only finish by healing.
            await until(lambda: peer.worker is not None and peer.worker.round >= 1, timeout_s=60,
                        what="round 0 committed", tasks=[task], logs={"p": log})
            await announce(1)
            lingering = "run done; serving state until ['straggler'] catch up"
            await until(lambda: any(lingering in r.getMessage() for r in caplog.records), timeout_s=60,
                        what="the run done", tasks=[task], logs={"p": log})
            assert [e.round for e in log.rounds() if e.committed] == [0, 1] and not task.done()
            assert peer.plane is not None
            served, _ = await peer.plane.fetch_state([peer.endpoint])  # over gRPC, as a joiner downloads it
            assert served.round == 2, "it still serves its final state"
            (record,) = [r for r in await live_records(services.registry, run_id) if r.peer_id == peer._peer_id]
            assert (record.round, record.state_hash) == (2, served.digest), "it announces the state it serves"
            assert served.digest == log.rounds()[-1].hash, "the state its last commit made"
            await announce(2)  # the straggler healed
            assert await asyncio.wait_for(task, timeout=30) == "done"
        finally:
            stop.set()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_merge_keeps_local_sections_and_refuses_run_wide_overrides() -> None:
    swarm = load_config(overrides=["model.preset=small", "rpc.call_timeout_s=9", "train.seed=7"])
    local = load_config(overrides=["rpc.port=5555", "train.threads=1", "model.preset=tiny"])
    merged = merge_run_config(swarm, local, local_overrides=["rpc.port=5555", "train.threads=1"])
    assert merged.model.preset == "small" and merged.train.seed == 7
    assert merged.rpc.port == 5555 and merged.rpc.call_timeout_s == local.rpc.call_timeout_s
    assert merged.train.threads == 1
    with pytest.raises(ConfigError, match=r"model\.preset"):
        merge_run_config(swarm, local, local_overrides=["model.preset=tiny"])


def test_merge_takes_rpc_tls_from_the_run_and_refuses_a_peers_own() -> None:
    """A TLS peer and a plain one cannot talk: rpc.tls is the run's, whatever the peer's file says."""
    for run_tls, local_tls in ((True, False), (False, True)):
        swarm = load_config(overrides=[f"rpc.tls={str(run_tls).lower()}"])
        local = load_config(overrides=[f"rpc.tls={str(local_tls).lower()}", "rpc.port=5555"])
        merged = merge_run_config(swarm, local)
        assert merged.rpc.tls is run_tls and merged.rpc.port == 5555
    with pytest.raises(ConfigError, match=r"rpc\.tls: comes from the swarm"):
        merge_run_config(swarm, local, local_overrides=["rpc.tls=true"])


def test_merge_takes_the_peers_shard_index_and_refuses_one_the_run_has_not() -> None:
    swarm = load_config(overrides=["data.num_shards=4", "data.batch_size=2"])
    local = load_config(overrides=["data.shard_index=3"])
    merged = merge_run_config(swarm, local, local_overrides=["data.shard_index=3"])
    assert (merged.data.num_shards, merged.data.shard_index, merged.data.batch_size) == (4, 3, 2)
    with pytest.raises(ConfigError, match=r"data\.shard_index: 4 is not below data\.num_shards=4"):
        merge_run_config(swarm, load_config(overrides=["data.shard_index=4"]), local_overrides=["data.shard_index=4"])
    with pytest.raises(ConfigError, match=r"data\.batch_size"):
        merge_run_config(swarm, local, local_overrides=["data.batch_size=8"])


def test_peers_of_a_sharded_run_read_the_data_parallel_slots_from_the_start_step() -> None:
    """num_shards=2, start_step=7: peer k reads DDP rank k's windows from step 7 on; the slots never overlap.

    A peer is refused a slot that a live peer reads; a peer given no slot takes the lowest free one,
    and is refused when there is none."""

    async def main() -> None:
        services = LoopbackServices()
        cfg = await publish_run(services.registry, [*RUN, "data.num_shards=2", "data.start_step=7", "train.seed=3"])
        train = load_corpus(cfg.data).train
        seen: list[set[int]] = []
        for k in (0, 1):
            mine = f"data.shard_index={k}"
            peer = Peer(peer_config(None, mine), writer=EventWriter(EventLog()), services=services,
                        local_overrides=[mine])
            await peer.start()
            try:
                assert peer.worker is not None
                batches = peer.worker.batches
                assert isinstance(batches, ShardedBatches) and batches.position == 7
                rank = ShardedBatches(train, worker_index=k, num_workers=2, batch_size=4, seq_len=32, seed=3)
                for step in range(7, 40):
                    assert torch.equal(batches.windows_at(step), rank.windows_at(step))
                seen.append({int(w) for step in range(7, 40) for w in batches.windows_at(step)})
            finally:
                await peer.aclose("signal")
        assert len(seen[0]) == len(seen[1]) == 33 * 4 and not seen[0] & seen[1]

        first = Peer(peer_config(None, "data.shard_index=1"), writer=EventWriter(EventLog()), services=services)
        await first.start()
        auto = Peer(peer_config(None), writer=EventWriter(EventLog()), services=services)
        try:  # a second peer on a slot a live peer reads is refused
            again = Peer(peer_config(None, "data.shard_index=1"), writer=EventWriter(EventLog()), services=services)
            with pytest.raises(PeerError, match=rf"data shard 1 of 2 is already read by live peer {first._peer_id}"):
                await again.start()
            await again.aclose("error")
            await auto.start()  # no slot given: the lowest free one
            assert auto.cfg.data.shard_index == 0 and auto.worker is not None
            assert auto.worker.batches.state_dict()["worker_index"] == 0  # type: ignore[attr-defined]
            full = Peer(peer_config(None), writer=EventWriter(EventLog()), services=services)
            with pytest.raises(PeerError, match=r"all 2 data shards of run 'swarmtrain' are read by live peers"):
                await full.start()
            await full.aclose("error")
        finally:
            await auto.aclose("signal")
            await first.aclose("signal")

    asyncio.run(main())


def test_a_run_that_does_not_shard_refuses_a_peer_with_a_shard_index() -> None:
    async def main() -> None:
        services = LoopbackServices()
        await publish_run(services.registry, RUN)
        peer = Peer(peer_config(None, "data.shard_index=0"), writer=EventWriter(EventLog()), services=services,
                    local_overrides=["data.shard_index=0"])
        with pytest.raises(PeerError, match=r"data\.shard_index=0 is set, but run 'swarmtrain' does not shard"):
            await peer.start()
        await peer.aclose("error")

    asyncio.run(main())


def test_a_restarted_peer_goes_on_in_its_checkpoints_slot_and_refuses_another(tmp_path: Path) -> None:
    async def main() -> None:
        services = LoopbackServices()
        await publish_run(services.registry, [*RUN, "data.num_shards=3"])

        def peer(*slot: str) -> Peer:
            return Peer(peer_config(tmp_path / "p", *slot), writer=EventWriter(EventLog()), services=services,
                        local_overrides=list(slot))

        first = peer("data.shard_index=2")
        await first.start()
        await first.aclose("signal")  # leaves a checkpoint of slot 2
        moved = peer("data.shard_index=1")
        with pytest.raises(PeerError, match=r"data layout.*worker_index=2, this stream has 1"):
            await moved.start()
        await moved.aclose("error")  # must not leave a fresh state as the newest checkpoint
        again = peer()
        await again.start()  # no slot given: slots 0 and 1 are free, but its checkpoint read slot 2
        try:
            assert again.cfg.data.shard_index == 2
        finally:
            await again.aclose("signal")

    asyncio.run(main())

"""Real hivemind DHTs in one process: signed records, forged/unsigned/garbage rejected, expiry, matchmaking."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

import pytest

from swarmtrain.averaging.matchmaking import Matchmaker
from swarmtrain.config import ConfigError, DiscoveryConfig, RunConfig, to_dict
from swarmtrain.discovery import (
    DepartureRecord,
    DiscoveryError,
    GroupRecord,
    MatchEntry,
    PeerRecord,
    RecordError,
    RunRecord,
)
from swarmtrain.discovery.hivemind_dht import HivemindDiscovery, signer_id_of
from swarmtrain.round.group import Member
from swarmtrain.trust import RunSecret, seal

pytestmark = pytest.mark.integration

RUN = "swarmtrain"
TTL_S = 30.0
IO_S = 10.0


class Swarm:
    def __init__(self, runner: asyncio.Runner, nodes: dict[str, HivemindDiscovery]) -> None:
        self.runner = runner
        self.nodes = nodes

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.runner.run(coro)

    def __getitem__(self, name: str) -> HivemindDiscovery:
        return self.nodes[name]


@pytest.fixture(scope="module")
def swarm() -> Iterator[Swarm]:
    """coord, b, c honest; mallory hostile: 4 DHTs shared by the module's tests (each starts in ~1-2 s)."""
    runner = asyncio.Runner()
    nodes: dict[str, HivemindDiscovery] = {}

    async def start() -> None:
        nodes["coord"] = await HivemindDiscovery.create(DiscoveryConfig(record_ttl_s=TTL_S), run_id=RUN)
        join = DiscoveryConfig(initial_peers=tuple(await nodes["coord"].visible_maddrs()), record_ttl_s=TTL_S)
        for name, d in zip(("b", "c", "mallory"),
                           await asyncio.gather(*(HivemindDiscovery.create(join, run_id=RUN) for _ in range(3))),
                           strict=True):
            nodes[name] = d

    try:
        runner.run(start())
        yield Swarm(runner, nodes)
    finally:
        for d in nodes.values():
            runner.run(d.aclose())
        runner.close()
    assert not any(d.dht.is_alive() for d in nodes.values()), "a DHT process outlived the test module"


def _peer(d: HivemindDiscovery, *, round_index: int = 0, heartbeat_at: float | None = None, **kw) -> PeerRecord:  # type: ignore[no-untyped-def]
    return PeerRecord(run_id=RUN, peer_id=d.peer_id, endpoint="127.0.0.1:7000", round=round_index,
                      heartbeat_at=d.now() if heartbeat_at is None else heartbeat_at, **kw)


def test_peer_id_is_the_libp2p_identity_of_the_signing_key(swarm: Swarm) -> None:
    for d in swarm.nodes.values():
        assert signer_id_of(d.owner_subkey) == d.peer_id
        assert all(m.endswith("/p2p/" + d.peer_id) for m in swarm.run(d.visible_maddrs()))
    assert len({d.peer_id for d in swarm.nodes.values()}) == 4


def test_run_config_round_trip_over_the_dht(swarm: Swarm) -> None:
    cfg = RunConfig().replace(averaging={"min_peers": 3}, compress={"codec": "int4"})
    coord = swarm["coord"]
    swarm.run(coord.publish_run(RunRecord(run_id=RUN, coordinator_id=coord.peer_id, config=to_dict(cfg), round=2,
                                          updated_at=coord.now()), timeout_s=IO_S))
    got = swarm.run(swarm["c"].fetch_run(coordinator_id=coord.peer_id, timeout_s=IO_S))
    assert got is not None and got.round == 2 and got.run_config() == cfg


def test_forged_unsigned_and_garbage_records_are_rejected_and_the_swarm_goes_on(
        swarm: Swarm, caplog: pytest.LogCaptureFixture) -> None:
    from hivemind.utils.crypto import RSAPrivateKey

    b, c, mallory = swarm["b"], swarm["c"], swarm["mallory"]
    key = f"swarmtrain/{RUN}/peers"
    swarm.run(b.announce(_peer(b, round_index=1), timeout_s=IO_S))
    exp = b.now() + TTL_S
    forged = _peer(b, round_index=99).encode()
    dht = mallory.dht
    # 1. another key's slot, unsigned: refused by the DHT nodes (signature required for an owner subkey)
    assert dht.store(key, forged, exp, subkey=b.owner_subkey) is False
    # 2. another key's slot with a signature made by a different key: refused
    fake_sig = b"[signature:" + RSAPrivateKey().sign(forged) + b"]"
    assert dht.store(key, forged + fake_sig, exp, subkey=b.owner_subkey) is False
    # 3. a subkey with no owner key at all (an unsigned record): refused
    assert dht.store(key, forged, exp, subkey=b"mallory") is False
    # 4. mallory's own signed slot, sealed with the run's key (this module's run is open: the empty key), but
    # claiming to be b / garbage / another run: stored, rejected on read (logged at WARNING once per signer)
    def sealed(body: bytes) -> bytes:
        return seal(RunSecret.from_run_key("").records, dht_key=key, signer_id=mallory.peer_id, body=body)

    assert dht.store(key, sealed(forged), exp, subkey=mallory.owner_subkey) is True
    with caplog.at_level(logging.DEBUG, logger="swarmtrain.discovery.protocol"):
        live = swarm.run(c.live_peers(timeout_s=IO_S))
        assert [(p.peer_id, p.round) for p in live if p.peer_id in (b.peer_id, mallory.peer_id)] == [(b.peer_id, 1)]
        assert f"signed by {mallory.peer_id!r}" in caplog.text
        for bad in (b"\x00\xffgarbage", _peer(mallory).encode().replace(b'"run_id":"swarmtrain"', b'"run_id":"x"')):
            assert dht.store(key, sealed(bad), exp + 1, subkey=mallory.owner_subkey) is True
            live = swarm.run(c.live_peers(timeout_s=IO_S))
            assert [p.round for p in live if p.peer_id == b.peer_id] == [1]
            assert mallory.peer_id not in {p.peer_id for p in live}
            exp += 1
    assert "not a JSON record" in caplog.text and "is for run 'x'" in caplog.text
    # the honest peers still update their own records
    swarm.run(b.announce(_peer(b, round_index=2), timeout_s=IO_S))
    assert [p.round for p in swarm.run(c.live_peers(timeout_s=IO_S)) if p.peer_id == b.peer_id] == [2]


def test_expiry_and_leave(swarm: Swarm) -> None:
    c, coord = swarm["c"], swarm["coord"]
    # c's last heartbeat was long enough ago that its record expires 1 s from now.
    swarm.run(c.announce(_peer(c, heartbeat_at=c.now() - TTL_S + 1.0), timeout_s=IO_S))
    assert c.peer_id in {p.peer_id for p in swarm.run(coord.live_peers(timeout_s=IO_S))}

    async def gone(d: HivemindDiscovery, peer_id: str, timeout_s: float) -> None:
        deadline = d.now() + timeout_s
        while peer_id in {p.peer_id for p in await d.live_peers(timeout_s=IO_S)}:
            assert d.now() < deadline, f"{peer_id} still live after {timeout_s}s"
            await asyncio.sleep(0.1)

    swarm.run(gone(coord, c.peer_id, 5.0))
    b = swarm["b"]
    swarm.run(b.announce(_peer(b, round_index=3), timeout_s=IO_S))
    assert b.peer_id in {p.peer_id for p in swarm.run(coord.live_peers(timeout_s=IO_S))}
    swarm.run(b.withdraw(timeout_s=IO_S))
    assert b.peer_id not in {p.peer_id for p in swarm.run(coord.live_peers(timeout_s=IO_S))}


def test_a_departure_is_read_by_others_and_withdrawn_when_the_identity_rejoins(swarm: Swarm) -> None:
    b, c, coord = swarm["b"], swarm["c"], swarm["coord"]
    swarm.run(b.announce_departure(DepartureRecord(run_id=RUN, peer_id=b.peer_id, from_round=7, left_at=b.now()),
                                   timeout_s=IO_S))
    gone = swarm.run(coord.departures(timeout_s=IO_S))
    assert [(d.peer_id, d.from_round) for d in gone] == [(b.peer_id, 7)]
    with pytest.raises(RecordError, match="owned by"):  # a peer can announce only its own departure
        swarm.run(c.announce_departure(DepartureRecord(run_id=RUN, peer_id=b.peer_id, from_round=1, left_at=0.0),
                                       timeout_s=IO_S))
    swarm.run(b.rejoin(timeout_s=IO_S))  # the same identity starts again: its departure no longer counts
    assert swarm.run(coord.departures(timeout_s=IO_S)) == ()


def test_matchmaking_over_real_dhts_gives_one_identical_group(swarm: Swarm) -> None:
    peers = [swarm["coord"], swarm["b"], swarm["c"]]

    async def main() -> list:  # type: ignore[type-arg]
        async def one(i: int, d: HivemindDiscovery):  # type: ignore[no-untyped-def]
            await asyncio.sleep(0.1 * i)
            member = Member(peer_id=d.peer_id, endpoint=f"127.0.0.1:{7000 + i}", bandwidth_bytes_per_s=1e6)
            return await Matchmaker(d, min_peers=2, window_s=1.5).form_group(10, member)

        return list(await asyncio.gather(*(one(i, d) for i, d in enumerate(peers))))

    outcomes = swarm.run(main())
    assert all(o.group is not None for o in outcomes), [o.reason for o in outcomes]
    assert len({o.group for o in outcomes}) == 1
    assert [m.peer_id for m in outcomes[0].group.members] == sorted(d.peer_id for d in peers)


def test_a_node_without_the_run_key_steers_nothing_in_a_keyed_run(swarm: Swarm) -> None:
    """Two peers of a keyed run (their own DHT nodes, joined to the module's swarm) and mallory, a real node
    without the key: its run record, its peer record far ahead, its match entries and its groups naming the
    honest peers are all ignored; matchmaking gives the honest peers one group of their own."""
    cfg = RunConfig()

    async def main() -> tuple[list, RunRecord | None, list[str]]:  # type: ignore[type-arg]
        join = DiscoveryConfig(initial_peers=tuple(await swarm["coord"].visible_maddrs()), record_ttl_s=TTL_S)
        keyed = list(await asyncio.gather(*(HivemindDiscovery.create(join, run_id=RUN, run_key="k") for _ in "xy")))
        try:
            mallory = swarm["mallory"]
            me = Member(peer_id=mallory.peer_id, endpoint="127.0.0.1:6999", bandwidth_bytes_per_s=1e9)
            honest = [Member(peer_id=d.peer_id, endpoint=f"127.0.0.1:{7100 + i}", bandwidth_bytes_per_s=1e6)
                      for i, d in enumerate(keyed)]
            await keyed[0].publish_run(RunRecord(run_id=RUN, coordinator_id=keyed[0].peer_id, config=to_dict(cfg),
                                                 updated_at=keyed[0].now()), timeout_s=IO_S)
            await mallory.publish_run(RunRecord(run_id=RUN, coordinator_id=mallory.peer_id, config=to_dict(cfg),
                                                round=10**6, updated_at=mallory.now()), timeout_s=IO_S)
            await mallory.announce(_peer(mallory, round_index=10**6, state_hash="ab" * 32), timeout_s=IO_S)
            for attempt in range(2):
                await mallory.post_entry(MatchEntry(run_id=RUN, round=11, member=me, posted_at=mallory.now(),
                                                    attempt=attempt), keep_s=60, timeout_s=IO_S)
                # a group it leads: with the honest peers whose ids sort after its own (a leader is the smallest)
                members = tuple(sorted([me, *(m for m in honest if m.peer_id > me.peer_id)], key=lambda m: m.peer_id))
                await mallory.post_group(GroupRecord(run_id=RUN, round=11, leader_id=me.peer_id, members=members,
                                                     window_close_at=mallory.now() + 30, attempt=attempt),
                                         keep_s=60, timeout_s=IO_S)
            for d in keyed:
                await d.announce(_peer(d, round_index=3), timeout_s=IO_S)

            async def one(i: int, d: HivemindDiscovery):  # type: ignore[no-untyped-def]
                await asyncio.sleep(0.1 * i)
                return await Matchmaker(d, min_peers=2, window_s=1.5).form_group(11, honest[i])

            outcomes = list(await asyncio.gather(*(one(i, d) for i, d in enumerate(keyed))))
            run = await keyed[1].fetch_run(timeout_s=IO_S)
            live = [p.peer_id for p in await keyed[1].live_peers(timeout_s=IO_S)]
            return outcomes, run, live
        finally:
            for d in keyed:
                await d.aclose()

    outcomes, run, live = swarm.run(main())
    assert run is not None and run.round == 0 and run.coordinator_id != swarm["mallory"].peer_id
    assert swarm["mallory"].peer_id not in live and len(live) == 2
    assert all(o.group is not None for o in outcomes), [o.reason for o in outcomes]
    assert len({o.group for o in outcomes}) == 1
    assert swarm["mallory"].peer_id not in {m.peer_id for m in outcomes[0].group.members}
    assert len(outcomes[0].group.members) == 2


def test_identity_path_gives_a_stable_peer_id_and_a_stopped_dht_raises(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = DiscoveryConfig(identity_path=str(tmp_path / "peer.key"))

    async def main() -> None:
        first = await HivemindDiscovery.create(cfg, run_id=RUN)
        await first.aclose()
        with pytest.raises(DiscoveryError, match="not running"):
            await first.live_peers(timeout_s=1.0)
        again = await HivemindDiscovery.create(cfg, run_id=RUN)  # a restarted peer keeps its id
        try:
            assert again.peer_id == first.peer_id and signer_id_of(again.owner_subkey) == first.peer_id
        finally:
            await again.aclose()

    asyncio.run(main())
    with pytest.raises(ConfigError, match="identity_path"):
        asyncio.run(HivemindDiscovery.create(DiscoveryConfig(identity_path=str(tmp_path / "no" / "k")), run_id=RUN))


async def _drop_every_link(_dht, node) -> int:  # type: ignore[no-untyped-def]
    """Inside a DHT process: empty the routing table and hang up on every peer (a node that was cut
    off for longer than its links lived, as a long freeze or a network change leaves it)."""
    table = node.protocol.routing_table
    dropped = [(uid, table.uid_to_peer_id[uid]) for bucket in table.buckets for uid in list(bucket.nodes_to_peer_id)]
    for uid, peer_id in dropped:
        del table[uid]
        await node.p2p._client.disconnect(peer_id)
    return len(dropped)


def test_a_node_that_lost_every_link_finds_the_swarm_again_by_rebootstrapping() -> None:
    async def main() -> None:
        a = await HivemindDiscovery.create(DiscoveryConfig(record_ttl_s=TTL_S), run_id=RUN)
        b: HivemindDiscovery | None = None
        try:
            maddrs = tuple(await a.visible_maddrs())
            b = await HivemindDiscovery.create(DiscoveryConfig(initial_peers=maddrs, record_ttl_s=TTL_S), run_id=RUN)
            for d in (a, b):
                assert await asyncio.to_thread(d.dht.run_coroutine, _drop_every_link) >= 1
            await a.announce(_peer(a, round_index=3), timeout_s=IO_S)
            assert [p.peer_id for p in await b.live_peers(timeout_s=IO_S)] == []  # cut off: sees nobody
            with pytest.raises(ConfigError, match="initial_peers"):
                await b.rebootstrap(["/ip4/127.0.0.1/tcp/1"], timeout_s=IO_S)  # no /p2p/ part
            assert await b.rebootstrap(maddrs, timeout_s=IO_S) == 1
            seen: list[str] = []
            deadline = time.monotonic() + IO_S
            while not seen and time.monotonic() < deadline:
                seen = [p.peer_id for p in await b.live_peers(timeout_s=IO_S)]
            assert seen == [a.peer_id]
        finally:
            for d in (a, b):
                if d is not None:
                    await d.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("subkey", [b"[owner:ssh-rsa AAAAgarbage]", b"[owner:not-a-key]", b"no owner at all", 7])
def test_a_subkey_that_names_no_valid_key_has_no_signer(subkey: object) -> None:
    assert signer_id_of(subkey) is None

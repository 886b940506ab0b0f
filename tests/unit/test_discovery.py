"""Discovery records and the in-memory twin: validation, run config round trip, heartbeat expiry, leave."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

import pytest

from swarmtrain.config import ConfigError, RunConfig, load_config, to_dict
from swarmtrain.discovery import (
    DirectoryIo,
    GroupRecord,
    Heartbeat,
    InMemoryDiscovery,
    InMemoryRegistry,
    MatchEntry,
    PeerRecord,
    RecordError,
    RunConflictError,
    RunRecord,
    StageLoad,
)
from swarmtrain.discovery.records import decode_record
from swarmtrain.discovery.stats import PeerStats
from swarmtrain.round.group import Member
from swarmtrain.trust import RunSecret, seal

pytestmark = pytest.mark.unit

RUN = "swarmtrain"


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _peer(peer_id: str, t: float, **kw: object) -> PeerRecord:
    return PeerRecord(run_id=RUN, peer_id=peer_id, endpoint="127.0.0.1:5000", heartbeat_at=t, **kw)  # type: ignore[arg-type]


def test_every_record_kind_round_trips_through_bytes() -> None:
    m = Member(peer_id="a", endpoint="10.0.0.1:7", client_mode=False, bandwidth_bytes_per_s=1e6)
    c = Member(peer_id="b", endpoint="", client_mode=True)
    records = [
        RunRecord(run_id=RUN, coordinator_id="a", config=to_dict(RunConfig()), round=3, updated_at=5.0),
        _peer("a", 1.0, role="coordinator", state_hash="ab01", round=2, throughput_tokens_per_s=3.5),
        _peer("c", 1.0, shard_index=3, round_ends_at=12.5),
        MatchEntry(run_id=RUN, round=4, member=c, posted_at=2.5, attempt=2),
        GroupRecord(run_id=RUN, round=4, leader_id="a", members=(m, c), window_close_at=3.0, attempt=2),
    ]
    for r in records:
        assert decode_record(type(r), r.encode(), run_id=RUN, signer_id=r.owner_id) == r


def test_a_peer_record_with_every_field_set_has_the_wire_form_of_every_field() -> None:
    """The codec is derived from the fields' metadata: every field is on the wire under its own name, a stage
    server's load and a peer's stats as objects of their own (absent from the records of peers without them), and
    reads back to the same record."""
    stats = PeerStats(rounds_committed=3, loss=2.5)
    load = StageLoad(stage=2, latency_s=0.5, queue=3, service_s=0.75, busy=0.5, stage_since=5.5,
                     copies=((1, 3), (3, 4)))
    r = PeerRecord(run_id=RUN, peer_id="s", endpoint="10.0.0.2:9", role="stage_server", client_mode=False, round=4,
                   state_hash="ab", throughput_tokens_per_s=1.5, bandwidth_bytes_per_s=2.5, heartbeat_at=3.5,
                   shard_index=1, round_ends_at=4.5, clock_offset_s=-0.25, server=load, stats=stats, incarnation=2)
    d = r.to_json()
    assert set(d) == {f.name for f in dataclasses.fields(PeerRecord)}
    assert set(d["server"]) == {f.name for f in dataclasses.fields(StageLoad)}
    assert d["server"]["copies"] == [[1, 3], [3, 4]] and d["stats"] == stats.to_json() and d["clock_offset_s"] == -0.25
    assert decode_record(PeerRecord, r.encode(), run_id=RUN, signer_id="s") == r
    assert (r.stage, r.copies) == (2, ((1, 3), (3, 4)))
    worker = _peer("a", 1.0)
    assert set(worker.to_json()) == {f.name for f in dataclasses.fields(PeerRecord)} - {"server", "stats"}
    assert (worker.stage, worker.copies) == (-1, ())


@pytest.mark.parametrize("server, match", [
    (None, "peer.server: none does not fit role 'stage_server'"),
    ({"stage": -1}, r"peer\.server\.stage"),
    ({"stage": 0, "busy": 1.5}, r"peer\.server\.busy"),
    ({"stage": 0, "latency_s": -1.0}, r"peer\.server\.latency_s"),
    ({"stage": 0, "service_s": "fast"}, r"peer\.server\.service_s"),
    ([0], r"peer\.server: expected an object"),
])
def test_a_stage_servers_malformed_load_is_rejected_naming_the_field(server: object, match: str) -> None:
    good = PeerRecord(run_id=RUN, peer_id="s", endpoint="10.0.0.2:9", role="stage_server", server=StageLoad(stage=0))
    d = {k: v for k, v in json.loads(good.encode()).items() if k != "server"}
    if server is not None:
        d["server"] = server
    with pytest.raises(RecordError, match=match):
        decode_record(PeerRecord, json.dumps(d).encode(), run_id=RUN, signer_id="s")


def test_only_a_stage_server_names_a_stage() -> None:
    with pytest.raises(RecordError, match="does not fit role 'worker'"):
        PeerRecord(run_id=RUN, peer_id="w", endpoint="10.0.0.2:9", role="worker", server=StageLoad(stage=0))


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(run_id="other"), "run_id"),
    (lambda d: d.update(round=-1), "peer.round"),
    (lambda d: d.update(round=True), "peer.round"),
    (lambda d: d.update(heartbeat_at=-1.0), "heartbeat_at"),
    (lambda d: d.update(heartbeat_at=float("inf")), "Infinity"),
    (lambda d: d.update(endpoint="no-port"), "endpoint"),
    (lambda d: d.update(endpoint="h:70000"), "endpoint"),
    (lambda d: d.update(role="king"), "role"),
    (lambda d: d.update(state_hash="XYZ"), "state_hash"),
    (lambda d: d.update(peer_id="bad id!"), "peer_id"),
    (lambda d: d.pop("client_mode"), "client_mode"),
    (lambda d: d.update(shard_index=-2), "peer.shard_index"),
    (lambda d: d.update(shard_index="1"), "peer.shard_index"),
    (lambda d: d.update(round_ends_at=-1.0), "peer.round_ends_at"),
    (lambda d: d.update(round_ends_at="soon"), "peer.round_ends_at"),
    (lambda d: d.update(kind="run"), "kind"),
])
def test_malformed_peer_records_are_rejected_naming_the_field(mutate, match) -> None:
    d = json.loads(_peer("a", 1.0).encode())
    mutate(d)
    with pytest.raises(RecordError, match=match):
        decode_record(PeerRecord, json.dumps(d).encode(), run_id=RUN, signer_id="a")


def test_a_peer_record_from_an_older_peer_reads_as_no_shard_and_no_round_end() -> None:
    d = json.loads(_peer("a", 1.0, shard_index=2, round_ends_at=3.0).encode())
    del d["shard_index"], d["round_ends_at"]
    record = decode_record(PeerRecord, json.dumps(d).encode(), run_id=RUN, signer_id="a")
    assert record.shard_index == -1 and record.round_ends_at == 0.0
    with pytest.raises(RecordError, match="round_ends_at"):
        _peer("a", 1.0, round_ends_at=float("nan"))


@pytest.mark.parametrize("data", [b"\xff\xfe garbage", b"[1,2]", b'{"kind": "peer"', b"x" * (2 << 20), "str", None,
                                  b'{"kind":"peer","heartbeat_at":NaN}'])
def test_garbage_is_a_record_error(data: object) -> None:
    with pytest.raises(RecordError):
        decode_record(PeerRecord, data, run_id=RUN, signer_id="a")


def test_a_record_signed_by_someone_else_is_rejected() -> None:
    with pytest.raises(RecordError, match="signed by 'mallory'"):
        decode_record(PeerRecord, _peer("alice", 1.0).encode(), run_id=RUN, signer_id="mallory")


def test_group_record_invariants() -> None:
    a, b = Member("a", "h:1"), Member("b", "h:2")
    with pytest.raises(RecordError, match="sorted"):
        GroupRecord(run_id=RUN, round=0, leader_id="a", members=(b, a), window_close_at=0.0)
    with pytest.raises(RecordError, match="leader_id"):
        GroupRecord(run_id=RUN, round=0, leader_id="b", members=(a, b), window_close_at=0.0)


def test_run_record_rejects_an_invalid_config() -> None:
    bad = to_dict(RunConfig())
    bad["averaging"]["min_peers"] = 0
    with pytest.raises(RecordError, match=r"averaging\.min_peers"):
        RunRecord(run_id=RUN, coordinator_id="c", config=bad)
    with pytest.raises(RecordError, match=r"train\.run_id"):
        RunRecord(run_id="other", coordinator_id="c", config=to_dict(RunConfig()))


def test_run_config_round_trip_and_conflicts() -> None:
    async def main() -> None:
        reg = InMemoryRegistry()
        coord = InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=5)
        peer = InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=5)
        assert await peer.fetch_run(timeout_s=1) is None
        cfg = load_config(overrides=["averaging.min_peers=3", "compress.codec=int4", "data.paths=['a.txt']"])
        await coord.publish_run(RunRecord(run_id=RUN, coordinator_id=coord.peer_id, config=to_dict(cfg), round=7),
                                timeout_s=1)
        got = await peer.fetch_run(timeout_s=1)
        assert got is not None and got.round == 7 and got.run_config() == cfg
        rogue = InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=5)
        await rogue.publish_run(RunRecord(run_id=RUN, coordinator_id=rogue.peer_id, config=to_dict(RunConfig())),
                                timeout_s=1)
        with pytest.raises(RunConflictError, match="coordinator"):
            await peer.fetch_run(timeout_s=1)
        pinned = await peer.fetch_run(coordinator_id=coord.peer_id, timeout_s=1)
        assert pinned is not None and pinned.run_config() == cfg
        joined = await peer.fetch_run(join_ids=["QmSomeoneElse", coord.peer_id], timeout_s=1)  # --join's /p2p/ ids
        assert joined is not None and joined.coordinator_id == coord.peer_id
        with pytest.raises(RunConflictError, match="coordinator"):  # --join names both, or neither
            await peer.fetch_run(join_ids=[coord.peer_id, rogue.peer_id], timeout_s=1)
        with pytest.raises(RecordError, match="owned by"):
            await peer.publish_run(RunRecord(run_id=RUN, coordinator_id=coord.peer_id, config=to_dict(cfg)),
                                   timeout_s=1)

    asyncio.run(main())


def test_heartbeat_expiry_and_leave() -> None:
    async def main() -> None:
        clock = FakeClock()
        reg = InMemoryRegistry(clock=clock)
        a, b, c = (InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=10) for _ in range(3))
        for d in (a, b, c):
            await d.announce(_peer(d.peer_id, clock.t), timeout_s=1)
        assert [p.peer_id for p in await a.live_peers(timeout_s=1)] == sorted([a.peer_id, b.peer_id, c.peer_id])
        clock.t += 6
        await a.announce(_peer(a.peer_id, clock.t, round=1), timeout_s=1)  # a heartbeats, b and c do not
        await b.withdraw(timeout_s=1)  # b leaves: gone at once
        assert [p.peer_id for p in await a.live_peers(timeout_s=1)] == sorted([a.peer_id, c.peer_id])
        clock.t += 4.5  # c's last beat is 10.5 s old: past record_ttl_s
        live = await c.live_peers(timeout_s=1)
        assert [p.peer_id for p in live] == [a.peer_id] and live[0].round == 1

    asyncio.run(main())


def test_a_directory_counts_its_lookups_stores_values_and_decodes() -> None:
    """The control plane's cost per peer, as round lines report it: each read is one lookup that returns one value
    per signer under the key; a record is opened and checked once, later reads of the same bytes come from the
    cache; announcing and withdrawing are stores."""
    async def main() -> None:
        clock = FakeClock()
        reg = InMemoryRegistry(clock=clock)
        peers = [InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=10) for _ in range(5)]
        for d in peers:
            await d.announce(_peer(d.peer_id, clock.t), timeout_s=1)
        a = peers[0]
        assert a.io == DirectoryIo(reads=0, writes=1, slots=0, decoded=0)
        await a.live_peers(timeout_s=1)
        await a.live_peers(timeout_s=1)
        assert a.io == DirectoryIo(reads=2, writes=1, slots=10, decoded=5)  # the second read decoded nothing
        before = a.io.copy()
        clock.t += 1
        await peers[1].announce(_peer(peers[1].peer_id, clock.t, round=1), timeout_s=1)  # new bytes under the key
        await a.live_peers(timeout_s=1)
        await a.withdraw(timeout_s=1)
        assert a.io.minus(before) == DirectoryIo(reads=1, writes=1, slots=5, decoded=1)

    asyncio.run(main())


def test_garbage_and_unsigned_slots_are_skipped_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        reg = InMemoryRegistry()
        a = InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=10)
        await a.announce(_peer(a.peer_id, a.now()), timeout_s=1)
        key = f"swarmtrain/{RUN}/peers"

        def sealed(signer: str, body: bytes) -> bytes:  # by a holder of the (empty) run key: decoding is reached
            return seal(RunSecret.from_run_key("").records, dht_key=key, signer_id=signer, body=body)

        reg.put(key, "mallory", sealed("mallory", b"\x00garbage"), expires_at=a.now() + 10)
        reg.put(key, "trudy", "a string, not bytes", expires_at=a.now() + 10)  # once broke every read of the key
        reg.put(key, "walt", None, expires_at=a.now() + 10)
        reg.put(key, None, sealed("eve", _peer("eve", a.now()).encode()), expires_at=a.now() + 10)  # unsigned
        impersonation = sealed("eve", _peer(a.peer_id, a.now(), round=99).encode())
        reg.put(key, "eve", impersonation, expires_at=a.now() + 10)
        other_run = dataclasses.replace(_peer("zed", a.now()), run_id="other")
        reg.put(key, "zed", sealed("zed", other_run.encode()), expires_at=a.now() + 10)
        live = await a.live_peers(timeout_s=1)
        assert [(p.peer_id, p.round) for p in live] == [(a.peer_id, 0)]

    with caplog.at_level(logging.WARNING, logger="swarmtrain.discovery.protocol"):
        asyncio.run(main())
    text = caplog.text
    assert "not a JSON record" in text and "unsigned record" in text and "signed by 'eve'" in text
    assert "'other'" in text


def test_heartbeat_task_keeps_a_record_alive_and_withdraws_on_close(no_thread_leak: None) -> None:
    async def main() -> None:
        reg = InMemoryRegistry()
        a = InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=0.3)
        state = {"round": 0}
        hb = Heartbeat(a, current=lambda: _peer(a.peer_id, 0.0, round=state["round"]), heartbeat_s=0.05, now=a.now)
        await hb.start()
        state["round"] = 5
        deadline = a.now() + 2.0
        while hb.beats < 8 and a.now() < deadline:  # outlive the ttl several times over
            await asyncio.sleep(0.02)
        live = await a.live_peers(timeout_s=1)
        assert hb.beats >= 8 and [p.round for p in live] == [5]
        await hb.aclose()
        assert await a.live_peers(timeout_s=1) == ()

    asyncio.run(main())


def test_coordinator_never_publishes_the_run_key() -> None:
    from swarmtrain.discovery.coordinator import RunPublisher

    async def go() -> RunRecord | None:
        reg = InMemoryRegistry()
        coord = InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=5)
        cfg = load_config(overrides=[f"train.run_id={RUN}", "rpc.run_key=s3cret"])
        await RunPublisher(coord, cfg).publish()
        return await InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=5).fetch_run(timeout_s=1)

    record = asyncio.run(go())
    assert record is not None and record.config["rpc"]["run_key"] == ""
    assert "s3cret" not in json.dumps(record.config)


def test_a_coordinator_draws_a_run_nonce_once_and_a_restarted_one_keeps_it() -> None:
    from swarmtrain.discovery.coordinator import RunPublisher, with_run_nonce

    async def main() -> None:
        reg = InMemoryRegistry()
        first = InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=5)
        cfg = await with_run_nonce(first, RunConfig(), timeout_s=1)
        assert len(cfg.train.run_nonce) == 16 and cfg.replace(train={"run_nonce": ""}) == RunConfig()
        await RunPublisher(first, cfg).publish()
        restarted = InMemoryDiscovery(reg, run_id=RUN, record_ttl_s=5)  # a new identity: its record is not there yet
        assert (await with_run_nonce(restarted, RunConfig(), timeout_s=1)).train.run_nonce == cfg.train.run_nonce
        other = InMemoryDiscovery(InMemoryRegistry(), run_id=RUN, record_ttl_s=5)
        assert (await with_run_nonce(other, RunConfig(), timeout_s=1)).train.run_nonce != cfg.train.run_nonce
        pinned = RunConfig().replace(train={"run_nonce": "given"})
        assert (await with_run_nonce(restarted, pinned, timeout_s=1)).train.run_nonce == "given"

    asyncio.run(main())
    with pytest.raises(ConfigError, match=r"train\.run_nonce"):
        RunConfig().replace(train={"run_nonce": "not/allowed"})


def test_a_key_flooded_with_identities_is_read_up_to_a_cap_known_signers_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reader used to decode every subkey under a key: identities made up by the thousand cost every peer
    a seal check and a validation each, every heartbeat. Now a read decodes at most MAX_SLOTS_PER_KEY, and the
    signers whose records checked out before come first."""
    import swarmtrain.discovery.protocol as protocol

    async def main() -> None:
        registry = InMemoryRegistry()

        async def announce() -> InMemoryDiscovery:
            d = InMemoryDiscovery(registry, run_id="r", record_ttl_s=60.0)
            await d.announce(PeerRecord(run_id="r", peer_id=d.peer_id, endpoint="127.0.0.1:1", heartbeat_at=d.now()),
                             timeout_s=1.0)
            return d

        reader, honest = await announce(), await announce()
        assert {p.peer_id for p in await reader.live_peers(timeout_s=1.0)} == {reader.peer_id, honest.peer_id}
        flood = [await announce() for _ in range(30)]
        monkeypatch.setattr(protocol, "MAX_SLOTS_PER_KEY", 6)
        seen = {p.peer_id for p in await reader.live_peers(timeout_s=1.0)}
        assert len(seen) == 6 and {reader.peer_id, honest.peer_id} <= seen  # known first, then 4 of the flood
        other = InMemoryDiscovery(registry, run_id="r", record_ttl_s=60.0)
        assert len(await other.live_peers(timeout_s=1.0)) == 6  # a new reader: 6 of them, in its own order
        assert len({p.peer_id for p in flood} & seen) == 4

    asyncio.run(main())

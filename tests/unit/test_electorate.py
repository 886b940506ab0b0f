"""The swarm's commit rule (a strict majority of the previous commit's members) and what carries it:
the worker's state, checkpoints, state transfer, and the partitioned DHT twin tests run on."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch

from swarmtrain.averaging.protocol import AverageResult
from swarmtrain.config import RunConfig
from swarmtrain.data import ShardedBatches, load_corpus
from swarmtrain.diloco import DilocoWorker
from swarmtrain.discovery import DepartureRecord, InMemoryRegistry, RecordError
from swarmtrain.discovery.records import decode_record
from swarmtrain.models import build_model
from swarmtrain.round.rules import electorate_problem
from swarmtrain.rpc.state_wire import StateBlob
from swarmtrain.sync.transfer import StateSnapshot, StateTransferError, decode_snapshot, encode_snapshot

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("contributors", "electorate", "ok"), [
    (("a", "b"), (), True),  # before the first commit: the group rule alone
    (("a", "b", "c"), ("a", "b", "c", "d"), True),
    (("a", "b"), ("a", "b", "c", "d"), False),  # half is not a majority: a 2+2 partition commits nothing
    (("c", "d"), ("a", "b", "c", "d"), False),
    (("a", "x", "y", "z"), ("a", "b", "c"), False),  # joiners do not count until they were in a commit
    (("a", "b", "x"), ("a", "b", "c"), True),
    (("a",), ("a",), True),
])
def test_a_commit_needs_a_strict_majority_of_the_previous_commits_members(
        contributors: tuple[str, ...], electorate: tuple[str, ...], ok: bool) -> None:
    problem = electorate_problem(contributors, electorate)
    assert (problem == "") is ok
    if not ok:
        assert f"of the {len(electorate)} peers of the previous commit" in problem


def test_two_disjoint_sides_never_both_pass() -> None:
    electorate = tuple("abcdefg")
    for mask in range(1 << len(electorate)):
        left = tuple(p for i, p in enumerate(electorate) if mask >> i & 1)
        right = (*(p for p in electorate if p not in left), "joiner")
        assert not (electorate_problem(left, electorate) == "" and electorate_problem(right, electorate) == "")


def _worker(cfg: RunConfig) -> DilocoWorker:
    batches = ShardedBatches(load_corpus(cfg.data).train, worker_index=0, num_workers=1,
                             batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len, seed=cfg.train.seed)
    return DilocoWorker(cfg, model=build_model(cfg.model, seed=cfg.train.seed), batches=batches,
                        device=torch.device("cpu"), rng_seed=0)


def test_the_worker_keeps_the_members_of_its_commit_through_heals_and_checkpoints(tiny_config: RunConfig) -> None:
    w = _worker(tiny_config)
    assert w.members == ()
    w.train_inner(1)
    w.apply(AverageResult(round=0, committed=True, mean=w.delta(), members=("b", "a")))
    assert w.members == ("b", "a")
    tensors, meta = w.state_dict()
    assert json.loads(json.dumps(meta))["members"] == ["b", "a"]
    other = _worker(tiny_config)
    other.load_state_dict(tensors, meta)
    assert other.members == ("b", "a")
    del meta["members"]  # a checkpoint written before commits recorded their members
    other.load_state_dict(tensors, meta)
    assert other.members == ()
    other.adopt_global(round_index=3, theta_global=w.theta_global.clone(),
                       outer_momentum=w.outer.state_tensors().get("momentum"), members=("c",))
    assert other.members == ("c",)
    w.apply(AverageResult(round=1, committed=False, mean=None, members=("x",)))
    assert w.members == ("b", "a"), "an aborted round does not change who committed θ_global"


def _snapshot(cfg: RunConfig, members: tuple[str, ...]) -> StateSnapshot:
    return StateSnapshot(2, {"w": torch.ones(3, 2)}, {}, cfg, members)


def test_state_transfer_carries_the_members_and_refuses_malformed_ones(tiny_config: RunConfig) -> None:
    got = decode_snapshot(encode_snapshot(_snapshot(tiny_config, ("p1", "p2"))))
    assert got.members == ("p1", "p2") and got.round == 2
    assert decode_snapshot(encode_snapshot(_snapshot(tiny_config, ()))).members == ()
    blob = encode_snapshot(_snapshot(tiny_config, ("p1",)))
    (size,) = struct.unpack("<Q", blob.blob[:8])
    header = json.loads(bytes(blob.blob[8:8 + size]))
    header["__metadata__"]["swarmtrain.members"] = json.dumps([1, 2])
    raw = json.dumps(header).encode()
    body = struct.pack("<Q", len(raw)) + raw + bytes(blob.blob[8 + size:])
    bad = StateBlob(blob.run_id, blob.round, blob.config_json, body, hashlib.sha256(body).digest())
    with pytest.raises(StateTransferError, match="members must be a list of peer ids"):
        decode_snapshot(bad)


def test_a_partitioned_registry_keeps_one_copy_per_side_and_merges_on_heal() -> None:
    now = [100.0]
    reg = InMemoryRegistry(clock=lambda: now[0])
    reg.put("k", "coord", b"run", expires_at=1000)
    reg.put("k", "a", b"a0", expires_at=200)
    reg.partition(["a", "b"], ["c"])
    reg.put("k", "a", b"a1", expires_at=300)
    reg.put("k", "c", b"c1", expires_at=300)
    reg.put("k", "coord", b"run2", expires_at=1100)  # on no side: written to every side
    seen = {r: {s.signer_id: s.value for s in reg.get("k", reader=r)} for r in ("b", "c", "coord")}
    assert seen["b"] == {"coord": b"run2", "a": b"a1"}
    assert seen["c"] == {"coord": b"run2", "a": b"a0", "c": b"c1"}
    with pytest.raises(RuntimeError, match="already partitioned"):
        reg.partition(["a"], ["b"])
    reg.heal()
    assert {s.signer_id: s.value for s in reg.get("k")} == {"coord": b"run2", "a": b"a1", "c": b"c1"}


def test_a_departure_record_is_validated_field_by_field() -> None:
    rec = DepartureRecord(run_id="r", peer_id="p1", from_round=4, left_at=12.5)
    assert decode_record(DepartureRecord, rec.encode(), run_id="r", signer_id="p1") == rec
    with pytest.raises(RecordError, match="signed by"):
        decode_record(DepartureRecord, rec.encode(), run_id="r", signer_id="p2")
    for field, bad in (("from_round", -1), ("from_round", "4"), ("peer_id", "a b")):
        body = json.dumps({**json.loads(rec.encode()), field: bad}).encode()
        with pytest.raises(RecordError, match=f"departure.{field}"):
            decode_record(DepartureRecord, body, run_id="r", signer_id="p1")

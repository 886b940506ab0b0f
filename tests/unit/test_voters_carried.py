"""What carries a round's voters (the voters the commit that produced θ_global named, docs/protocol.md): the
worker's state, checkpoints, state transfer; and the partitioned DHT twin tests run on."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch

from swarmtrain.config import RunConfig
from swarmtrain.data import ShardedBatches, load_corpus
from swarmtrain.diloco import DilocoWorker
from swarmtrain.diloco.averager import AverageResult
from swarmtrain.discovery import DepartureRecord, InMemoryRegistry, RecordError
from swarmtrain.discovery.records import decode_record
from swarmtrain.models import build_model
from swarmtrain.round.ballots import Ballot, MaterialLayout, ShardDigest, Value, Voter
from swarmtrain.round.certificate import Certificate
from swarmtrain.rpc.state_wire import StateBlob
from swarmtrain.sync.transfer import StateSnapshot, StateTransferError, decode_snapshot, encode_snapshot

pytestmark = pytest.mark.unit


def _worker(cfg: RunConfig) -> DilocoWorker:
    batches = ShardedBatches(load_corpus(cfg.data).train, worker_index=0, num_workers=1,
                             batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len, seed=cfg.train.seed)
    return DilocoWorker(cfg, model=build_model(cfg.model, seed=cfg.train.seed), batches=batches,
                        device=torch.device("cpu"), rng_seed=0)


def _commit(w: DilocoWorker, next_voters: tuple[Voter, ...]) -> AverageResult:
    """A committed result of `w`'s round whose value names `next_voters` (the grants do not matter here)."""
    n = w.numel
    value = Value(scope="", round=w.round, session="s", base=w.digest(), contributors=("a", "b"),
                  next_voters=next_voters, layout=MaterialLayout(n, "none", False, (ShardDigest(0, n, 4 * n, "d"),)),
                  result="")
    cert = Certificate(run="r/n", ballot=Ballot(0, 0, 0, "s", "a"), value=value, grants=())
    return AverageResult(round=w.round, committed=True, mean=w.delta(), members=("a", "b"), certificate=cert)


def test_the_worker_keeps_the_voters_of_its_commit_through_heals_and_checkpoints(tiny_config: RunConfig) -> None:
    w = _worker(tiny_config)
    assert w.voters == ()
    w.train_inner(1)
    named = (Voter("b", 7), Voter("a", 0))
    before = w.digest()
    w.apply(_commit(w, named))
    assert w.voters == named and w.digest() != before
    tensors, meta = w.state_dict()
    assert json.loads(json.dumps(meta))["voters"] == [["b", 7], ["a", 0]]
    other = _worker(tiny_config)
    other.load_state_dict(tensors, meta)
    assert other.voters == named and other.digest() == w.digest()  # the digest covers the voters too
    del meta["voters"]  # a checkpoint written before commits named their voters: the scope's genesis decides
    other.load_state_dict(tensors, meta)
    assert other.voters == () and other.digest() != w.digest()
    meta["voters"] = [["a", "zero"]]
    with pytest.raises(ValueError, match="voters"):
        other.load_state_dict(tensors, meta)
    other.adopt_global(round_index=3, theta_global=w.theta_global.clone(),
                       outer_momentum=w.outer.state_tensors().get("momentum"), voters=(Voter("c", 1),))
    assert other.voters == (Voter("c", 1),)
    w.apply(AverageResult(round=1, committed=False, mean=None, members=("x",)))
    assert w.voters == named, "an aborted round does not change who decides the next one"


def _snapshot(cfg: RunConfig, voters: tuple[Voter, ...]) -> StateSnapshot:
    return StateSnapshot(2, {"w": torch.ones(3, 2)}, {}, cfg, voters)


def test_state_transfer_carries_the_voters_and_refuses_malformed_ones(tiny_config: RunConfig) -> None:
    got = decode_snapshot(encode_snapshot(_snapshot(tiny_config, (Voter("p1", 0), Voter("p2", 5)))))
    assert got.voters == (Voter("p1", 0), Voter("p2", 5)) and got.round == 2
    assert decode_snapshot(encode_snapshot(_snapshot(tiny_config, ()))).voters == ()
    blob = encode_snapshot(_snapshot(tiny_config, (Voter("p1", 0),)))
    (size,) = struct.unpack("<Q", blob.blob[:8])
    header = json.loads(bytes(blob.blob[8:8 + size]))
    header["__metadata__"]["swarmtrain.voters"] = json.dumps([1, 2])
    raw = json.dumps(header).encode()
    body = struct.pack("<Q", len(raw)) + raw + bytes(blob.blob[8 + size:])
    bad = StateBlob(blob.run_id, blob.round, blob.config_json, body, hashlib.sha256(body).digest())
    with pytest.raises(StateTransferError, match="voters"):
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

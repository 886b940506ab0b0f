"""Every decoder of bytes from the network, with valid seeds, a byte mutator and the one error type each may
raise: shared by the hypothesis tests (tests/unit/test_decoder_fuzz.py) and benchmarks/fuzz.py.

A target that raises anything but its typed error, or does not return, is a crash. Mutations keep what a
decoder checks first (checksums, MACs) valid where the target says how (`resign`), so they reach the
checks behind it.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import xxhash

from swarmtrain.averaging.aggregate import mean_of_gathered, pack_bundle, unpack_bundle
from swarmtrain.compress import CodecError, get_codec
from swarmtrain.config import RunConfig, to_dict
from swarmtrain.discovery.records import (
    DepartureRecord,
    GroupRecord,
    MatchEntry,
    PeerRecord,
    Record,
    RecordError,
    RunRecord,
    decode_record,
)
from swarmtrain.round.ballots import Voter
from swarmtrain.round.group import Member
from swarmtrain.rpc import bulk
from swarmtrain.rpc.averaging_client import _fetch_fields
from swarmtrain.rpc.averaging_wire import _push_fields
from swarmtrain.rpc.errors import Rejected, RpcRejected
from swarmtrain.rpc.frames import encode_bytes_field, encode_varint_field, frame
from swarmtrain.rpc.state_wire import StateBlob
from swarmtrain.sync.transfer import StateSnapshot, StateTransferError, decode_snapshot, encode_snapshot
from swarmtrain.trust import CallAuth, CallRefused, CallSigner, RunSecret, SealError, open_sealed, seal
from swarmtrain.wire import averaging_pb2 as pb

__all__ = ["TARGETS", "Target", "mutate"]

SECRET = RunSecret.from_run_key("fuzz")
NOW = 1_800_000_000.0
EDGE_INTS = [0, 1, 2, 7, 8, 127, 128, 255, 256, 65535, 2**31 - 1, 2**32, 2**63 - 1, 2**64 - 1]


@dataclass(frozen=True)
class Target:
    """`run(data)` decodes `data` and may raise only `allowed`; `seeds` are valid inputs; `resign` makes a
    mutated input pass the check that guards the rest (a checksum, a MAC), when there is one."""

    name: str
    run: Callable[[bytes], object]
    allowed: tuple[type[BaseException], ...]
    seeds: tuple[bytes, ...]
    resign: Callable[[bytes], bytes] | None = None


def mutate(data: bytes, rng: random.Random, *, others: Sequence[bytes] = ()) -> bytes:
    """One to four random edits: flip a bit, set a byte or a little-endian int to an edge value, cut,
    insert, duplicate a span, or splice with another seed."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        at = rng.randrange(len(b) + 1)
        if op == 0 and b:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[rng.randrange(len(b))] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, ord("{"), ord('"'), ord("-")])
        elif op == 2 and len(b) >= 8:
            i = rng.randrange(len(b) - 7)
            width = rng.choice([1, 2, 4, 8])
            b[i:i + width] = (rng.choice(EDGE_INTS) % (1 << (8 * width))).to_bytes(width, "little")
        elif op == 3:
            del b[at:at + rng.randint(1, max(1, len(b) // 4))]
        elif op == 4:
            b[at:at] = rng.randbytes(rng.randint(1, 16))
        elif op == 5 and b:
            i = rng.randrange(len(b))
            b[at:at] = b[i:i + rng.randint(1, 64)]
        elif others:
            other = rng.choice(others)
            b = b[:at] + other[rng.randrange(len(other) + 1):]
    return bytes(b)


def _record_seeds() -> dict[str, tuple[type[Record], tuple[bytes, ...]]]:
    cfg = RunConfig()
    member = Member(peer_id="a", endpoint="10.0.0.1:7000", bandwidth_bytes_per_s=1e6, state_hash="ab" * 32)
    other = Member(peer_id="b", endpoint="[::1]:7001", client_mode=False, bandwidth_bytes_per_s=2e6)
    run_id = cfg.train.run_id
    return {
        "run": (RunRecord, (RunRecord(run_id=run_id, coordinator_id="a", config=to_dict(cfg), round=3).encode(),)),
        "peer": (PeerRecord, (PeerRecord(run_id=run_id, peer_id="a", endpoint="10.0.0.1:7000", round=4,
                                         state_hash="cd" * 32, heartbeat_at=NOW, shard_index=1,
                                         clock_offset_s=-0.5).encode(),)),
        "departure": (DepartureRecord, (DepartureRecord(run_id=run_id, peer_id="a", from_round=5,
                                                        left_at=NOW).encode(),)),
        "entry": (MatchEntry, (MatchEntry(run_id=run_id, round=2, member=member, posted_at=NOW, attempt=1).encode(),)),
        "group": (GroupRecord, (GroupRecord(run_id=run_id, round=2, leader_id="a", members=(member, other),
                                            window_close_at=NOW).encode(),)),
    }


def _record_target(kind: str, cls: type[Record], seeds: tuple[bytes, ...]) -> Target:
    run_id = RunConfig().train.run_id

    def run(data: bytes) -> object:
        return decode_record(cls, data, run_id=run_id, signer_id=None)

    return Target(f"record:{kind}", run, (RecordError,), seeds)


def _codec_resign(data: bytes) -> bytes:
    """The wire header's checksum (xxh3-64 of every byte but 24..32, docs/wire-format.md) made right again."""
    b = bytearray(data)
    if len(b) >= 32:
        h = xxhash.xxh3_64(bytes(b[:24]))
        h.update(bytes(b[32:]))
        b[24:32] = h.intdigest().to_bytes(8, "little")
    return bytes(b)


def _codec_target(name: str) -> Target:
    # small sparse chunks: the seeds then hold several chunks, a short last one and multi-byte offsets
    codec = get_codec(name, chunk_size=16, density=0.25) if name == "sparse" else get_codec(name)
    g = torch.Generator().manual_seed(0)
    seeds = tuple(codec.encode(torch.randn(shape, generator=g)) for shape in ((7,), (3, 65), (130,)))

    def run(data: bytes) -> None:
        numel = codec.decode(data).numel()
        codec.decode_accumulate(data, torch.zeros(numel))

    return Target(f"codec:{name}", run, (CodecError,), seeds, _codec_resign)


def _bundle_target() -> Target:
    """A gathering reducer's reply: the bundle, then each contribution through the sparse codec."""
    codec = get_codec("sparse", chunk_size=16, density=0.25)
    g = torch.Generator().manual_seed(1)
    seeds = (pack_bundle([codec.encode(torch.randn(40, generator=g)) for _ in range(3)]), pack_bundle([]))

    def run(data: bytes) -> object:
        parts = unpack_bundle(data, max_parts=8)
        return mean_of_gathered(codec, parts, out=torch.empty(40)) if parts else None

    return Target("bundle", run, (CodecError,), seeds)


def _state_target() -> Target:
    snapshot = StateSnapshot(2, {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4)},
                             {"w": torch.zeros(3, 4)}, RunConfig(), voters=(Voter("a", 0), Voter("b", 1)))
    blob = encode_snapshot(snapshot)
    template = StateBlob(blob.run_id, blob.round, blob.config_json, b"", b"")

    def run(data: bytes) -> object:
        state = StateBlob(template.run_id, template.round, template.config_json, data, hashlib.sha256(data).digest())
        return decode_snapshot(state, expected_shapes={"w": (3, 4), "b": (4,)})

    return Target("state", run, (StateTransferError,), (bytes(blob.blob),))


def _seal_target() -> Target:
    key = "swarmtrain/run/peers"
    body = json.dumps({"kind": "peer", "peer_id": "a"}).encode()

    def run(data: bytes) -> object:
        return open_sealed(SECRET.records, data, dht_key=key, signer_id="a")

    def resign(data: bytes) -> bytes:  # a holder of the key sealing garbage: reaches nothing more, by design
        return seal(SECRET.records, dht_key=key, signer_id="a", body=data)

    return Target("seal", run, (SealError,), (seal(SECRET.records, dht_key=key, signer_id="a", body=body),), resign)


def _call_target() -> Target:
    signer = CallSigner(SECRET, peer_id="a")
    method, callee = "/swarmtrain.wire.Averaging/Push", "10.0.0.2:7000"

    def run(data: bytes) -> None:
        CallAuth(SECRET).check(method=method, caller="a", callee=callee, header=data.decode("latin-1"), now=NOW)

    seeds = tuple(signer.header(method=method, callee=callee, now=NOW).encode() for _ in range(2))
    return Target("call-proof", run, (CallRefused,), seeds)


def _frames_targets() -> list[Target]:
    header = pb.PushHeader(session=pb.SessionKey(run_id="r", round=3, group_id="g", attempt=1, reducers=["a", "b"]),
                           sender="a", shard=1, numel=10, total_bytes=52, codec="fp32").SerializeToString()
    push = frame(encode_bytes_field(1, len(header)) + header, 2, memoryview(b"\x00" * 40))
    fetch = frame(encode_varint_field(1, 4096), 2, memoryview(b"\x01" * 40))
    return [Target("push-chunk", _push_fields, (Rejected,), (push,)),
            Target("fetch-chunk", lambda data: _fetch_fields(data, "r"), (RpcRejected,), (fetch,))]


def _bulk_hello_target() -> Target:
    token = bytes(range(bulk.TOKEN_BYTES))
    proof = bulk.ticket_proof(SECRET.tickets, token, "a")

    def run(data: bytes) -> object:
        return bulk.check_hello(data, key=SECRET.tickets, issued_to={token: "a"}.get)

    return Target("bulk-hello", run, (bulk.BulkRefused,), (bulk.MAGIC + token + proof,))


def _targets() -> tuple[Target, ...]:
    out = [_record_target(kind, cls, seeds) for kind, (cls, seeds) in _record_seeds().items()]
    out += [_codec_target(name) for name in ("fp32", "fp16", "bf16", "int8", "int4", "sparse")]
    out.append(_bundle_target())
    out += [_state_target(), _seal_target(), _call_target(), *_frames_targets(), _bulk_hello_target()]
    return tuple(out)


TARGETS = _targets()

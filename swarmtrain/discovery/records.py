"""Typed control-plane records (run, peer, matchmaking entry, group) and their validated JSON codec."""

from __future__ import annotations

import abc
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from swarmtrain.config import ConfigError, RunConfig, from_dict
from swarmtrain.discovery.stats import PeerStats, StatsError
from swarmtrain.round.ballots import BallotError, Genesis
from swarmtrain.round.certificate import Retirement
from swarmtrain.round.group import Member

__all__ = [
    "ROLES",
    "DepartureRecord",
    "GroupRecord",
    "MatchEntry",
    "PeerRecord",
    "Record",
    "RecordError",
    "RunRecord",
    "check_endpoint",
    "decode_record",
]

ROLES = ("coordinator", "worker", "stage_server", "trainer")
MAX_RECORD_BYTES = 1 << 20  # a run config is a few KiB; anything near this is hostile
MAX_GROUP_MEMBERS = 4096
MAX_SCOPES = 64  # averaging scopes of one run: the whole model, or a pipeline's stages and its trainers
_PEER_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_HEX_RE = re.compile(r"^[0-9a-f]{0,128}$")
MAX_STAGE_COPIES = 8  # a stage server keeps copies of its two neighbouring stages
MAX_CLOCK_OFFSET_S = 86400.0  # a day: past that a clock estimate is nonsense, not skew
_ENDPOINT_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):(\d{1,5})$")


class RecordError(ValueError):
    """A control-plane record failed validation; the message names the field and the record kind."""


def _field(kind: str, name: str, msg: str) -> RecordError:
    return RecordError(f"{kind}.{name}: {msg}")


def _str(kind: str, d: Mapping[str, Any], name: str) -> str:
    v = d.get(name)
    if not isinstance(v, str):
        raise _field(kind, name, f"expected a string, got {type(v).__name__}")
    return v


def _int(kind: str, d: Mapping[str, Any], name: str) -> int:
    v = d.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise _field(kind, name, f"expected an int >= 0, got {v!r}")
    return v


def _float(kind: str, d: Mapping[str, Any], name: str) -> float:
    v = d.get(name)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        raise _field(kind, name, f"expected a finite number >= 0, got {v!r}")
    return float(v)


def _index_or_none(kind: str, d: Mapping[str, Any], name: str) -> int:
    v = d.get(name, -1)  # absent in records of peers from before the field: -1, none
    if not isinstance(v, int) or isinstance(v, bool) or v < -1:
        raise _field(kind, name, f"expected an int >= -1, got {v!r}")
    return v


def _optional_int(kind: str, d: Mapping[str, Any], name: str) -> int:
    """A count newer peers add: absent in older peers' records, where it reads as 0."""
    return _int(kind, d, name) if name in d else 0


def _copies(kind: str, d: Mapping[str, Any]) -> tuple[tuple[int, int], ...]:
    """A stage server's kept copies of other stages, [[stage, round], ...]; absent in older records."""
    v = d.get("copies", [])
    ok = isinstance(v, list) and len(v) <= MAX_STAGE_COPIES and all(
        isinstance(c, list) and len(c) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in c)
        for c in v)
    if not ok:
        raise _field(kind, "copies", f"expected at most {MAX_STAGE_COPIES} [stage, round] pairs of ints, got "
                                     f"{str(v)[:80]}")
    return tuple((c[0], c[1]) for c in v)


def _optional_float(kind: str, d: Mapping[str, Any], name: str) -> float:
    """A field newer peers add: absent in older peers' records, where it reads as 0 (unknown)."""
    return _float(kind, d, name) if name in d else 0.0


def _clock_offset(kind: str, d: Mapping[str, Any]) -> float:
    """Signed seconds; absent in records of peers from before clock estimates (reads as 0)."""
    v = d.get("clock_offset_s", 0.0)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _field(kind, "clock_offset_s", f"expected a number, got {v!r}")
    return float(v)


def _stats(kind: str, d: Mapping[str, Any]) -> PeerStats | None:
    if "stats" not in d:
        return None
    try:
        return PeerStats.from_json(d["stats"])
    except StatsError as e:
        raise _field(kind, "stats", str(e)) from None


def _bool(kind: str, d: Mapping[str, Any], name: str) -> bool:
    v = d.get(name)
    if not isinstance(v, bool):
        raise _field(kind, name, f"expected a bool, got {v!r}")
    return v


def _peer_id(kind: str, d: Mapping[str, Any], name: str) -> str:
    v = _str(kind, d, name)
    if not _PEER_ID_RE.match(v):
        raise _field(kind, name, f"{v[:40]!r} is not a peer id ([A-Za-z0-9._-], 1-128 chars)")
    return v


def check_endpoint(kind: str, endpoint: str, *, client_mode: bool) -> None:
    """An endpoint is host:port with 1 <= port <= 65535; client-mode peers may leave it empty."""
    if endpoint == "" and client_mode:
        return
    m = _ENDPOINT_RE.match(endpoint)
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise _field(kind, "endpoint", f"{endpoint[:80]!r} is not host:port")


def _member(kind: str, d: Any) -> Member:
    if not isinstance(d, Mapping):
        raise _field(kind, "members", f"each member must be an object, got {type(d).__name__}")
    client_mode = _bool(kind, d, "client_mode")
    endpoint = _str(kind, d, "endpoint")
    check_endpoint(kind, endpoint, client_mode=client_mode)
    state_hash = d.get("state_hash", "")  # absent in entries of peers from before θ-hash groups
    if not isinstance(state_hash, str) or not _HEX_RE.match(state_hash):
        raise _field(kind, "state_hash", f"{str(state_hash)[:40]!r} is not lowercase hex")
    return Member(peer_id=_peer_id(kind, d, "peer_id"), endpoint=endpoint, client_mode=client_mode,
                  bandwidth_bytes_per_s=_float(kind, d, "bandwidth_bytes_per_s"),
                  steps_per_s=_float(kind, d, "steps_per_s"), lag_s=_optional_float(kind, d, "lag_s"),
                  state_hash=state_hash, incarnation=_optional_int(kind, d, "incarnation"))


def _member_dict(m: Member) -> dict[str, Any]:
    return {"peer_id": m.peer_id, "endpoint": m.endpoint, "client_mode": m.client_mode,
            "bandwidth_bytes_per_s": m.bandwidth_bytes_per_s, "steps_per_s": m.steps_per_s, "lag_s": m.lag_s,
            "state_hash": m.state_hash, "incarnation": m.incarnation}


R = TypeVar("R", bound="Record")


class Record(abc.ABC):
    """Shared JSON codec: `encode()` -> bytes, `decode(bytes)` validates every field or raises RecordError."""

    KIND: ClassVar[str]

    @property
    @abc.abstractmethod
    def owner_id(self) -> str:
        """The peer whose key must have signed this record."""

    @abc.abstractmethod
    def to_json(self) -> dict[str, Any]: ...

    @classmethod
    @abc.abstractmethod
    def from_json(cls: type[R], d: Mapping[str, Any]) -> R: ...

    def encode(self) -> bytes:
        return json.dumps({"kind": self.KIND, **self.to_json()}, separators=(",", ":"), sort_keys=True).encode()


def decode_record(cls: type[R], data: Any, *, run_id: str, signer_id: str | None) -> R:
    """Parse and validate `data` as a `cls` of run `run_id`; `signer_id` (if known) must own it."""
    kind = cls.KIND
    if not isinstance(data, (bytes, bytearray)):
        raise RecordError(f"{kind}: expected bytes, got {type(data).__name__}")
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"{kind}: {len(data)} bytes exceeds the {MAX_RECORD_BYTES}-byte limit")
    try:
        d = json.loads(bytes(data).decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise RecordError(f"{kind}: not a JSON record ({e})") from e
    if not isinstance(d, dict):
        raise RecordError(f"{kind}: expected a JSON object, got {type(d).__name__}")
    if d.get("kind") != kind:
        raise _field(kind, "kind", f"expected {kind!r}, got {d.get('kind')!r}")
    record = cls.from_json(d)
    rec_run = getattr(record, "run_id")  # noqa: B009 - every record kind has run_id
    if rec_run != run_id:
        raise _field(kind, "run_id", f"record is for run {rec_run!r}, not {run_id!r}")
    if signer_id is not None and record.owner_id != signer_id:
        raise RecordError(f"{kind}: owned by {record.owner_id!r} but signed by {signer_id!r}")
    return record


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a record")


@dataclass(frozen=True)
class RunRecord(Record):
    """The run as the coordinator published it: its config (`to_dict(RunConfig)`) and current round."""

    KIND: ClassVar[str] = "run"
    run_id: str
    coordinator_id: str
    config: Mapping[str, Any] = field(hash=False)
    round: int = 0
    updated_at: float = 0.0
    # Per averaging scope ("" = the whole model): the voters of its first round, chosen once (round/ballots.py)
    genesis: Mapping[str, Genesis] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        self.run_config()  # a record that cannot build a RunConfig is never constructed
        if len(self.genesis) > MAX_SCOPES:
            raise _field(self.KIND, "genesis", f"{len(self.genesis)} scopes exceeds {MAX_SCOPES}")

    @property
    def owner_id(self) -> str:
        return self.coordinator_id

    def run_config(self) -> RunConfig:
        try:
            cfg = from_dict(self.config)
        except (ConfigError, TypeError) as e:
            raise _field(self.KIND, "config", str(e)) from e
        if cfg.train.run_id != self.run_id:
            raise _field(self.KIND, "config", f"train.run_id {cfg.train.run_id!r} != run_id {self.run_id!r}")
        return cfg

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "coordinator_id": self.coordinator_id, "config": dict(self.config),
                "round": self.round, "updated_at": self.updated_at,
                **({"genesis": {s: g.to_json() for s, g in sorted(self.genesis.items())}} if self.genesis else {})}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RunRecord:
        k = cls.KIND
        config = d.get("config")
        if not isinstance(config, dict):
            raise _field(k, "config", f"expected an object, got {type(config).__name__}")
        raw = d.get("genesis", {})
        if not isinstance(raw, dict) or len(raw) > MAX_SCOPES or not all(isinstance(s, str) for s in raw):
            raise _field(k, "genesis", "expected an object of scopes")
        try:
            genesis = {s: Genesis.from_json(g) for s, g in raw.items()}
        except BallotError as e:
            raise _field(k, "genesis", str(e)) from None
        return cls(run_id=_str(k, d, "run_id"), coordinator_id=_peer_id(k, d, "coordinator_id"), config=config,
                   round=_int(k, d, "round"), updated_at=_float(k, d, "updated_at"), genesis=genesis)


@dataclass(frozen=True)
class PeerRecord(Record):
    """One live peer, refreshed by its heartbeat; gone once `heartbeat_at + record_ttl_s` passes."""

    KIND: ClassVar[str] = "peer"
    run_id: str
    peer_id: str
    endpoint: str  # host:port of its gRPC server; "" for a client-mode peer
    role: str = "worker"
    client_mode: bool = False
    round: int = 0
    state_hash: str = ""  # hex digest of θ_global at `round`
    throughput_tokens_per_s: float = 0.0
    bandwidth_bytes_per_s: float = 0.0
    heartbeat_at: float = 0.0  # unix seconds
    shard_index: int = -1  # the data slot it reads in a run with data.num_shards > 0; -1 = none
    round_ends_at: float = 0.0  # unix seconds it expects its inner steps of `round` to end; 0 = unknown
    clock_offset_s: float = 0.0  # its estimate of (swarm clock − its clock); 0 = none (discovery/clock.py)
    stage: int = -1  # a stage_server's stage of the pipeline; -1 = none
    latency_s: float = 0.0  # a stage_server's mean seconds per call (EWMA); 0 = unknown
    queue: int = 0  # a stage_server's calls waiting
    service_s: float = 0.0  # a stage_server's compute seconds per micro-batch, forward + backward (EWMA); 0 = unknown
    busy: float = 0.0  # a stage_server's fraction of its last window spent computing (0..1)
    stage_since: float = 0.0  # unix seconds a stage_server took its stage (joined or moved); 0 = unknown
    copies: tuple[tuple[int, int], ...] = ()  # a stage_server's kept copies of other stages: (stage, round) each
    stats: PeerStats | None = None  # its work so far, for the dashboard (absent in older peers' records)
    incarnation: int = 0  # of its voter in its scope (round/ballots.py): what a genesis lists it as

    def __post_init__(self) -> None:
        if self.stage < -1 or (self.role == "stage_server") != (self.stage >= 0):
            raise _field(self.KIND, "stage", f"{self.stage} does not fit role {self.role!r} (a stage_server has a "
                                             "stage >= 0, nobody else one)")
        if not math.isfinite(self.latency_s) or self.latency_s < 0 or self.queue < 0:
            raise _field(self.KIND, "latency_s", f"latency {self.latency_s} and queue {self.queue} must be >= 0")
        if not math.isfinite(self.service_s) or self.service_s < 0:
            raise _field(self.KIND, "service_s", f"expected a finite number >= 0, got {self.service_s}")
        if not 0 <= self.busy <= 1:
            raise _field(self.KIND, "busy", f"expected a fraction in [0, 1], got {self.busy}")
        if not math.isfinite(self.stage_since) or self.stage_since < 0:
            raise _field(self.KIND, "stage_since", f"expected a finite number >= 0, got {self.stage_since}")
        if len(self.copies) > MAX_STAGE_COPIES or any(k < 0 or r < 0 for k, r in self.copies):
            raise _field(self.KIND, "copies", f"expected at most {MAX_STAGE_COPIES} (stage, round) pairs of ints >= 0, "
                                              f"got {list(self.copies)[:MAX_STAGE_COPIES + 1]}")
        if not math.isfinite(self.clock_offset_s) or abs(self.clock_offset_s) > MAX_CLOCK_OFFSET_S:
            raise _field(self.KIND, "clock_offset_s", f"expected a number within ±{MAX_CLOCK_OFFSET_S:.0f}, "
                                                      f"got {self.clock_offset_s}")
        if not math.isfinite(self.round_ends_at) or self.round_ends_at < 0:
            raise _field(self.KIND, "round_ends_at", f"expected a finite number >= 0, got {self.round_ends_at}")
        if self.shard_index < -1:
            raise _field(self.KIND, "shard_index", f"expected an int >= -1, got {self.shard_index}")
        if self.role not in ROLES:
            raise _field(self.KIND, "role", f"{self.role!r} is not one of {ROLES}")
        if not _HEX_RE.match(self.state_hash):
            raise _field(self.KIND, "state_hash", f"{self.state_hash[:40]!r} is not lowercase hex")
        check_endpoint(self.KIND, self.endpoint, client_mode=self.client_mode)

    @property
    def owner_id(self) -> str:
        return self.peer_id

    def to_member(self) -> Member:
        return Member(peer_id=self.peer_id, endpoint=self.endpoint, client_mode=self.client_mode,
                      bandwidth_bytes_per_s=self.bandwidth_bytes_per_s, state_hash=self.state_hash,
                      incarnation=self.incarnation)

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "peer_id": self.peer_id, "endpoint": self.endpoint, "role": self.role,
                "client_mode": self.client_mode, "round": self.round, "state_hash": self.state_hash,
                "throughput_tokens_per_s": self.throughput_tokens_per_s,
                "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "heartbeat_at": self.heartbeat_at,
                "shard_index": self.shard_index, "round_ends_at": self.round_ends_at,
                "clock_offset_s": self.clock_offset_s, "stage": self.stage, "latency_s": self.latency_s,
                "queue": self.queue, "service_s": self.service_s, "busy": self.busy,
                "stage_since": self.stage_since, "incarnation": self.incarnation,
                **({"copies": [list(c) for c in self.copies]} if self.copies else {}),
                **({} if self.stats is None else {"stats": self.stats.to_json()})}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PeerRecord:
        k = cls.KIND
        return cls(run_id=_str(k, d, "run_id"), peer_id=_peer_id(k, d, "peer_id"), endpoint=_str(k, d, "endpoint"),
                   role=_str(k, d, "role"), client_mode=_bool(k, d, "client_mode"), round=_int(k, d, "round"),
                   state_hash=_str(k, d, "state_hash"),
                   throughput_tokens_per_s=_float(k, d, "throughput_tokens_per_s"),
                   bandwidth_bytes_per_s=_float(k, d, "bandwidth_bytes_per_s"),
                   heartbeat_at=_float(k, d, "heartbeat_at"), shard_index=_index_or_none(k, d, "shard_index"),
                   round_ends_at=_optional_float(k, d, "round_ends_at"), clock_offset_s=_clock_offset(k, d),
                   stage=_index_or_none(k, d, "stage"), latency_s=_optional_float(k, d, "latency_s"),
                   queue=_optional_int(k, d, "queue"), service_s=_optional_float(k, d, "service_s"),
                   busy=_optional_float(k, d, "busy"), stage_since=_optional_float(k, d, "stage_since"),
                   copies=_copies(k, d), stats=_stats(k, d), incarnation=_optional_int(k, d, "incarnation"))


@dataclass(frozen=True)
class DepartureRecord(Record):
    """A peer left the run (a graceful leave): its voters retired, each signed with its identity key, per scope.

    Read by the round's decision: a retired voter grants nothing from its `from_round` on, so a quorum of
    that round is counted without it (round/ballots.py). A peer that comes back votes as its next incarnation;
    the retirements of the earlier ones stay true and stay announced.
    """

    KIND: ClassVar[str] = "departure"
    run_id: str
    peer_id: str
    from_round: int  # the newest retirement's (of the whole model's scope, or the first listed)
    left_at: float  # unix seconds (the leaver's clock)
    retirements: Mapping[str, tuple[Retirement, ...]] = field(default_factory=dict, hash=False)  # scope -> its own

    def __post_init__(self) -> None:
        if len(self.retirements) > MAX_SCOPES or sum(len(v) for v in self.retirements.values()) > 4 * MAX_SCOPES:
            raise _field(self.KIND, "retirements", "too many")
        for scope, rs in self.retirements.items():
            if any(r.voter.peer_id != self.peer_id for r in rs):
                raise _field(self.KIND, "retirements", f"scope {scope!r} holds another peer's retirement")

    @property
    def owner_id(self) -> str:
        return self.peer_id

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "peer_id": self.peer_id, "from_round": self.from_round, "left_at": self.left_at,
                "retirements": {s: [r.to_json() for r in rs] for s, rs in sorted(self.retirements.items())}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DepartureRecord:
        k = cls.KIND
        raw = d.get("retirements", {})
        if not isinstance(raw, dict) or len(raw) > MAX_SCOPES:
            raise _field(k, "retirements", "expected an object of scopes")
        try:
            retirements = {str(s): tuple(Retirement.from_json(r) for r in rs[:8]) for s, rs in raw.items()
                           if isinstance(rs, list)}
        except BallotError as e:
            raise _field(k, "retirements", str(e)) from None
        return cls(run_id=_str(k, d, "run_id"), peer_id=_peer_id(k, d, "peer_id"), from_round=_int(k, d, "from_round"),
                   left_at=_float(k, d, "left_at"), retirements=retirements)


@dataclass(frozen=True)
class MatchEntry(Record):
    """A peer's request to join attempt `attempt` of round `round`, posted at `posted_at` (its unix clock)."""

    KIND: ClassVar[str] = "entry"
    run_id: str
    round: int
    member: Member
    posted_at: float
    attempt: int = 0  # matchmaking attempt of the round (a new one opens only after the previous one ended)

    def __post_init__(self) -> None:
        check_endpoint(self.KIND, self.member.endpoint, client_mode=self.member.client_mode)

    @property
    def owner_id(self) -> str:
        return self.member.peer_id

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "round": self.round, "member": _member_dict(self.member),
                "posted_at": self.posted_at, "attempt": self.attempt}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> MatchEntry:
        k = cls.KIND
        return cls(run_id=_str(k, d, "run_id"), round=_int(k, d, "round"), member=_member(k, d.get("member")),
                   posted_at=_float(k, d, "posted_at"), attempt=_int(k, d, "attempt"))


@dataclass(frozen=True)
class GroupRecord(Record):
    """The leader's final member list for one attempt of a round (sorted by peer_id); members adopt exactly this."""

    KIND: ClassVar[str] = "group"
    run_id: str
    round: int
    leader_id: str
    members: tuple[Member, ...]
    window_close_at: float
    attempt: int = 0

    def __post_init__(self) -> None:
        ids = [m.peer_id for m in self.members]
        if ids != sorted(ids) or len(set(ids)) != len(ids):
            raise _field(self.KIND, "members", "must be unique and sorted by peer_id")
        if len(ids) > MAX_GROUP_MEMBERS:
            raise _field(self.KIND, "members", f"{len(ids)} members exceeds {MAX_GROUP_MEMBERS}")
        if self.leader_id not in ids or self.leader_id != ids[0]:
            raise _field(self.KIND, "leader_id", f"{self.leader_id!r} must be the smallest member id")

    @property
    def owner_id(self) -> str:
        return self.leader_id

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "round": self.round, "leader_id": self.leader_id,
                "members": [_member_dict(m) for m in self.members], "window_close_at": self.window_close_at,
                "attempt": self.attempt}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> GroupRecord:
        k = cls.KIND
        raw = d.get("members")
        if not isinstance(raw, list):
            raise _field(k, "members", f"expected a list, got {type(raw).__name__}")
        if len(raw) > MAX_GROUP_MEMBERS:
            raise _field(k, "members", f"{len(raw)} members exceeds {MAX_GROUP_MEMBERS}")
        return cls(run_id=_str(k, d, "run_id"), round=_int(k, d, "round"), leader_id=_peer_id(k, d, "leader_id"),
                   members=tuple(_member(k, m) for m in raw), window_close_at=_float(k, d, "window_close_at"),
                   attempt=_int(k, d, "attempt"))

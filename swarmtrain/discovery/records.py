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
from swarmtrain.discovery.fields import (
    HEX_RE,
    RecordError,
    field_error,
    fields_from_json,
    fields_to_json,
    read_bool,
    read_count,
    read_hex,
    read_index,
    read_number,
    read_optional_count,
    read_optional_number,
    read_peer_id,
    read_signed_number,
    read_str,
    wire,
)
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
    "StageLoad",
    "check_endpoint",
    "decode_record",
]

ROLES = ("coordinator", "worker", "stage_server", "trainer")
MAX_RECORD_BYTES = 1 << 20  # a run config is a few KiB; anything near this is hostile
MAX_GROUP_MEMBERS = 4096
MAX_SCOPES = 64  # averaging scopes of one run: the whole model, or a pipeline's stages and its trainers
MAX_STAGE_COPIES = 8  # a stage server keeps copies of its two neighbouring stages
MAX_CLOCK_OFFSET_S = 86400.0  # a day: past that a clock estimate is nonsense, not skew
_ENDPOINT_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):(\d{1,5})$")


def _copies(kind: str, d: Mapping[str, Any], name: str) -> tuple[tuple[int, int], ...]:
    """A stage server's kept copies of other stages, [[stage, round], ...]; absent in older records."""
    v = d.get(name, [])
    ok = isinstance(v, list) and len(v) <= MAX_STAGE_COPIES and all(
        isinstance(c, list) and len(c) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in c)
        for c in v)
    if not ok:
        raise field_error(kind, "copies", f"expected at most {MAX_STAGE_COPIES} [stage, round] pairs of ints, got "
                                     f"{str(v)[:80]}")
    return tuple((c[0], c[1]) for c in v)


def _stats(kind: str, d: Mapping[str, Any], name: str) -> PeerStats | None:
    if name not in d:
        return None
    try:
        return PeerStats.from_json(d[name])
    except StatsError as e:
        raise field_error(kind, "stats", str(e)) from None


def check_endpoint(kind: str, endpoint: str, *, client_mode: bool) -> None:
    """An endpoint is host:port with 1 <= port <= 65535; client-mode peers may leave it empty."""
    if endpoint == "" and client_mode:
        return
    m = _ENDPOINT_RE.match(endpoint)
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise field_error(kind, "endpoint", f"{endpoint[:80]!r} is not host:port")


def _member(kind: str, d: Any) -> Member:
    if not isinstance(d, Mapping):
        raise field_error(kind, "members", f"each member must be an object, got {type(d).__name__}")
    client_mode = read_bool(kind, d, "client_mode")
    endpoint = read_str(kind, d, "endpoint")
    check_endpoint(kind, endpoint, client_mode=client_mode)
    state_hash = read_hex(kind, d, "state_hash")  # absent in entries of peers from before θ-hash groups
    return Member(peer_id=read_peer_id(kind, d, "peer_id"), endpoint=endpoint, client_mode=client_mode,
                  bandwidth_bytes_per_s=read_number(kind, d, "bandwidth_bytes_per_s"),
                  steps_per_s=read_number(kind, d, "steps_per_s"), lag_s=read_optional_number(kind, d, "lag_s"),
                  state_hash=state_hash, incarnation=read_optional_count(kind, d, "incarnation"))


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
        raise field_error(kind, "kind", f"expected {kind!r}, got {d.get('kind')!r}")
    record = cls.from_json(d)
    rec_run = getattr(record, "run_id")  # noqa: B009 - every record kind has run_id
    if rec_run != run_id:
        raise field_error(kind, "run_id", f"record is for run {rec_run!r}, not {run_id!r}")
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
            raise field_error(self.KIND, "genesis", f"{len(self.genesis)} scopes exceeds {MAX_SCOPES}")

    @property
    def owner_id(self) -> str:
        return self.coordinator_id

    def run_config(self) -> RunConfig:
        try:
            cfg = from_dict(self.config)
        except (ConfigError, TypeError) as e:
            raise field_error(self.KIND, "config", str(e)) from e
        if cfg.train.run_id != self.run_id:
            raise field_error(self.KIND, "config", f"train.run_id {cfg.train.run_id!r} != run_id {self.run_id!r}")
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
            raise field_error(k, "config", f"expected an object, got {type(config).__name__}")
        raw = d.get("genesis", {})
        if not isinstance(raw, dict) or len(raw) > MAX_SCOPES or not all(isinstance(s, str) for s in raw):
            raise field_error(k, "genesis", "expected an object of scopes")
        try:
            genesis = {s: Genesis.from_json(g) for s, g in raw.items()}
        except BallotError as e:
            raise field_error(k, "genesis", str(e)) from None
        return cls(run_id=read_str(k, d, "run_id"), coordinator_id=read_peer_id(k, d, "coordinator_id"), config=config,
                   round=read_count(k, d, "round"), updated_at=read_number(k, d, "updated_at"), genesis=genesis)


@dataclass(frozen=True)
class StageLoad:
    """A stage server's part of its peer record: its stage and how loaded it is (the rebalancing and lost-stage
    rules read it, and the trainers route by it)."""

    KIND: ClassVar[str] = "peer.server"
    stage: int = wire(read_count)  # the pipeline stage it serves
    latency_s: float = wire(read_optional_number, default=0.0)  # mean seconds per call (EWMA)
    queue: int = wire(read_optional_count, default=0)  # calls waiting
    # compute seconds per micro-batch, forward + backward (EWMA); 0 = unknown
    service_s: float = wire(read_optional_number, default=0.0)
    busy: float = wire(read_optional_number, default=0.0)  # fraction of its last window computing
    stage_since: float = wire(read_optional_number, default=0.0)  # unix seconds it took its stage; 0 = unknown
    # kept copies of other stages: (stage, round) each
    copies: tuple[tuple[int, int], ...] = wire(_copies, default=(), write=lambda v: [list(c) for c in v],
                                               omit=lambda v: not v)

    def __post_init__(self) -> None:
        k = self.KIND
        if self.stage < 0:
            raise field_error(k, "stage", f"expected an int >= 0, got {self.stage}")
        if not math.isfinite(self.latency_s) or self.latency_s < 0 or self.queue < 0:
            raise field_error(k, "latency_s", f"latency {self.latency_s} and queue {self.queue} must be >= 0")
        if not math.isfinite(self.service_s) or self.service_s < 0:
            raise field_error(k, "service_s", f"expected a finite number >= 0, got {self.service_s}")
        if not 0 <= self.busy <= 1:
            raise field_error(k, "busy", f"expected a fraction in [0, 1], got {self.busy}")
        if not math.isfinite(self.stage_since) or self.stage_since < 0:
            raise field_error(k, "stage_since", f"expected a finite number >= 0, got {self.stage_since}")
        if len(self.copies) > MAX_STAGE_COPIES or any(s < 0 or r < 0 for s, r in self.copies):
            raise field_error(k, "copies", f"expected at most {MAX_STAGE_COPIES} (stage, round) pairs of ints >= 0, "
                                           f"got {list(self.copies)[:MAX_STAGE_COPIES + 1]}")

    def to_json(self) -> dict[str, Any]:
        return fields_to_json(self)

    @classmethod
    def from_json(cls, d: Any) -> StageLoad:
        if not isinstance(d, Mapping):
            raise RecordError(f"{cls.KIND}: expected an object, got {type(d).__name__}")
        return cls(**fields_from_json(cls, cls.KIND, d))


def _stage_load(kind: str, d: Mapping[str, Any], name: str) -> StageLoad | None:
    if name not in d:
        return None
    return StageLoad.from_json(d[name])


@dataclass(frozen=True)
class PeerRecord(Record):
    """One live peer, refreshed by its heartbeat; gone once `heartbeat_at + record_ttl_s` passes."""

    KIND: ClassVar[str] = "peer"
    run_id: str = wire(read_str)
    peer_id: str = wire(read_peer_id)
    endpoint: str = wire(read_str)  # host:port of its gRPC server; "" for a client-mode peer
    role: str = wire(read_str, default="worker")
    client_mode: bool = wire(read_bool, default=False)
    round: int = wire(read_count, default=0)
    state_hash: str = wire(read_str, default="")  # hex digest of θ_global at `round`
    throughput_tokens_per_s: float = wire(read_number, default=0.0)
    bandwidth_bytes_per_s: float = wire(read_number, default=0.0)
    heartbeat_at: float = wire(read_number, default=0.0)  # unix seconds
    # the data slot it reads in a run with data.num_shards > 0; -1 = none
    shard_index: int = wire(read_index, default=-1)
    # unix seconds it expects its inner steps of `round` to end; 0 = unknown
    round_ends_at: float = wire(read_optional_number, default=0.0)
    # its estimate of (swarm clock − its clock); 0 = none (discovery/clock.py)
    clock_offset_s: float = wire(read_signed_number, default=0.0)
    server: StageLoad | None = wire(_stage_load, default=None, write=lambda v: v.to_json(), omit=lambda v: v is None)
    # its work so far, for the dashboard (absent in older peers' records)
    stats: PeerStats | None = wire(_stats, default=None, write=lambda v: v.to_json(), omit=lambda v: v is None)
    # of its voter in its scope (round/ballots.py): what a genesis lists it as
    incarnation: int = wire(read_optional_count, default=0)

    def __post_init__(self) -> None:
        if (self.role == "stage_server") != (self.server is not None):
            raise field_error(self.KIND, "server", f"{'none' if self.server is None else 'a stage'} does not fit role "
                                              f"{self.role!r} (a stage_server names its stage and load, nobody else)")
        if not math.isfinite(self.clock_offset_s) or abs(self.clock_offset_s) > MAX_CLOCK_OFFSET_S:
            raise field_error(self.KIND, "clock_offset_s", f"expected a number within ±{MAX_CLOCK_OFFSET_S:.0f}, "
                                                      f"got {self.clock_offset_s}")
        if not math.isfinite(self.round_ends_at) or self.round_ends_at < 0:
            raise field_error(self.KIND, "round_ends_at", f"expected a finite number >= 0, got {self.round_ends_at}")
        if self.shard_index < -1:
            raise field_error(self.KIND, "shard_index", f"expected an int >= -1, got {self.shard_index}")
        if self.role not in ROLES:
            raise field_error(self.KIND, "role", f"{self.role!r} is not one of {ROLES}")
        if not HEX_RE.match(self.state_hash):
            raise field_error(self.KIND, "state_hash", f"{self.state_hash[:40]!r} is not lowercase hex")
        check_endpoint(self.KIND, self.endpoint, client_mode=self.client_mode)

    @property
    def owner_id(self) -> str:
        return self.peer_id

    @property
    def stage(self) -> int:
        """A stage server's stage; -1 for every other role."""
        return self.server.stage if self.server is not None else -1

    @property
    def copies(self) -> tuple[tuple[int, int], ...]:
        """A stage server's kept copies of other stages; () for every other role."""
        return self.server.copies if self.server is not None else ()

    def to_member(self) -> Member:
        return Member(peer_id=self.peer_id, endpoint=self.endpoint, client_mode=self.client_mode,
                      bandwidth_bytes_per_s=self.bandwidth_bytes_per_s, state_hash=self.state_hash,
                      incarnation=self.incarnation)

    def to_json(self) -> dict[str, Any]:
        return fields_to_json(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PeerRecord:
        return cls(**fields_from_json(cls, cls.KIND, d))


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
            raise field_error(self.KIND, "retirements", "too many")
        for scope, rs in self.retirements.items():
            if any(r.voter.peer_id != self.peer_id for r in rs):
                raise field_error(self.KIND, "retirements", f"scope {scope!r} holds another peer's retirement")

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
            raise field_error(k, "retirements", "expected an object of scopes")
        try:
            retirements = {str(s): tuple(Retirement.from_json(r) for r in rs[:8]) for s, rs in raw.items()
                           if isinstance(rs, list)}
        except BallotError as e:
            raise field_error(k, "retirements", str(e)) from None
        return cls(run_id=read_str(k, d, "run_id"), peer_id=read_peer_id(k, d, "peer_id"),
                   from_round=read_count(k, d, "from_round"), left_at=read_number(k, d, "left_at"),
                   retirements=retirements)


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
        return cls(run_id=read_str(k, d, "run_id"), round=read_count(k, d, "round"), member=_member(k, d.get("member")),
                   posted_at=read_number(k, d, "posted_at"), attempt=read_count(k, d, "attempt"))


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
            raise field_error(self.KIND, "members", "must be unique and sorted by peer_id")
        if len(ids) > MAX_GROUP_MEMBERS:
            raise field_error(self.KIND, "members", f"{len(ids)} members exceeds {MAX_GROUP_MEMBERS}")
        if self.leader_id not in ids or self.leader_id != ids[0]:
            raise field_error(self.KIND, "leader_id", f"{self.leader_id!r} must be the smallest member id")

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
            raise field_error(k, "members", f"expected a list, got {type(raw).__name__}")
        if len(raw) > MAX_GROUP_MEMBERS:
            raise field_error(k, "members", f"{len(raw)} members exceeds {MAX_GROUP_MEMBERS}")
        return cls(run_id=read_str(k, d, "run_id"), round=read_count(k, d, "round"),
                   leader_id=read_peer_id(k, d, "leader_id"), members=tuple(_member(k, m) for m in raw),
                   window_close_at=read_number(k, d, "window_close_at"), attempt=read_count(k, d, "attempt"))

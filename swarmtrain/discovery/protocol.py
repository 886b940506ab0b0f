"""The Discovery protocol (async, a deadline on every call) and the typed layer both backends share.

A backend stores opaque values under `(key, owner)`: only the owner may write its own slot (the
hivemind backend enforces this with RSA signatures, the in-memory one by construction). Every key
is namespaced by the run id. `RecordDirectory` seals every record it writes with the run key
(trust/seal.py) and turns slots into validated typed records: a slot that is not sealed by this
run's key (an outsider, a peer of another run), or fails to decode (garbage, wrong run, owned by
someone else), is skipped and logged once per signer, never raised, so one hostile peer cannot stop
the others from reading the swarm, nor write anything they act on.
"""

from __future__ import annotations

import abc
import collections
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

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
from swarmtrain.trust import RunSecret, SealError, open_sealed, seal
from swarmtrain.trust.identity import Identity, KeyBinding

__all__ = ["DEPARTURE_KEEP_S", "DirectoryIo", "Discovery", "DiscoveryError", "RawSlot", "RecordDirectory",
           "RunConflictError"]

log = logging.getLogger(__name__)
# How long a departure stays readable: far past any round's length, so the round after a graceful leave
# (however long it takes) still sees it; at least 10 record TTLs.
DEPARTURE_KEEP_S = 3600.0
MAX_SLOTS_PER_KEY = 4096  # slots (one per signer) decoded per key read
MAX_GOOD_SIGNERS = 16384  # signers whose records checked out, remembered to rank them first
DECODED_CACHE_SIZE = 4096  # decoded records kept per directory (a few heartbeats of a large swarm's records)
MAX_LOGGED_SIGNERS = 1024  # signers whose refused records were logged once; past it, refusals are not logged
R = TypeVar("R", bound=Record)
M = TypeVar("M", MatchEntry, GroupRecord)  # the records of one matchmaking attempt


@dataclass
class DirectoryIo:
    """A peer's control-plane work through its directory since it started: what the swarm's size costs it."""

    reads: int = 0  # DHT lookups (one per key read)
    writes: int = 0  # DHT stores: records and tombstones
    slots: int = 0  # values those lookups returned (one per signer under the key, before MAX_SLOTS_PER_KEY)
    decoded: int = 0  # records whose seal was opened and fields checked (the others came from the decode cache)

    def minus(self, before: DirectoryIo) -> DirectoryIo:
        return DirectoryIo(self.reads - before.reads, self.writes - before.writes, self.slots - before.slots,
                           self.decoded - before.decoded)

    def copy(self) -> DirectoryIo:
        return DirectoryIo(self.reads, self.writes, self.slots, self.decoded)


class DiscoveryError(RuntimeError):
    """The control plane could not do what was asked (store refused, timeout, closed)."""


class RunConflictError(ValueError):
    """Several signers published a run record and no coordinator id was given to pick one."""


@dataclass(frozen=True)
class RawSlot:
    """One owner's value under a key, as a backend returns it (`signer_id` proven by the backend)."""

    signer_id: str | None  # None: the backend could not attribute the value to an owner
    value: object
    expires_at: float


@runtime_checkable
class Discovery(Protocol):
    """Who is in the run, the run config, and each round's matchmaking records."""

    @property
    def peer_id(self) -> str: ...

    @property
    def run_id(self) -> str: ...

    @property
    def io(self) -> DirectoryIo:
        """The DHT operations and records this peer's reads and writes cost so far (cumulative)."""
        ...

    @property
    def identity(self) -> Identity:
        """This peer's signing key: its id is derived from it (what its voters sign grants with)."""
        ...

    @property
    def key_binding(self) -> KeyBinding:
        """Whether a public key is a given peer id's (self-certifying ids, or the twin's registry)."""
        ...

    clock_offset_s: float  # added to this machine's clock by now(): the peer's estimate of the swarm's

    def now(self) -> float:
        """The clock records are stamped with (unix seconds, on the swarm's clock as far as it is known)."""
        ...

    async def publish_run(self, record: RunRecord, *, timeout_s: float) -> None: ...

    async def fetch_run(self, *, coordinator_id: str | None = None, join_ids: Sequence[str] = (),
                        timeout_s: float) -> RunRecord | None: ...

    async def announce(self, record: PeerRecord, *, timeout_s: float) -> None: ...

    async def live_peers(self, *, timeout_s: float) -> tuple[PeerRecord, ...]: ...

    async def withdraw(self, *, timeout_s: float) -> None: ...

    async def announce_departure(self, record: DepartureRecord, *, timeout_s: float) -> None:
        """Say this peer left for good (kept DEPARTURE_KEEP_S, long past its peer record)."""
        ...

    async def departures(self, *, timeout_s: float) -> tuple[DepartureRecord, ...]: ...

    async def rejoin(self, *, timeout_s: float) -> None:
        """Withdraw this peer's departure, if it left before with the same identity (call before rounds)."""
        ...

    async def rebootstrap(self, maddrs: Sequence[str], *, timeout_s: float) -> int:
        """Dial `maddrs` again and rebuild this node's routing table from them (a node cut off from the
        swarm for longer than its links lived); returns how many answered."""
        ...

    async def post_entry(self, entry: MatchEntry, *, keep_s: float, timeout_s: float, scope: str = "") -> None:
        """Store `entry` under (scope, round, attempt) until `entry.posted_at + keep_s`.

        `scope` names the peers that average one part of the model ("" = the whole model; a pipeline
        stage's servers match under their stage): rounds of different scopes never meet."""
        ...

    async def round_entries(self, round_index: int, attempt: int, *, timeout_s: float,
                            scope: str = "") -> tuple[MatchEntry, ...]: ...

    async def post_group(self, record: GroupRecord, *, keep_s: float, timeout_s: float, scope: str = "") -> None:
        """Store `record` under (scope, round, attempt) until `record.window_close_at + keep_s`."""
        ...

    async def round_groups(self, round_index: int, attempt: int, *, timeout_s: float,
                           scope: str = "") -> tuple[GroupRecord, ...]: ...

    async def aclose(self) -> None: ...


class RecordDirectory(abc.ABC):
    """Implements `Discovery` over a backend's owner-slot `_put`/`_get`/`_delete`."""

    def __init__(self, *, run_id: str, record_ttl_s: float, clock: Callable[[], float] = time.time,
                 run_key: str = "") -> None:
        """`run_key`: the run's secret; records are sealed and read with it ("" is an open run: anyone
        who knows that the key is empty can write records the swarm reads)."""
        if record_ttl_s <= 0:
            raise ValueError(f"record_ttl_s must be > 0, got {record_ttl_s}")
        self._run_id = run_id
        self._seal_key = RunSecret.from_run_key(run_key).records
        self._logged_signers: set[str] = set()
        # (kind, key, signer, sealed bytes) -> the record they decode to: peers re-read the same records every
        # heartbeat, and checking a seal and validating a record field by field is most of a read's cost.
        # Both are pure functions of those four (the seal key is this directory's), and records are frozen.
        self._decoded_cache: collections.OrderedDict[tuple[str, str, str, bytes], Record] = collections.OrderedDict()
        self._good_signers: collections.OrderedDict[str, None] = collections.OrderedDict()  # least recent first
        self._capped_keys: set[str] = set()  # keys whose slots were capped (logged once each)
        self._ttl_s = record_ttl_s
        self._clock = clock
        # (swarm clock − this machine's clock): every timestamp this peer writes or compares is on the
        # swarm's clock once the peer has estimated it (peer/presence.py), so skew within the tolerance
        # changes nothing.
        self.clock_offset_s = 0.0
        self._prefix = f"swarmtrain/{run_id}/"
        self.io = DirectoryIo()

    # ---------------------------------------------------------------- backend hooks

    @property
    @abc.abstractmethod
    def peer_id(self) -> str: ...

    @property
    @abc.abstractmethod
    def identity(self) -> Identity: ...

    @property
    @abc.abstractmethod
    def key_binding(self) -> KeyBinding: ...

    @abc.abstractmethod
    async def _put(self, key: str, value: bytes, *, expires_at: float, timeout_s: float) -> None: ...

    @abc.abstractmethod
    async def _get(self, key: str, *, timeout_s: float) -> Sequence[RawSlot]: ...

    @abc.abstractmethod
    async def _delete(self, key: str, *, timeout_s: float) -> None: ...

    @abc.abstractmethod
    async def aclose(self) -> None: ...

    async def rebootstrap(self, maddrs: Sequence[str], *, timeout_s: float) -> int:
        """See `Discovery.rebootstrap`. A directory without a routing table (the in-memory twin) has
        nothing to rebuild: 0."""
        return 0

    # ---------------------------------------------------------------- typed API

    @property
    def run_id(self) -> str:
        return self._run_id

    def now(self) -> float:
        """The swarm's clock as this peer estimates it: its own plus `clock_offset_s`."""
        return float(self._clock()) + self.clock_offset_s

    def _key(self, name: str) -> str:
        return self._prefix + name

    def _check_own(self, record: Record) -> None:
        if record.owner_id != self.peer_id:
            raise RecordError(f"{record.KIND}: owned by {record.owner_id!r}; this peer is {self.peer_id!r}")
        if getattr(record, "run_id") != self._run_id:  # noqa: B009
            raise RecordError(f"{record.KIND}: run {getattr(record, 'run_id')!r} is not {self._run_id!r}")  # noqa: B009

    async def _put_record(self, key: str, record: Record, *, expires_at: float, timeout_s: float) -> None:
        self._check_own(record)
        value = seal(self._seal_key, dht_key=key, signer_id=self.peer_id, body=record.encode())
        self.io.writes += 1
        await self._put(key, value, expires_at=expires_at, timeout_s=timeout_s)

    async def _decoded(self, cls: type[R], key: str, *, timeout_s: float) -> list[R]:
        out: list[R] = []
        self.io.reads += 1
        slots = await self._get(key, timeout_s=timeout_s)
        self.io.slots += len(slots)
        for slot in self._bounded(key, slots):
            if slot.value == b"":
                continue  # a withdrawn record's tombstone
            # Only bytes are looked up: anything else is refused below (open_sealed), and bytes() of an int
            # a stranger stored would allocate that many zero bytes.
            cache_key = ((cls.KIND, key, str(slot.signer_id), bytes(slot.value))
                         if isinstance(slot.value, (bytes, bytearray)) else None)
            if cache_key is not None and (cached := self._decoded_cache.get(cache_key)) is not None:
                self._decoded_cache.move_to_end(cache_key)
                out.append(cached)  # type: ignore[arg-type]
                continue
            self.io.decoded += 1
            try:
                if slot.signer_id is None:
                    raise RecordError(f"{cls.KIND}: unsigned record")
                body = open_sealed(self._seal_key, slot.value, dht_key=key, signer_id=slot.signer_id)
                record = decode_record(cls, body, run_id=self._run_id, signer_id=slot.signer_id)
            except (RecordError, SealError) as e:
                self._log_refused(cls.KIND, key, slot.signer_id, e)
                continue
            assert cache_key is not None  # open_sealed opened bytes
            self._decoded_cache[cache_key] = record
            if len(self._decoded_cache) > DECODED_CACHE_SIZE:
                self._decoded_cache.popitem(last=False)
            self._good_signers[str(slot.signer_id)] = None
            self._good_signers.move_to_end(str(slot.signer_id))
            if len(self._good_signers) > MAX_GOOD_SIGNERS:
                self._good_signers.popitem(last=False)
            out.append(record)
        return out

    def _bounded(self, key: str, slots: Sequence[RawSlot]) -> Sequence[RawSlot]:
        """At most `MAX_SLOTS_PER_KEY` of a key's slots: signers whose records checked out before first, then
        the rest in an order of this peer's own (a hash of its id and theirs), so that identities made up by
        the thousand cannot make every reader decode all of them, nor choose whom each reader drops."""
        if len(slots) <= MAX_SLOTS_PER_KEY:
            return slots
        me = self.peer_id
        ranked = sorted(slots, key=lambda slot: (str(slot.signer_id) not in self._good_signers,
                                                 hashlib.sha256(f"{me}|{slot.signer_id}".encode()).digest()))
        if key not in self._capped_keys and len(self._capped_keys) < MAX_LOGGED_SIGNERS:
            self._capped_keys.add(key)
            log.warning("%s holds %d records; reading the first %d (known signers first): a swarm that large, or "
                        "identities made up to flood it", key, len(slots), MAX_SLOTS_PER_KEY)
        return ranked[:MAX_SLOTS_PER_KEY]

    def _log_refused(self, kind: str, key: str, signer_id: str | None, error: Exception) -> None:
        """Once per signer at WARNING (a stranger re-publishes every heartbeat), at DEBUG after."""
        signer = str(signer_id)[:128]
        if signer in self._logged_signers or len(self._logged_signers) >= MAX_LOGGED_SIGNERS:
            log.debug("ignored a %s record under %s from %s: %s", kind, key, signer, error)
            return
        self._logged_signers.add(signer)
        log.warning("ignored a %s record under %s from %s: %s (further records of this signer are ignored "
                    "without a word)", kind, key, signer, error)

    async def publish_run(self, record: RunRecord, *, timeout_s: float) -> None:
        # The run record outlives peers: it must survive a coordinator restart window.
        await self._put_record(self._key("run"), record, expires_at=self.now() + max(self._ttl_s, 3600.0),
                               timeout_s=timeout_s)

    async def fetch_run(self, *, coordinator_id: str | None = None, join_ids: Sequence[str] = (),
                        timeout_s: float) -> RunRecord | None:
        """The run record of `coordinator_id` when given; else the only signer's, or, among several
        signers, the one whose id is among `join_ids` (the `/p2p/` ids of `--join`)."""
        records = await self._decoded(RunRecord, self._key("run"), timeout_s=timeout_s)
        if coordinator_id is not None:
            records = [r for r in records if r.coordinator_id == coordinator_id]
        if not records:
            return None
        signers = sorted({r.coordinator_id for r in records})
        if len(signers) > 1 and coordinator_id is None:
            joined = [r for r in records if r.coordinator_id in join_ids]
            if len({r.coordinator_id for r in joined}) == 1:
                records, signers = joined, [joined[0].coordinator_id]
        if len(signers) > 1:
            raise RunConflictError(f"run {self._run_id!r} has run records signed by {signers}; "
                                   "pass the coordinator's peer id to choose (--coordinator-id)")
        return max(records, key=lambda r: r.updated_at)

    async def announce(self, record: PeerRecord, *, timeout_s: float) -> None:
        await self._put_record(self._key("peers"), record, expires_at=record.heartbeat_at + self._ttl_s,
                               timeout_s=timeout_s)

    async def live_peers(self, *, timeout_s: float) -> tuple[PeerRecord, ...]:
        now = self.now()
        records = await self._decoded(PeerRecord, self._key("peers"), timeout_s=timeout_s)
        live = [r for r in records if r.heartbeat_at + self._ttl_s > now]
        return tuple(sorted(live, key=lambda r: r.peer_id))

    async def withdraw(self, *, timeout_s: float) -> None:
        self.io.writes += 1
        await self._delete(self._key("peers"), timeout_s=timeout_s)

    async def announce_departure(self, record: DepartureRecord, *, timeout_s: float) -> None:
        await self._put_record(self._key("departures"), record, expires_at=self.now() + self._departure_keep_s(),
                               timeout_s=timeout_s)

    async def departures(self, *, timeout_s: float) -> tuple[DepartureRecord, ...]:
        records = await self._decoded(DepartureRecord, self._key("departures"), timeout_s=timeout_s)
        return tuple(sorted(records, key=lambda r: r.peer_id))

    async def rejoin(self, *, timeout_s: float) -> None:
        # A tombstone outliving any departure this identity announced (a later expiry wins the slot).
        self.io.writes += 1
        await self._put(self._key("departures"), b"", expires_at=self.now() + self._departure_keep_s() + 1.0,
                        timeout_s=timeout_s)

    def _departure_keep_s(self) -> float:
        return max(DEPARTURE_KEEP_S, 10 * self._ttl_s)

    async def post_entry(self, entry: MatchEntry, *, keep_s: float, timeout_s: float, scope: str = "") -> None:
        await self._put_record(self._match_key(entry.round, entry.attempt, "entries", scope), entry,
                               expires_at=entry.posted_at + keep_s, timeout_s=timeout_s)

    async def round_entries(self, round_index: int, attempt: int, *, timeout_s: float,
                            scope: str = "") -> tuple[MatchEntry, ...]:
        return await self._attempt_records(MatchEntry, round_index, attempt, "entries", scope, timeout_s=timeout_s)

    async def post_group(self, record: GroupRecord, *, keep_s: float, timeout_s: float, scope: str = "") -> None:
        await self._put_record(self._match_key(record.round, record.attempt, "group", scope), record,
                               expires_at=record.window_close_at + keep_s, timeout_s=timeout_s)

    async def round_groups(self, round_index: int, attempt: int, *, timeout_s: float,
                           scope: str = "") -> tuple[GroupRecord, ...]:
        return await self._attempt_records(GroupRecord, round_index, attempt, "group", scope, timeout_s=timeout_s)

    def _match_key(self, round_index: int, attempt: int, name: str, scope: str = "") -> str:
        if "/" in scope:
            raise ValueError(f"an averaging scope is one path segment, got {scope!r}")
        return self._key(f"{scope + '/' if scope else ''}round/{round_index}/{attempt}/{name}")

    async def _attempt_records(self, cls: type[M], round_index: int, attempt: int, name: str, scope: str, *,
                               timeout_s: float) -> tuple[M, ...]:
        """The valid records of one (round, attempt) slot, sorted by owner (entries: member, group: leader)."""
        records = await self._decoded(cls, self._match_key(round_index, attempt, name, scope), timeout_s=timeout_s)
        return tuple(sorted((r for r in records if r.round == round_index and r.attempt == attempt),
                            key=lambda r: r.owner_id))

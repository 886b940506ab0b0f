"""The member side of the fault-tolerant butterfly all-reduce: it ends holding the round's *material* (every
shard of the mean over the agreed contributors), or says why not. Whether the round commits that material
is decided afterwards by the round's voters (deciding.py); nothing here commits anything.

One round, attempt k, reducers R_k (the group's non-client members minus those this member saw die; with more
than `averaging.max_reducers` of them, that many drawn by a rank of the group every member computes):
  1. push: shard j of this member's encoded Δ streams to reducer j (shard sizes by bandwidth);
  2. agree: ask every reducer for its contributors S_j (fixed when its window closed) and take
     C = ∩ S_j in group order — every member that hears from all reducers computes the same C;
  3. quorum: C must hold >= min_peers members and more than half of the group, else the attempt fails;
  4. pull: fetch every shard's mean over C (computed once per C by its reducer), or with a gathering
     codec the contributions over C (a bundle less this member's own, to which it adds its own);
     each is kept encoded and checked (it decodes, to finite values).

Why every member of the session holds the same material: shard j's mean over C is a deterministic function
of (C, the members' encoded shards), computed by one reducer and fetched as bytes. A reducer that cannot
be reached, or has not answered by twice the contribution window, starts a new attempt of the all-reduce
without it (a new session: at most `averaging.max_retries`, all inside the deadline); `on_session` hears
of each session as it starts, so that the caller can ask the voters for their promises meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from swarmtrain.averaging.aggregate import mean_of_gathered, pack_bundle, unpack_bundle
from swarmtrain.averaging.material import blob_digest
from swarmtrain.averaging.reducer import ReducerRegistry, max_encoded_bytes, shard_bounds
from swarmtrain.averaging.transport import Fetched, ReduceTransport
from swarmtrain.compress import Codec, CodecError
from swarmtrain.config import AveragingConfig
from swarmtrain.diloco.averager import Delta, reader
from swarmtrain.round.committee import drawn
from swarmtrain.round.group import Group, Member
from swarmtrain.round.rules import has_quorum
from swarmtrain.rpc.averaging_wire import PushHeader, SessionKey
from swarmtrain.rpc.buffers import BufferPool
from swarmtrain.rpc.errors import Rejected, RpcError, RpcRejected, RpcTimeout, RpcUnavailable

__all__ = ["AllReduce", "Reduction"]

log = logging.getLogger(__name__)

Blob = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Reduction:
    """What one member's all-reduce of a round ended with: the material of session `key` (one blob per
    shard of `bounds`) over `contributors`, or (`ok` False) why not."""

    group: Group
    key: SessionKey | None = None
    contributors: tuple[str, ...] = ()
    bounds: tuple[tuple[int, int], ...] = ()
    blobs: tuple[Blob, ...] = ()
    digests: tuple[str, ...] = ()  # of each blob (material.blob_digest), taken as it arrived
    failed: tuple[str, ...] = ()  # reducers that could not be reached
    reason: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.blobs)


@dataclass
class _Attempt:
    reduction: Reduction | None = None
    dead: set[str] = field(default_factory=set)  # reducers that could not be reached
    final: bool = False  # no point retrying
    reason: str = ""
    heard: frozenset[str] = frozenset()  # members some live reducer of the attempt heard from (its contributors)


class AllReduce:
    """Runs one member's side of a round (see the module docstring) over `transport`."""

    def __init__(self, transport: ReduceTransport, registry: ReducerRegistry, *, peer_id: str, codec: Codec,
                 cfg: AveragingConfig, buffers: BufferPool) -> None:
        self.transport = transport
        self.registry = registry
        self.peer_id = peer_id
        self.codec = codec
        self.cfg = cfg
        self.buffers = buffers
        self.gather = registry.aggregation.gather

    async def run(self, group: Group, delta: Delta, *, deadline: float,
                  on_session: Callable[[SessionKey], None] | None = None) -> Reduction:
        """All attempts of one round until the material is held, a final failure, or `deadline` (loop clock)."""
        loop = asyncio.get_running_loop()
        me = group.members[group.index_of(self.peer_id)]
        await self.registry.open_round(group, numel=delta.numel())
        dead: set[str] = set()
        outcome = _Attempt(reason="no attempt ran")
        heard: frozenset[str] = frozenset()
        for attempt in range(self.cfg.max_retries + 1):
            reducers = drawn(tuple(m for m in group.reducers if m.peer_id not in dead), size=self.cfg.max_reducers,
                             seed=f"reducers\0{group.group_id}", name=lambda m: m.peer_id)
            if not reducers:
                outcome = _Attempt(dead=dead, reason="no live reducer left")
                break
            key = SessionKey(group.run_id, group.round, group.group_id, attempt, tuple(m.peer_id for m in reducers))
            if on_session is not None:
                on_session(key)
            outcome = await self._attempt(group, me, key, reducers, delta, deadline, heard - dead)
            dead |= outcome.dead - {self.peer_id}  # its own reducer is this process: never retried around
            heard = outcome.heard
            if outcome.reduction is not None or outcome.final or loop.time() >= deadline:
                break
            log.warning("%s: round %d attempt %d failed (%s); retrying without %s", self.peer_id, group.round,
                        attempt, outcome.reason, sorted(outcome.dead))
        if outcome.reduction is not None:
            return outcome.reduction
        await self.registry.abandon_round(group)
        log.warning("round %d: no mean on %s: %s%s", group.round, self.peer_id, outcome.reason,
                    f"; unreachable: {sorted(dead)}" if dead else "")
        return Reduction(group, failed=tuple(sorted(dead)), reason=outcome.reason)

    async def _attempt(self, group: Group, me: Member, key: SessionKey, reducers: tuple[Member, ...],
                       delta: Delta, deadline: float, heard: frozenset[str]) -> _Attempt:
        """One attempt; `heard`: the members the previous attempt's live reducers heard from (empty at the first),
        whose pushes close this peer's reducer window early (`ReducerRegistry.open_session`)."""
        loop = asyncio.get_running_loop()
        bounds = shard_bounds(delta.numel(), tuple(m.bandwidth_bytes_per_s for m in reducers),
                              align=self.codec.alignment)
        if me.peer_id in key.reducers:
            await self.registry.open_session(key, awaited=heard)
        t0 = loop.time()
        # a reducer closes its window `contribution_window_s` after it opened; one that has not answered
        # for contributors by twice that is hung (e.g. SIGSTOP), and the next attempt goes on without it
        window_s = self.cfg.contribution_window_s
        push_deadline = min(deadline, t0 + window_s)
        shards = list(zip(reducers, bounds, strict=True))
        own: dict[int, Blob] = {}  # this member's encoded shards: a gathering round adds them to the bundles
        read = reader(delta)

        async def encode_and_push(j: int, reducer: Member, lo: int, hi: int) -> None:
            # Pipelined per shard; read a piece at a time (a Δ given as a source is never whole in fp32).
            # Framed into pooled memory that goes back once the round lets go of it (no fresh pages per round).
            payload = await asyncio.to_thread(lambda: self.codec.encode_from(lambda a, b: read(lo + a, lo + b),
                                                                             hi - lo, into=self.buffers.lent))
            own[j] = payload
            self.registry.standins.keep_own(key, j, payload)  # for a stand-in reducing shard j again
            await self._push(key, j, reducer, payload, hi - lo, push_deadline)

        pushes = await asyncio.gather(*(encode_and_push(j, m, lo, hi) for j, (m, (lo, hi)) in enumerate(shards)),
                                      return_exceptions=True)
        dead = _unreachable(reducers, pushes, timeouts=False)  # a push timing out is late, not dead
        t_pushed = loop.time()
        agree_deadline = min(deadline, max(t0 + 2 * window_s, t_pushed + window_s))
        if dead:
            # A reducer that died while the members pushed took some pushes first: those members learn of its
            # death only when they ask for its contributors, once the others' windows closed. Retrying at once
            # would open the next attempt's windows a window before they come, and close them without them (a
            # group split in two, neither half a majority). So this member waits for the same answers before it
            # retries, and every member starts the next attempt together.
            # What they answer says who is still pushing: the retry's windows close once those pushed.
            # A reducer that died after taking this member's push is found so here, as the members that pushed to
            # every reducer find it (below): all of them then retry without the same reducers, in one session.
            asked = [(j, m) for j, m in enumerate(reducers) if m.peer_id not in dead]
            answers = await asyncio.gather(*(self.transport.contributors(m, key, j, deadline=agree_deadline)
                                             for j, m in asked), return_exceptions=True)
            dead |= _unreachable(tuple(m for _, m in asked), answers)
            return _Attempt(dead=dead, reason=f"could not push to {sorted(dead)}", heard=_heard(answers))
        sets = await asyncio.gather(*(self.transport.contributors(m, key, j, deadline=agree_deadline)
                                      for j, m in enumerate(reducers)), return_exceptions=True)
        failed = _failures(reducers, sets)
        if failed:
            return _Attempt(dead=_unreachable(reducers, sets), final=not _unreachable(reducers, sets),
                            reason=f"contributors unavailable from {failed}", heard=_heard(sets))
        # as sets: N members x R lookups (in tuples, N² x R: seconds of a reducer's CPU at 1,000 members)
        heard_by = [frozenset(s) for s in sets]  # type: ignore[arg-type]  # no failure among them (above)
        agreed = tuple(m.peer_id for m in group.members if all(m.peer_id in s for s in heard_by))
        if not has_quorum(len(agreed), group_size=len(group.members), min_peers=self.cfg.min_peers):
            return _Attempt(final=True, reason=f"only {len(agreed)} of {len(group.members)} delivered (min_peers "
                                               f"{self.cfg.min_peers}, need a majority)")
        t_agreed = loop.time()
        pulled = await self._pull(key, shards, agreed, own, deadline)
        if isinstance(pulled, _Attempt):
            return replace(pulled, heard=frozenset(agreed))
        log.debug("%s round %d attempt %d: push %.3fs agree %.3fs pull %.3fs", self.peer_id, group.round,
                  key.attempt, t_pushed - t0, t_agreed - t_pushed, loop.time() - t_agreed)
        blobs, digests = pulled
        return _Attempt(reduction=Reduction(group, key, agreed, tuple(bounds), tuple(blobs), tuple(digests)))

    async def _pull(self, key: SessionKey, shards: list[tuple[Member, tuple[int, int]]], agreed: tuple[str, ...],
                    own: dict[int, Blob], deadline: float) -> tuple[list[Blob], list[str]] | _Attempt:
        """Every shard's material, checked: a mean the codec refuses (malformed, NaN or Inf) fails the attempt.

        Nothing model-sized is assembled: each shard is kept as its reducer sent it (a quarter of fp32 with
        int8). One encoded mean is checked by the codec from its payload (`Codec.validate`: block scales,
        wire values). A gathering round's mean is the members' contributions decoded and averaged: it is
        computed into one pooled scratch vector and looked at, the checks taking turns on the scratch, each
        in a thread off the event loop. Each shard's digest (what the round's value names it by) is taken in
        the same thread as it arrives, pipelined with the other fetches."""
        largest = max(hi - lo for _, (lo, hi) in shards)
        scratch_view: list[memoryview] = []
        scratch: list[torch.Tensor] = []
        turn = asyncio.Lock()
        blobs: dict[int, Blob] = {}
        digests: dict[int, str] = {}

        def check(j: int, parts: list[Blob], out: torch.Tensor) -> None:
            mean_of_gathered(self.codec, parts, out=out)
            if not _all_finite(out):
                raise CodecError(f"the mean of shard {j} holds NaN or Inf")

        def validated(blob: Blob, numel: int, digest: str) -> str:
            self.codec.validate(blob, numel=numel)
            return digest or blob_digest(blob)

        async def fetch_and_check(j: int, reducer: Member, lo: int, hi: int) -> None:
            try:
                got = await self._fetch(key, j, reducer, agreed, hi - lo, deadline)
            except (RpcError, Rejected, TimeoutError) as e:  # gone or refusing: another reducer stands in (standin.py)
                got = await self._from_stand_in(key, j, tuple(m for m, _ in shards), agreed, hi - lo, deadline, e)
            owned = got.data  # the transport's memory is ours: kept as it came, no copy
            if not self.gather:
                digests[j] = await asyncio.to_thread(validated, owned, hi - lo, got.digest)
                blobs[j] = owned
                self.registry.standins.keep_copy(key, j, agreed, owned)
                return
            parts: list[Blob] = list(unpack_bundle(owned, max_parts=len(agreed)))
            if self.peer_id in agreed:
                parts.insert(agreed.index(self.peer_id), own[j])
            if len(parts) != len(agreed):
                raise CodecError(f"bundle of shard {j} holds {len(parts)} contributions, {len(agreed)} agreed")
            async with turn:
                if not scratch and self.codec.device.type != "cpu":  # a GPU-resident round checks it there
                    scratch.append(torch.empty(largest, dtype=torch.float32, device=self.codec.device))
                elif not scratch:
                    scratch_view.append(self.buffers.take(4 * largest))
                    scratch.append(torch.frombuffer(scratch_view[0], dtype=torch.float32) if largest
                                   else torch.empty(0))
                await asyncio.to_thread(check, j, parts, scratch[0][:hi - lo])
            bundle = pack_bundle(parts)  # the whole bundle: identical on every member (the material)
            blobs[j] = bundle
            self.registry.standins.keep_copy(key, j, agreed, bundle)
            digests[j] = await asyncio.to_thread(blob_digest, blobs[j])

        pulls = await asyncio.gather(*(fetch_and_check(j, m, lo, hi) for j, (m, (lo, hi)) in enumerate(shards)),
                                     return_exceptions=True)
        scratch.clear()  # back to the pool now, unless an error's traceback still holds a slice (then freed later)
        with contextlib.suppress(BufferError):
            for view in scratch_view:
                self.buffers.give(view)
        reducers = tuple(m for m, _ in shards)
        if any(isinstance(r, CodecError) for r in pulls):
            return _Attempt(final=True, reason=f"a reducer sent an invalid mean: {_failures(reducers, pulls)}")
        failed = _failures(reducers, pulls)
        if failed:
            unreachable = _unreachable(reducers, pulls)
            return _Attempt(dead=unreachable, final=not unreachable, reason=f"mean unavailable from {failed}")
        return [blobs[j] for j in range(len(shards))], [digests[j] for j in range(len(shards))]

    async def _from_stand_in(self, key: SessionKey, shard: int, reducers: tuple[Member, ...], agreed: tuple[str, ...],
                             numel: int, deadline: float, lost: BaseException) -> Fetched:
        """Shard `shard` from the session's other reducers, in ring order after its own (the same order on every
        member, so that they all ask the same one first); re-raises `lost` when none can give it."""
        ring = [reducers[(shard + i) % len(reducers)] for i in range(1, len(reducers))]
        for stand_in in ring:
            if asyncio.get_running_loop().time() >= deadline:
                break
            try:
                got = await self._fetch(key, shard, stand_in, agreed, numel, deadline)
            except (RpcError, Rejected, TimeoutError) as e:
                log.info("%s: %s cannot stand in for shard %d of round %d: %s", self.peer_id, stand_in.peer_id, shard,
                         key.round, e)
                continue
            log.warning("%s: shard %d of round %d came from %s, standing in for %s (%s)", self.peer_id, shard,
                        key.round, stand_in.peer_id, reducers[shard].peer_id, lost)
            return got
        raise lost

    async def fetch_contribution(self, member: Member, key: SessionKey, shard: int, numel: int,
                                 deadline: float) -> Blob:
        """`member`'s own encoded shard `shard` of session `key` (a stand-in reducing it again): a fetch that names
        no contributors."""
        got = await self.transport.fetch(member, key, shard, (), max_bytes=max_encoded_bytes(numel),
                                         deadline=deadline)
        return got.data

    async def _push(self, key: SessionKey, shard: int, reducer: Member, payload: Blob, numel: int,
                    deadline: float) -> None:
        header = PushHeader(key, self.peer_id, shard, numel, len(payload), self.codec.name)
        try:
            await self.transport.push(reducer, header, payload, deadline=deadline)
        except (Rejected, RpcRejected) as e:
            log.warning("%s: reducer %s refused shard %d of round %d: %s", self.peer_id, reducer.peer_id, shard,
                        key.round, e)
        except (RpcTimeout, TimeoutError) as e:
            log.warning("%s: shard %d of round %d missed %s's window: %s", self.peer_id, shard, key.round,
                        reducer.peer_id, e)

    async def _fetch(self, key: SessionKey, shard: int, reducer: Member, agreed: tuple[str, ...], numel: int,
                     deadline: float) -> Fetched:
        parts = len(agreed) if self.gather else 1
        return await self.transport.fetch(reducer, key, shard, agreed,
                                          max_bytes=parts * (max_encoded_bytes(numel) + 8) + 8, deadline=deadline)


def _all_finite(t: torch.Tensor) -> bool:
    if not t.numel():
        return True
    return bool(torch.isfinite(torch.stack(list(torch.aminmax(t)))).all())


def _heard(answers: Sequence[object]) -> frozenset[str]:
    """The members named by any of the reducers' contributor sets that came back."""
    return frozenset(p for a in answers if isinstance(a, tuple) for p in a)


def _failures(reducers: tuple[Member, ...], results: Sequence[object]) -> list[str]:
    return [f"{m.peer_id} ({r})" for m, r in zip(reducers, results, strict=True) if isinstance(r, BaseException)]


def _unreachable(reducers: tuple[Member, ...], results: Sequence[object], *, timeouts: bool = True) -> set[str]:
    """Reducers whose call failed for want of an answer (not a refusal): candidates to retry without."""
    unexpected = [r for r in results if isinstance(r, BaseException)
                  and not isinstance(r, (RpcError, Rejected, TimeoutError))]
    if unexpected:
        raise unexpected[0]  # a bug, not a network fault: surface it
    kinds = (RpcUnavailable, RpcTimeout, TimeoutError) if timeouts else (RpcUnavailable,)
    return {m.peer_id for m, r in zip(reducers, results, strict=True) if isinstance(r, kinds)}

"""The member side of the fault-tolerant butterfly all-reduce; it applies the commit rule of round/rules.py.

One round, attempt a, reducers R_a (the group's non-client members minus those this member saw die):
  1. push: shard j of this member's encoded Δ streams to reducer j (shard sizes by bandwidth);
  2. agree: ask every reducer for its contributors S_j (fixed when its window closed) and take
     C = ∩ S_j in group order — every member that hears from all reducers computes the same C;
  3. quorum: C must hold >= min_peers members and more than half of the group, and more than half of
     the round's electorate E (the members of the commit that produced θ_global, which every member
     holding that θ_global knows alike), else abort;
  4. pull: fetch every shard's mean over C (computed once per C by its reducer), or with a sparse
     codec the contributions over C (a bundle less this member's own), averaged here in group order;
     each is kept encoded and checked (it decodes, to finite values) now, applied after the vote;
  5. vote: ask the round's voters V for their vote for this session, and commit with a strict majority.

Why every committed member holds the same mean: shard j's mean over C is a deterministic function
of (C, the members' encoded shards), computed by one reducer and fetched as bytes. Why a round
cannot commit twice with different means: every voter votes for one session per round (ballot.py),
and two strict majorities of V share a voter. V is the round's electorate E less the members known to
run in client mode (they serve no calls); before the first commit (E empty) it is the group's
reducers. Nothing here waits on a clock to be safe: a reducer that stalls after serving some means
only makes its session miss votes, and the next attempt without it gets them. A member that misses a
mean or a vote aborts (and heals by state transfer); it never keeps its local values as if averaged.
Unreachable reducers (refused, reset, deadline) trigger a new attempt without them; a refusal
(bad request, quorum lost) ends the round.

Why two sides of a partition cannot both commit round r: each side's contributors are disjoint, and
each must hold a strict majority of the same E (the members of round r − 1's commit): at most one can.
Peers that joined since are not in E; they count from the next round on. Before the first commit E is
empty and only the group rule applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from swarmtrain.averaging.aggregate import mean_of_gathered, unpack_bundle
from swarmtrain.averaging.group import Group, Member
from swarmtrain.averaging.protocol import AverageResult, Delta, MeanShard, ShardedMean, reader
from swarmtrain.averaging.reducer import ReducerRegistry, max_encoded_bytes, shard_bounds
from swarmtrain.compress import Codec, CodecError
from swarmtrain.config import AveragingConfig
from swarmtrain.round.rules import electorate_problem, has_quorum, vote_problem, voters
from swarmtrain.rpc.averaging_client import AveragingClient
from swarmtrain.rpc.averaging_wire import PushHeader, SessionKey
from swarmtrain.rpc.faults import Fault, FaultHook, FaultSite, corrupt, truncate
from swarmtrain.rpc.node import Rejected, RpcError, RpcNode, RpcRejected, RpcTimeout, RpcUnavailable

__all__ = ["AllReduce"]

log = logging.getLogger(__name__)


@dataclass
class _Attempt:
    committed: bool = False
    mean: ShardedMean | None = None
    contributors: tuple[str, ...] = ()
    dead: set[str] = field(default_factory=set)  # reducers that could not be reached
    final: bool = False  # no point retrying
    reason: str = ""


class AllReduce:
    """Runs one member's side of a round on the RpcNode's loop (see the module docstring)."""

    def __init__(self, node: RpcNode, registry: ReducerRegistry, *, codec: Codec, cfg: AveragingConfig,
                 fault_hook: FaultHook | None = None) -> None:
        self.node = node
        self.registry = registry
        self.client = AveragingClient(node)
        self.codec = codec
        self.cfg = cfg
        self.fault_hook = fault_hook
        self.peer_id = node.peer_id
        self.gather = registry.aggregation.gather

    async def run(self, group: Group, delta: Delta, *, deadline: float,
                  electorate: tuple[str, ...] = ()) -> AverageResult:
        """All attempts of one round until a commit, a final abort, or `deadline` (time.monotonic()).

        `electorate`: the members of the commit that produced this member's θ_global (module docstring)."""
        me = group.members[group.index_of(self.peer_id)]
        await self.registry.open_round(group, numel=delta.numel())
        dead: set[str] = set()
        outcome = _Attempt(reason="no attempt ran")
        for attempt in range(self.cfg.max_retries + 1):
            reducers = tuple(m for m in group.reducers if m.peer_id not in dead)
            if not reducers:
                outcome = _Attempt(dead=dead, reason="no live reducer left")
                break
            outcome = await self._attempt(group, me, attempt, reducers, delta, deadline, electorate)
            dead |= outcome.dead
            if outcome.committed or outcome.final or time.monotonic() >= deadline:
                break
            log.warning("%s: round %d attempt %d failed (%s); retrying without %s", self.peer_id, group.round,
                        attempt, outcome.reason, sorted(outcome.dead))
        if not outcome.committed:
            await self.registry.abandon_round(group)
        return _result(group, outcome, tuple(sorted(dead)))

    async def _attempt(self, group: Group, me: Member, attempt: int, reducers: tuple[Member, ...],
                       delta: Delta, deadline: float, electorate: tuple[str, ...]) -> _Attempt:
        key = SessionKey(group.run_id, group.round, group.group_id, attempt, tuple(m.peer_id for m in reducers))
        bounds = shard_bounds(delta.numel(), tuple(m.bandwidth_bytes_per_s for m in reducers),
                              align=self.codec.alignment)
        if not me.client_mode:
            await self.registry.open_session(key)
        t0 = time.monotonic()
        # a reducer closes its window `contribution_window_s` after it opened; one that has not answered
        # for contributors by twice that is hung (e.g. SIGSTOP), and the next attempt goes on without it
        window_s = self.cfg.contribution_window_s
        push_deadline = min(deadline, t0 + self.cfg.contribution_window_s)
        shards = list(zip(reducers, bounds, strict=True))
        own: dict[int, bytes] = {}  # this member's encoded shards: a gathering round adds them to the bundles

        read = reader(delta)

        async def encode_and_push(j: int, reducer: Member, lo: int, hi: int) -> None:
            # Pipelined per shard; read a piece at a time (a Δ given as a source is never whole in fp32).
            payload = await asyncio.to_thread(self.codec.encode_from, lambda a, b: read(lo + a, lo + b), hi - lo)
            own[j] = payload
            await self._push(key, j, reducer, payload, hi - lo, push_deadline)

        pushes = await asyncio.gather(*(encode_and_push(j, m, lo, hi) for j, (m, (lo, hi)) in enumerate(shards)),
                                      return_exceptions=True)
        dead = _unreachable(reducers, pushes, timeouts=False)  # a push timing out is late, not dead
        if dead:
            return _Attempt(dead=dead, reason=f"could not push to {sorted(dead)}")
        t_pushed = time.monotonic()
        agree_deadline = min(deadline, max(t0 + 2 * window_s, t_pushed + window_s))
        sets = await asyncio.gather(*(self._contributors(key, j, m, agree_deadline) for j, m in enumerate(reducers)),
                                    return_exceptions=True)
        failed = _failures(reducers, sets)
        if failed:
            return _Attempt(dead=_unreachable(reducers, sets), final=not _unreachable(reducers, sets),
                            reason=f"contributors unavailable from {failed}")
        agreed = tuple(m.peer_id for m in group.members if all(m.peer_id in s for s in sets))  # type: ignore[operator]
        if not has_quorum(len(agreed), group_size=len(group.members), min_peers=self.cfg.min_peers):
            return _Attempt(final=True, contributors=agreed,
                            reason=f"only {len(agreed)} of {len(group.members)} delivered (min_peers "
                                   f"{self.cfg.min_peers}, need a majority)")
        problem = electorate_problem(agreed, electorate)
        if problem:
            return _Attempt(final=True, contributors=agreed, reason=problem)
        t_agreed = time.monotonic()
        # Nothing model-sized is assembled: each shard's mean is kept as its reducer sent it (a quarter
        # of fp32 with int8), checked now so that a malformed or non-finite one is refused before the
        # vote, and decoded, shard by shard, when the commit is applied (ShardedMean). One encoded mean
        # is checked by the codec from its payload (`Codec.validate`: block scales, wire values). A
        # gathering round's mean is the members' contributions decoded and averaged: it is computed
        # once into one pooled scratch vector and looked at. Checks take turns on the scratch, each in
        # a thread off the event loop; it is taken at the first check, after a fetch, so that it can
        # reuse the block this peer's own reducer has just given back (the pool keeps blocks by size).
        largest = max(hi - lo for lo, hi in bounds)
        scratch_view: list[memoryview] = []  # given back below, before the vote
        scratch: list[torch.Tensor] = []
        turn = asyncio.Lock()
        kept: dict[int, MeanShard] = {}

        def decoder(j: int, data: bytes | bytearray) -> Callable[[torch.Tensor], None]:
            if not self.gather:
                return lambda out: self.codec.decode_accumulate(data, out.zero_())
            parts: list[bytes | bytearray | memoryview] = list(unpack_bundle(data, max_parts=len(agreed)))
            if self.peer_id in agreed:
                parts.insert(agreed.index(self.peer_id), own[j])
            if len(parts) != len(agreed):
                raise CodecError(f"bundle of shard {j} holds {len(parts)} contributions, {len(agreed)} agreed")
            return lambda out: mean_of_gathered(self.codec, parts, out=out)

        def check(j: int, decode: Callable[[torch.Tensor], None], out: torch.Tensor) -> None:
            decode(out)
            if not _all_finite(out):
                raise CodecError(f"the mean of shard {j} holds NaN or Inf")

        async def fetch_and_check(j: int, reducer: Member, lo: int, hi: int) -> None:
            data = await self._fetch(key, j, reducer, agreed, hi - lo, deadline)
            try:  # a pooled transport buffer goes back: keep a copy of the (encoded) bytes instead
                owned = bytearray(data) if isinstance(data, memoryview) else data
            finally:
                self.client.release(data)
            decode = decoder(j, owned)
            if not self.gather:  # one encoded mean: the codec tells from its payload, no decoded shard needed
                await asyncio.to_thread(self.codec.validate, owned, numel=hi - lo)
                kept[j] = MeanShard(lo, hi, decode, pieces=functools.partial(self.codec.decode_pieces, owned,
                                                                             numel=hi - lo))
                return
            async with turn:
                if not scratch:
                    scratch_view.append(self.node.buffers.take(4 * largest))
                    scratch.append(torch.frombuffer(scratch_view[0], dtype=torch.float32) if largest
                                   else torch.empty(0))
                await asyncio.to_thread(check, j, decode, scratch[0][:hi - lo])  # pipelined with the other fetches
            kept[j] = MeanShard(lo, hi, decode)

        pulls = await asyncio.gather(*(fetch_and_check(j, m, lo, hi) for j, (m, (lo, hi)) in enumerate(shards)),
                                     return_exceptions=True)
        scratch.clear()  # back to the pool now, unless an error's traceback still holds a slice (then freed later)
        with contextlib.suppress(BufferError):
            for view in scratch_view:
                self.node.buffers.give(view)
        if any(isinstance(r, CodecError) for r in pulls):
            return _Attempt(final=True, reason=f"a reducer sent an invalid mean: {_failures(reducers, pulls)}")
        failed = _failures(reducers, pulls)
        if failed:
            unreachable = _unreachable(reducers, pulls)
            return _Attempt(dead=unreachable, final=not unreachable, reason=f"mean unavailable from {failed}")
        mean = ShardedMean(delta.numel(), tuple(kept[j] for j in range(len(shards))))
        refusal = await self._ballot(key, group, electorate, deadline)
        if refusal:
            return _Attempt(final=True, contributors=agreed, reason=refusal)
        log.debug("%s round %d attempt %d: push %.3fs agree %.3fs pull %.3fs", self.peer_id, group.round, attempt,
                  t_pushed - t0, t_agreed - t_pushed, time.monotonic() - t_agreed)
        return _Attempt(committed=True, mean=mean, contributors=agreed)

    async def _ballot(self, key: SessionKey, group: Group, electorate: tuple[str, ...], deadline: float) -> str:
        """Ask the round's voters for their vote for session `key`; "" with a strict majority, else why not."""
        by_id = {m.peer_id: m for m in group.members}
        eligible = voters(electorate, reducers=[m.peer_id for m in group.reducers],
                          clients=[m.peer_id for m in group.members if m.client_mode])
        voting = [by_id[p] for p in eligible if p in by_id]  # the others are not here to ask
        vote_deadline = min(deadline, time.monotonic() + self.node.cfg.call_timeout_s)
        replies = await asyncio.gather(*(self._vote(key, m, vote_deadline) for m in voting), return_exceptions=True)
        bugs = [r for r in replies if isinstance(r, BaseException) and not isinstance(r, (RpcError, Rejected,
                                                                                          TimeoutError))]
        if bugs:
            raise bugs[0]  # not a network fault: surface it
        granted = [m.peer_id for m, r in zip(voting, replies, strict=True) if isinstance(r, tuple) and r[0]]
        elsewhere = sorted({r[1] for r in replies if isinstance(r, tuple) and not r[0] and r[1]})
        unanswered = [m.peer_id for m, r in zip(voting, replies, strict=True) if isinstance(r, BaseException)]
        return vote_problem(granted, eligible, elsewhere=elsewhere, unanswered=unanswered)

    async def _vote(self, key: SessionKey, voter: Member, deadline: float) -> tuple[bool, str]:
        if voter.peer_id == self.peer_id:
            return await self.registry.vote(key, peer=self.peer_id)
        return await self.client.vote(voter.endpoint, voter.peer_id, key, deadline=deadline)

    # -- the three calls, local when the reducer is this peer ------------------------------
    def _fault(self, round_index: int, call: str, target: str) -> Fault | None:
        return self.fault_hook(FaultSite(self.peer_id, round_index, call, target)) if self.fault_hook else None

    async def _push(self, key: SessionKey, shard: int, reducer: Member, payload: bytes, numel: int,
                    deadline: float) -> None:
        header = PushHeader(key, self.peer_id, shard, numel, len(payload), self.codec.name)
        fault = self._fault(key.round, "push", reducer.peer_id)
        if fault is not None:
            log.warning("%s: fault %s on push of shard %d to %s", self.peer_id, fault.action, shard, reducer.peer_id)
            if fault.action == "drop":
                return
            if fault.action == "delay":
                await asyncio.sleep(fault.delay_s)
            payload = corrupt(payload) if fault.action == "corrupt" else payload
            payload = truncate(payload) if fault.action == "truncate" else payload
        try:
            if reducer.peer_id == self.peer_id:
                await self.registry.check_push(header, peer=self.peer_id)
                if len(payload) != header.total_bytes:
                    raise Rejected(f"truncated push: got {len(payload)} of {header.total_bytes} bytes")
                await self.registry.accept_push(header, payload, peer=self.peer_id)
            else:
                await self.client.push(reducer.endpoint, reducer.peer_id, header, payload, deadline=deadline)
        except (Rejected, RpcRejected) as e:
            log.warning("%s: reducer %s refused shard %d of round %d: %s", self.peer_id, reducer.peer_id, shard,
                        key.round, e)
        except RpcTimeout as e:
            log.warning("%s: shard %d of round %d missed %s's window: %s", self.peer_id, shard, key.round,
                        reducer.peer_id, e)

    async def _contributors(self, key: SessionKey, shard: int, reducer: Member, deadline: float) -> tuple[str, ...]:
        if reducer.peer_id == self.peer_id:
            return await asyncio.wait_for(self.registry.contributors(key, shard, peer=self.peer_id),
                                          timeout=max(deadline - time.monotonic(), 1e-3))
        return await self.client.contributors(reducer.endpoint, reducer.peer_id, key, shard, deadline=deadline)

    async def _fetch(self, key: SessionKey, shard: int, reducer: Member, agreed: tuple[str, ...], numel: int,
                     deadline: float) -> bytes | bytearray | memoryview:
        if reducer.peer_id == self.peer_id:
            data = await self.registry.mean(key, shard, agreed, peer=self.peer_id)
            await self.registry.delivered(key, shard, peer=self.peer_id)
            return data
        parts = len(agreed) if self.gather else 1
        return await self.client.fetch(reducer.endpoint, reducer.peer_id, key, shard, agreed,
                                       max_bytes=parts * (max_encoded_bytes(numel) + 8) + 8, deadline=deadline)


def _all_finite(t: torch.Tensor) -> bool:
    if not t.numel():
        return True
    return bool(torch.isfinite(torch.stack(list(torch.aminmax(t)))).all())


def _failures(reducers: tuple[Member, ...], results: list[object]) -> list[str]:
    return [f"{m.peer_id} ({r})" for m, r in zip(reducers, results, strict=True) if isinstance(r, BaseException)]


def _unreachable(reducers: tuple[Member, ...], results: list[object], *, timeouts: bool = True) -> set[str]:
    """Reducers whose call failed for want of an answer (not a refusal): candidates to retry without."""
    unexpected = [r for r in results if isinstance(r, BaseException)
                  and not isinstance(r, (RpcError, Rejected, TimeoutError))]
    if unexpected:
        raise unexpected[0]  # a bug, not a network fault: surface it
    kinds = (RpcUnavailable, RpcTimeout, TimeoutError) if timeouts else (RpcUnavailable,)
    return {m.peer_id for m, r in zip(reducers, results, strict=True) if isinstance(r, kinds)}


def _result(group: Group, outcome: _Attempt, dead: tuple[str, ...]) -> AverageResult:
    members = tuple(m.peer_id for m in group.members)
    failed = tuple(p for p in members if p not in outcome.contributors) if outcome.committed else tuple(dead)
    if outcome.committed:
        reason = f"worked around {list(failed)}" if failed else ""
        log.info("round %d committed with %d/%d contributors%s", group.round, len(outcome.contributors),
                 len(members), f"; failed: {list(failed)}" if failed else "")
        by_id = {m.peer_id: m for m in group.members}
        return AverageResult(group.round, True, outcome.mean, outcome.contributors, reason=reason, failed=failed,
                             steps_per_s=tuple(by_id[p].steps_per_s for p in outcome.contributors),
                             lags_s=tuple(by_id[p].lag_s for p in outcome.contributors))
    log.warning("round %d aborted: %s%s", group.round, outcome.reason, f"; unreachable: {list(dead)}" if dead else "")
    return AverageResult(group.round, False, None, members, reason=outcome.reason, failed=failed)

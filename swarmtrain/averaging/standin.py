"""Standing in for a reducer that died mid-round: its shard is moved again, not the whole attempt.

A member that cannot fetch shard j's mean from its reducer R_j (unreachable, or gone while it waited) asks
the session's other reducers for it, in ring order after R_j (the same order on every member, so they all
ask the same stand-in first). A stand-in answers with:

* the copy of shard j it fetched itself, when it holds one over the same contributors: every member's copy
  of a shard is the same bytes (the mean R_j encoded once, or the bundle of the contributions), so whoever
  missed R_j ends with the material the others hold;
* else shard j reduced again: it asks each contributor for its own encoded shard j (which every member keeps
  until its round is forgotten, and serves to the session's reducers only), checks each as a reducer checks a
  push, and computes the mean as R_j did (decoded in fp32, summed in group order, divided, encoded once) or,
  with a gathering codec, serves the contributions less the caller's own. Only shard j crosses the network
  again, once per contributor; the attempt, its contributors and every other shard stand.

What keeps the round to one mean is still its decision (deciding.py): a stand-in that computed other bytes
(a stochastically rounded codec, or a lying stand-in) gives its askers another value, which the vote settles
like any other. A contributor that cannot be reached (a client-mode member, R_j itself when it contributed,
or one that died too) leaves shard j without a reduction again: with no copy held anywhere (R_j died before
any member fetched its shard) the member's attempt fails as before, a retry without R_j.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from swarmtrain.averaging.aggregate import Aggregation, encoded_aggregate, pack_bundle, unpack_bundle
from swarmtrain.compress import Codec, CodecError
from swarmtrain.round.group import Group, Member
from swarmtrain.rpc.averaging_wire import SessionKey
from swarmtrain.rpc.buffers import BufferPool
from swarmtrain.rpc.errors import RpcError
from swarmtrain.rpc.node import Rejected

__all__ = ["ContributionSource", "StandIns"]

log = logging.getLogger(__name__)

Blob = bytes | bytearray | memoryview  # a memoryview is its holder's memory (lent pool memory goes back by itself)
MAX_SETS_PER_SHARD = 4  # contributor sets one shard is reduced again over (honest members all ask for one)
# How a stand-in fetches a member's own encoded shard: (member, key, shard, numel, loop-clock deadline) -> bytes.
ContributionSource = Callable[[Member, SessionKey, int, int, float], Awaitable[Blob]]


@dataclass
class _Copy:
    contributors: tuple[str, ...]
    blob: Blob  # the member's material of the shard (a gathered one: the bundle of every contribution)


class StandIns:
    """What this peer keeps of its rounds to stand in for a dead reducer, and the stand-in itself (see the
    module docstring). Lives on the RpcNode's loop, beside the ReducerRegistry that routes calls here."""

    def __init__(self, *, peer_id: str, codec: Codec, aggregation: Aggregation, buffers: BufferPool,
                 timeout_s: float) -> None:
        self.peer_id = peer_id
        self.codec = codec
        self.aggregation = aggregation
        self.buffers = buffers
        self.timeout_s = timeout_s  # the longest a stand-in waits for the contributions it reduces again
        # Set once the transport exists (it needs the registry that holds this): fetches a contribution.
        self.fetch_contribution: ContributionSource | None = None
        self._own: dict[str, tuple[int, dict[int, Blob]]] = {}  # session id -> (round, shard -> own encoded)
        self._copies: dict[tuple[str, int], _Copy] = {}
        self._rounds: dict[str, int] = {}  # session id -> round (of the copies and reductions kept)
        self._reduced: dict[tuple[str, int, tuple[str, ...]], Blob | list[Blob]] = {}
        self._locks: dict[tuple[str, int, tuple[str, ...]], asyncio.Lock] = {}

    # -- what a member keeps ----------------------------------------------------------------
    def keep_own(self, key: SessionKey, shard: int, payload: Blob) -> None:
        """This member's encoded shard `shard` of session `key` (served to the session's reducers)."""
        self._own.setdefault(key.session_id, (key.round, {}))[1][shard] = payload

    def keep_copy(self, key: SessionKey, shard: int, contributors: tuple[str, ...], blob: Blob) -> None:
        """The material of shard `shard` this member fetched over `contributors` (served to members that missed
        its reducer)."""
        self._copies[(key.session_id, shard)] = _Copy(contributors, blob)
        self._rounds[key.session_id] = key.round

    def forget_before(self, round_index: int) -> None:
        for sid in [s for s, (r, _) in self._own.items() if r < round_index]:
            del self._own[sid]
        stale = {s for s, r in self._rounds.items() if r < round_index}
        for shard_key in [k for k in self._copies if k[0] in stale]:
            del self._copies[shard_key]
        for set_key in [k for k in self._reduced if k[0] in stale]:
            del self._reduced[set_key]
        for set_key in [k for k in self._locks if k[0] in stale and not self._locks[k].locked()]:
            del self._locks[set_key]
        for sid in stale:
            del self._rounds[sid]

    def own_contribution(self, key: SessionKey, shard: int, *, caller: str) -> Blob:
        """This member's encoded shard for a reducer of `key` that reduces it again."""
        if caller not in key.reducers:
            raise Rejected(f"{caller} is not a reducer of this session: a member's own shard goes to its reducers")
        held = self._own.get(key.session_id)
        if held is None or shard not in held[1]:
            raise Rejected(f"no own shard {shard} of round {key.round} attempt {key.attempt} here", kind="not_found")
        if 0 <= shard < len(key.reducers) and key.reducers[shard] == caller != self.peer_id:
            # the shard's own reducer asking whether this member is still there (reducer.py): it is, and is
            # pushing the shard to it (kept here once encoded, just before the push): not sent twice
            raise Rejected(f"{self.peer_id} is pushing shard {shard} to {caller}", kind="precondition")
        return held[1][shard]

    # -- the stand-in -----------------------------------------------------------------------
    async def serve(self, key: SessionKey, shard: int, contributors: tuple[str, ...], *, caller: str, group: Group,
                    numel: int) -> Blob:
        """Shard `shard`'s mean (or bundle) over `contributors`, for `caller`, which missed its reducer."""
        order = [m.peer_id for m in group.members]
        wanted = frozenset(contributors)
        if (len(wanted) != len(contributors) or not wanted <= set(order)
                or [p for p in order if p in wanted] != list(contributors)):
            raise Rejected(f"contributors {list(contributors)} are not members of the group in group order",
                           kind="invalid")
        copy = self._copies.get((key.session_id, shard))
        if copy is not None and copy.contributors == contributors:
            log.info("%s stands in for shard %d of round %d attempt %d: serving its copy to %s", self.peer_id, shard,
                     key.round, key.attempt, caller)
            return self._for(caller, contributors, copy.blob, bundled=True)
        reduced = await self._reduce_again(key, shard, contributors, group=group, numel=numel)
        log.info("%s stands in for shard %d of round %d attempt %d: reduced again for %s", self.peer_id, shard,
                 key.round, key.attempt, caller)
        if isinstance(reduced, list):  # gathered: the contributions, less the caller's own
            return pack_bundle([p for p, c in zip(reduced, contributors, strict=True) if c != caller])
        return reduced

    def _for(self, caller: str, contributors: tuple[str, ...], blob: Blob, *, bundled: bool) -> Blob:
        if not (bundled and self.aggregation.gather):
            return blob
        parts = unpack_bundle(blob, max_parts=len(contributors))
        return pack_bundle([p for p, c in zip(parts, contributors, strict=True) if c != caller])

    async def _reduce_again(self, key: SessionKey, shard: int, contributors: tuple[str, ...], *, group: Group,
                            numel: int) -> Blob | list[Blob]:
        k = (key.session_id, shard, contributors)
        lock = self._locks.setdefault(k, asyncio.Lock())
        async with lock:
            done = self._reduced.get(k)
            if done is not None:
                return done
            if sum(1 for x in self._reduced if x[:2] == k[:2]) >= MAX_SETS_PER_SHARD:
                raise Rejected(f"shard {shard} was already reduced again over {MAX_SETS_PER_SHARD} contributor sets",
                               kind="too_large")
            deadline = asyncio.get_running_loop().time() + self.timeout_s
            by_id = {m.peer_id: m for m in group.members}
            # The shard's own reducer is the one that was lost: when it contributed, its contribution is asked
            # for first, and alone. It is usually gone with it, and then no stand-in without a copy can help:
            # refusing at once spares the other contributors' uploads, and the member, which asks stand-in after
            # stand-in, a wait for all of them per stand-in (about 1.5 s each in a loaded group of 16).
            lost = key.reducers[shard] if 0 <= shard < len(key.reducers) else None
            held: dict[str, Blob | BaseException] = {}
            if lost in contributors and lost != self.peer_id:  # contributors are group members (checked in serve)
                try:
                    held[lost] = await self._contribution(key, shard, by_id[lost], numel, deadline)
                except (RpcError, Rejected, CodecError, TimeoutError) as e:
                    raise Rejected(f"cannot reduce shard {shard} again: {lost}: {e}", kind="aborted") from e
            rest = [c for c in contributors if c not in held]
            held.update(zip(rest, await asyncio.gather(*(self._contribution(key, shard, by_id[c], numel, deadline)
                                                         for c in rest), return_exceptions=True), strict=True))
            got = [held[c] for c in contributors]
            failed = {c: r for c, r in zip(contributors, got, strict=True) if isinstance(r, BaseException)}
            unexpected = [r for r in failed.values() if not isinstance(r, (RpcError, Rejected, CodecError,
                                                                           TimeoutError))]
            if unexpected:
                raise unexpected[0]
            if failed:
                raise Rejected(f"cannot reduce shard {shard} again: " + "; ".join(
                    f"{c}: {r}" for c, r in failed.items()), kind="aborted")
            parts: list[Blob] = [g for g in got if not isinstance(g, BaseException)]
            result: Blob | list[Blob]
            if self.aggregation.gather:
                result = parts
            else:
                result = await encoded_aggregate(self.codec, parts, self.aggregation, numel=numel,
                                                 buffers=self.buffers)
            self._reduced[k] = result
            self._rounds[key.session_id] = key.round
            return result

    async def _contribution(self, key: SessionKey, shard: int, member: Member, numel: int, deadline: float) -> Blob:
        if member.peer_id == self.peer_id:
            data: Blob = bytes(self.own_contribution(key, shard, caller=self.peer_id))
        else:
            if self.fetch_contribution is None:
                raise Rejected("this peer cannot fetch contributions", kind="aborted")
            data = await self.fetch_contribution(member, key, shard, numel, deadline)
        await asyncio.to_thread(self.codec.validate, data, numel=numel)  # as a reducer checks a push
        return data

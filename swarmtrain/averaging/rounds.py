"""One peer's round of one scope, end to end on the data plane: the all-reduce to the material, then the
decision among the round's voters (propose, or learn what they chose), ending in an `AverageResult` whose
commit carries the round's certificate. The peer daemon's network plane and the simulation tester both run
this same code; only the transports differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import blake3

from swarmtrain.averaging.allreduce import AllReduce, Reduction
from swarmtrain.averaging.deciding import Chosen, Decider, Known, NotChosen, Outcome, Prepared
from swarmtrain.averaging.material import Material, MaterialStore, layout_key, layout_of, sharded_mean
from swarmtrain.averaging.voting import VoterService
from swarmtrain.compress import Codec
from swarmtrain.diloco.averager import AverageResult, Delta, ShardedMean
from swarmtrain.round.ballots import Value, Voter, session_ballot
from swarmtrain.round.certificate import Retirement
from swarmtrain.round.committee import committee
from swarmtrain.round.group import Group
from swarmtrain.round.messages import Contact
from swarmtrain.rpc.averaging_wire import SessionKey

__all__ = ["Electorate", "Preview", "RoundAverager", "result_of"]

log = logging.getLogger(__name__)

Preview = Callable[[ShardedMean, tuple[Voter, ...]], Awaitable[str]]
"""The digest of the state this part's outer step with a mean would commit, with the given next voters."""


@dataclass(frozen=True)
class Electorate:
    """Who decides a round: its voters V(r), the verified retirements this peer knows of, where to reach them."""

    voters: tuple[Voter, ...]
    retired: Mapping[Voter, Retirement] = field(default_factory=dict)
    contacts: Mapping[str, Contact] = field(default_factory=dict)

    def with_contacts(self, extra: Mapping[str, Contact]) -> Electorate:
        return Electorate(self.voters, self.retired, {**extra, **self.contacts})


class RoundAverager:
    """See the module docstring; one per scope and peer, on the loop that serves the data plane."""

    def __init__(self, *, allreduce: AllReduce, voter: VoterService, decider: Decider, materials: MaterialStore,
                 codec: Codec, scope: str, decision_timeout_s: float) -> None:
        self.allreduce = allreduce
        self.voter = voter
        self.decider = decider
        self.materials = materials
        self.codec = codec
        self.scope = scope
        self.decision_timeout_s = decision_timeout_s

    async def average(self, group: Group, delta: Delta, *, base: str, electorate: Electorate, deadline: float,
                      preview: Preview | None) -> AverageResult:
        """Round `group.round`: the all-reduce with `group`, then the decision; `base` is the digest of the
        committed state this peer's Δ was taken from (its group's members all hold it), `preview` what the
        outer step with a mean makes of it (the value's `result`). Without one (a caller holding no state of
        its own, the facade) the result names the material itself."""
        members = {m.peer_id: Contact(m.peer_id, m.endpoint) for m in group.members if m.endpoint}
        electorate = electorate.with_contacts(members)
        prepares: dict[str, asyncio.Task[Prepared]] = {}
        sessions: list[str] = []

        def on_session(key: SessionKey) -> None:
            sessions.append(key.session_id)
            self.voter.expect_pull(key.session_id)
            ballot = session_ballot(group.attempt, key.attempt, key.session_id)
            prepares[key.session_id] = asyncio.ensure_future(self.decider.prepare(
                round_index=group.round, ballot=ballot, voters=electorate.voters, contacts=electorate.contacts,
                retired=electorate.retired, timeout_s=self.decision_timeout_s))

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            reduction = await self.allreduce.run(group, delta, deadline=deadline, on_session=on_session)
            t_reduced = loop.time()
            outcome: Outcome = NotChosen(reduction.reason)
            if reduction.ok and reduction.key is not None:
                value, material = self._value(group, reduction, base=base)
                result = (material_result(value) if preview is None
                          else await preview(sharded_mean(material, self.codec), value.next_voters))
                value = dataclasses.replace(value, result=result)
                self.materials.put(group.round, material)
                self.voter.pulled(reduction.key.session_id)
                t_valued = loop.time()
                prepared = await prepares[reduction.key.session_id]
                t_prepared = loop.time()
                # The decision has its own time: an all-reduce that took its whole deadline (a retry around a
                # dead reducer) still gets its means decided.
                outcome = await self.decider.propose(prepared, value=value, voters=electorate.voters,
                                                     contacts=electorate.contacts, timeout_s=self.decision_timeout_s)
                log.debug("round %d: all-reduce %.3fs, value %.3fs, promises %.3fs more, decision %.3fs",
                          group.round, t_reduced - t0, t_valued - t_reduced, t_prepared - t_valued,
                          loop.time() - t_prepared)
        finally:
            for sid in sessions:
                self.voter.pulled(sid)
            for task in prepares.values():
                task.cancel()
            for task in prepares.values():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if not isinstance(outcome, Chosen):
            # Held the material but the round did not choose it (yet): the next attempt's group must find this
            # peer's reducer open for it, not bound to this group.
            await self.allreduce.registry.abandon_round(group)
            why = outcome.reason
            learned = await self.learn(group.round, electorate, others=list(members.values()),
                                       timeout_s=self.decision_timeout_s)
            outcome = learned if isinstance(learned, Chosen | Known) else NotChosen(why)
        return result_of(group.round, outcome, self.codec, failed=reduction.failed,
                         steps={m.peer_id: (m.steps_per_s, m.lag_s) for m in group.members},
                         group=tuple(m.peer_id for m in group.members))

    def _value(self, group: Group, reduction: Reduction, *, base: str) -> tuple[Value, Material]:
        assert reduction.key is not None
        layout = layout_of(reduction.blobs, reduction.bounds, numel=reduction.bounds[-1][1], codec=self.codec.name,
                           gather=self.allreduce.gather, digests=reduction.digests)
        by_id = {m.peer_id: m for m in group.members}
        serving = tuple(Voter(p, by_id[p].incarnation) for p in reduction.contributors if not by_id[p].client_mode)
        next_voters = committee(serving, size=self.allreduce.cfg.max_voters, seed=reduction.key.session_id)
        value = Value(self.scope, group.round, reduction.key.session_id, base, reduction.contributors, next_voters,
                      layout, result="0" * 64)
        return value, Material(layout, list(reduction.blobs))

    async def learn(self, round_index: int, electorate: Electorate, *, others: Sequence[Contact] = (),
                    timeout_s: float) -> Outcome:
        """What round `round_index` chose, from its voters and `others`, with the material when it can be had."""
        if not electorate.voters:
            return NotChosen(f"round {round_index} has no known voters to learn from")
        return await self.decider.learn(round_index=round_index, voters=electorate.voters,
                                        contacts=electorate.contacts, retired=electorate.retired,
                                        timeout_s=timeout_s, others=others)


def result_of(round_index: int, outcome: Outcome, codec: Codec, *, failed: tuple[str, ...] = (),
              steps: Mapping[str, tuple[float, float]] | None = None, group: tuple[str, ...] = ()) -> AverageResult:
    """The AverageResult of a decision: a commit carries the certificate and the mean of its material, and names
    as failed the members of this peer's `group` the value leaves out (for an abort: the unreachable reducers)."""
    if isinstance(outcome, Chosen):
        value = outcome.certificate.value
        steps = steps or {}
        members = value.contributors
        contributed = frozenset(members)
        left = tuple(p for p in group if p not in contributed)
        return AverageResult(round_index, True, sharded_mean(outcome.material, codec), members,
                             reason=f"worked around {list(left)}" if left else "", failed=left,
                             steps_per_s=tuple(steps.get(p, (0.0, 0.0))[0] for p in members),
                             lags_s=tuple(steps.get(p, (0.0, 0.0))[1] for p in members),
                             certificate=outcome.certificate)
    if isinstance(outcome, Known):
        return AverageResult(round_index, False, None, reason=outcome.reason, failed=failed,
                             known=outcome.certificate)
    return AverageResult(round_index, False, None, reason=outcome.reason, failed=failed)


def material_result(value: Value) -> str:
    """A value's `result` for callers without a state of their own: a digest of its round, next voters and
    material (its shards' digests), as long as a state digest."""
    h = blake3.blake3(b"swarmtrain/material-result\0")
    h.update(f"{value.round}|{[tuple(v) for v in value.next_voters]}|{layout_key(value.layout)}".encode())
    return h.hexdigest()

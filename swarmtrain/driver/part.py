"""What the round driver drives: a *part* (the whole model of a DiLoCo worker, one stage of a pipeline, a
pipeline's embeddings and head) with its committed state, and the network plane its rounds go through.

A part owns θ_global, its outer optimizer and θ_local (its inner steps); the driver owns when to train,
average, heal and wait (the round machine's decisions) and everything the swarm's consensus needs: the
round's voters, their retirements, the certificates. Both are protocols: the worker, the pipeline's parts
and the simulation tester's part implement the first, the network and the simulated planes the second.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from swarmtrain.averaging.matchmaking import MatchOutcome
from swarmtrain.averaging.rounds import Electorate, Preview
from swarmtrain.diloco.averager import AverageResult, Delta, ShardedMean
from swarmtrain.round.ballots import Voter
from swarmtrain.round.certificate import Certificate, Retirement
from swarmtrain.round.group import Member
from swarmtrain.round.messages import Contact

__all__ = ["CommittedState", "Part", "RoundPlane", "Trained"]


@dataclass(frozen=True)
class CommittedState:
    """A part's committed state after `round` committed rounds: what a joiner downloads and a heal installs.

    `digest` covers (round, θ_global, outer momentum, voters) (diloco.flat.state_digest); `certificates` are
    the newest rounds' certificates the holder keeps, so that a peer behind can check the state back to
    voters it knows."""

    round: int
    theta_global: torch.Tensor  # (numel,) fp32
    outer_momentum: torch.Tensor | None  # (numel,) fp32; None when outer.momentum is 0
    voters: tuple[Voter, ...] = ()  # V(round): who decides the next round (empty: the scope's genesis)
    digest: str = ""
    certificates: tuple[Certificate, ...] = ()
    version: int = 0  # changes with every change of θ_global (a part's own counter)


@dataclass
class Trained:
    """One round's trained Δ, not committed yet: averaged again, never retrained, after an aborted attempt."""

    round: int
    delta: Delta
    loss: float
    compute_s: float
    steps: int
    steps_per_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.steps_per_s = self.steps / self.compute_s if self.steps and self.compute_s > 0 else 0.0


class Part(Protocol):
    """A part's side of its rounds. `round`, `digest` and `voters` are of the committed state."""

    @property
    def round(self) -> int: ...

    @property
    def digest(self) -> str: ...

    @property
    def voters(self) -> tuple[Voter, ...]: ...

    async def train(self, stop: asyncio.Event) -> Trained | None:
        """The round's inner steps and Δ; None when `stop` came first."""
        ...

    async def delta_problem(self, trained: Trained) -> str:
        """Why Δ must not be sent (NaN or Inf), "" when it may."""
        ...

    async def preview(self, mean: ShardedMean, next_voters: tuple[Voter, ...]) -> str:
        """The digest of the state the outer step with `mean` would commit (next round, `next_voters`), the
        committed state unchanged: what a round's value names as its result."""
        ...

    async def apply(self, result: AverageResult, *, own: Trained | None, comm_s: float = 0.0) -> None:
        """A committed round: the outer step with its mean, round + 1, the next voters (its certificate's value).
        `own` is this part's Δ when it is among the value's contributors; `comm_s` how long the round took
        since it was trained."""
        ...

    async def adopt(self, state: CommittedState, *, keep_progress: bool = False) -> None:
        """A heal: install a verified committed state (θ_local restarts from it, or with `keep_progress` keeps
        the steps not yet sent on top of it)."""
        ...

    async def resync(self, reason: str) -> None:
        """A fault of the part's own (a NaN Δ, a local error): θ_local restarts from θ_global."""
        ...

    def replay_from(self) -> int:
        """The oldest round this part could restart at (its oldest checkpoint kept; its round without any): the
        voter keeps the votes and material of every round since, for a restart to learn them."""
        ...

    def joined(self, round_index: int, round_ends_at: float | None) -> None:
        """A heal put the part at `round_index`, which the swarm may be training already: its peers expect their
        steps of it to end at `round_ends_at` (swarm clock; None: nobody said). A part that paces its own steps
        ends them then, and so reaches the round's matchmaking with the others."""
        ...

    async def report(self, trained: Trained | None, result: AverageResult, *, comm_s: float) -> None:
        """After an attempt: one round line (and, after a commit, evaluation and a checkpoint on schedule)."""
        ...

    def committed(self) -> AbstractContextManager[CommittedState]:
        """The committed state with the part's own tensors, held still while the context is entered."""
        ...


class RoundPlane(Protocol):
    """The network side of a part's rounds (one scope): matchmaking, the all-reduce and decision, learning,
    state transfer, and the voter this peer runs in the scope."""

    @property
    def scope(self) -> str: ...

    @property
    def endpoint(self) -> str: ...

    @property
    def incarnation(self) -> int:
        """Of this peer's voter in the scope (what its match entries announce)."""
        ...

    async def match(self, round_index: int, member: Member) -> MatchOutcome: ...

    async def average(self, outcome: MatchOutcome, delta: Delta, *, base: str, electorate: Electorate,
                      preview: Preview) -> AverageResult:
        """Round `outcome.round`'s all-reduce with `outcome.group`, then its decision."""
        ...

    async def certificates(self, peer: Contact, *, from_round: int) -> tuple[Certificate, ...]:
        """The certificates `peer` keeps of rounds >= `from_round` (none when it cannot be reached)."""
        ...

    async def learn(self, round_index: int, electorate: Electorate, *, others: Sequence[Contact]) -> AverageResult:
        """What round `round_index` chose, as a result to apply (committed) when its material could be had."""
        ...

    async def fetch_state(self, endpoints: Sequence[str]) -> tuple[CommittedState, tuple[str, ...]]:
        """A donor's committed state (from several at once where given), checked for shape and finiteness."""
        ...

    async def advanced(self, round_index: int, *, keep_from: int | None = None) -> None:
        """The part's committed state reached `round_index`: the voter forgets what is far behind, but nothing
        from `keep_from` on (the part's `replay_from()`)."""
        ...

    async def keep_certificate(self, cert: Certificate) -> None:
        """A certificate of a round this part committed, kept to show learners and peers behind."""
        ...

    async def retire(self, current_round: int, *, successors: Sequence[Voter] = ()) -> list[Retirement]:
        """This peer's voter leaves the scope for good, naming `successors` for its round when it is the round's
        last voter (round/certificate.py `successors_of`); every retirement it stored (its departure record)."""
        ...

    def retirements(self) -> list[Retirement]:
        """Every retirement this peer's voter in the scope has stored (this run's or an earlier one's)."""
        ...

    def serve_state(self, live: Callable[[], AbstractContextManager[CommittedState]]) -> None: ...

    async def aclose(self) -> None: ...


def contacts_of(records: Sequence[object]) -> dict[str, Contact]:
    """Peer id -> Contact of every record with an endpoint (PeerRecord-like objects)."""
    return {r.peer_id: Contact(r.peer_id, r.endpoint) for r in records  # type: ignore[attr-defined]
            if getattr(r, "endpoint", "")}


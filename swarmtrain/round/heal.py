"""The heal decision, as pure functions of the live peers' records: whom to download θ_global from,
what a healed peer keeps, and when it should end the round it joins.

A peer heals when live workers announce a newer round than its own (the swarm committed rounds
without it), or when its round's group announced another θ_global hash than its own (its θ_global
went astray): then peers at its own round holding that hash are donors too, and what they serve
must hash to it.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["HealPlan", "PeerView", "keeps_progress", "plan_heal", "swarm_round_end"]


class PeerView(Protocol):
    """What the heal decision reads of a peer record (discovery.PeerRecord has these fields)."""

    @property
    def peer_id(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def round(self) -> int: ...
    @property
    def state_hash(self) -> str: ...
    @property
    def round_ends_at(self) -> float: ...


@dataclass(frozen=True)
class HealPlan:
    """Download round `round` from the first of `donors` that delivers; `round_ends_at` (swarm clock,
    None when unknown) is when the donors expect their inner steps of that round to end."""

    round: int
    donors: tuple[PeerView, ...]
    round_ends_at: float | None


def plan_heal(peers: Sequence[PeerView], *, own_round: int, self_id: str, want_hash: str = "") -> HealPlan | None:
    """Whether and from whom to heal (None: nobody is ahead, nothing to do).

    Donors are the serving workers at the newest round announced, ordered by a hash of (this peer,
    donor) so that joiners spread over donors instead of all asking the smallest id."""
    ahead = [p for p in peers if p.peer_id != self_id and p.role == "worker" and p.endpoint
             and (p.round > own_round or (want_hash and p.round == own_round and p.state_hash == want_hash))]
    if not ahead:
        return None
    newest = max(p.round for p in ahead)
    donors = sorted((p for p in ahead if p.round == newest),
                    key=lambda p: hashlib.sha256(f"{self_id}|{p.peer_id}".encode()).digest())
    return HealPlan(round=newest, donors=tuple(donors), round_ends_at=swarm_round_end(ahead, newest))


def keeps_progress(*, own_round: int, donor_round: int, keep_progress_rounds: int, want_hash: str) -> bool:
    """Whether a heal keeps θ_local's unsent inner steps on top of the donor's θ_global (overlap mode,
    at most `keep_progress_rounds` rounds late). Never after a hash mismatch: those steps were taken
    from a θ_global the swarm does not hold. A peer that does not keep them also drops its
    error-feedback residual and restarts from the donor's θ_global; its AdamW moments stay (they
    describe the loss surface near θ, which the heal moves by at most a few outer steps)."""
    return not want_hash and donor_round - own_round <= keep_progress_rounds


def swarm_round_end(peers: Sequence[PeerView], round_index: int) -> float | None:
    """When the live peers at `round_index` expect their inner steps of it to end (swarm clock; the
    median, so one peer's absurd estimate moves nothing), or None when none of them said.

    A peer that heals into a round the others are already training stops its own steps then, so it
    reaches the round's matchmaking with them instead of a span later, when the round has closed.
    """
    ends = [p.round_ends_at for p in peers if p.round == round_index and p.round_ends_at > 0]
    return statistics.median(ends) if ends else None

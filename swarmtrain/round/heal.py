"""The heal decision, as pure functions of the live peers' records: whom to download θ_global from,
what a healed peer keeps, and when it should end the round it joins.

A peer heals when live workers announce a newer round than its own (the swarm committed rounds
without it), or when its round's group announced another θ_global hash than its own (its θ_global
went astray): then peers at its own round holding that hash are donors too.

What it adopts is never one donor's word: the (round, θ hash) must be announced by a strict majority
of the serving workers ahead of it (or, after a hash mismatch, be its group's), and the download must
hash to it. A key holder announcing a round or a θ of its own is outvoted and, if asked, refused.
"""

from __future__ import annotations

import hashlib
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

__all__ = ["HealPlan", "PeerView", "donor_order", "keeps_progress", "majority_state", "plan_heal", "swarm_round_end"]


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


P = TypeVar("P", bound=PeerView)


@dataclass(frozen=True)
class HealPlan:
    """Download round `round`, whose θ_global must hash to `state_hash`, from the first of `donors` that
    delivers it; `round_ends_at` (swarm clock, None when unknown) is when the donors expect their inner
    steps of that round to end. No donors: peers are ahead but agree on no state (`problem` says why)."""

    round: int
    state_hash: str
    donors: tuple[PeerView, ...]
    round_ends_at: float | None
    problem: str = ""


def majority_state(peers: Sequence[PeerView]) -> tuple[int, str] | None:
    """The (round, θ hash) that a strict majority of `peers` announce, or None (a split, a transition
    between rounds, or peers announcing states the others do not hold). Peers without a hash vouch
    for nothing but still count."""
    support = Counter((p.round, p.state_hash) for p in peers if p.state_hash)
    if not support:
        return None
    (best, count), = support.most_common(1)
    return best if 2 * count > len(peers) else None


def plan_heal(peers: Sequence[PeerView], *, own_round: int, self_id: str, want_hash: str = "",
              min_support: int = 1, role: str = "worker") -> HealPlan | None:
    """Whether and from whom to heal (None: nobody is ahead, nothing to do).

    The state is the one a strict majority of the serving peers of `role` ahead announce, and at least
    `min_support` of them (a round commits with at least `averaging.min_peers` members, who all announce
    it; fewer when fewer serving peers are live): one peer far ahead of everyone is believed only when it is
    the only one there is. With `want_hash` (this peer's group announced another state than its own) and no
    such state ahead, the state at this peer's round that a strict majority of the serving peers at that
    round announce, by the same rule: a plurality, or the smallest id's hash, is never enough (identities
    can be made up to win either). Donors are the peers announcing it, ordered by a hash of (this peer,
    donor) so that joiners spread over donors instead of all asking the smallest id."""
    serving = [p for p in peers if p.peer_id != self_id and p.role == role and p.endpoint]
    ahead = [p for p in serving if p.round > own_round]
    need = min(min_support, len(serving))
    target = _supported(ahead, need)
    if target is None and want_hash:
        level = _supported([p for p in serving if p.round == own_round], need)
        target = level if level == (own_round, want_hash) else None
    if target is None:
        if not ahead:
            return None
        rounds = sorted({p.round for p in ahead})
        return HealPlan(round=max(rounds), state_hash="", donors=(), round_ends_at=None,
                        problem=f"the {len(ahead)} peers ahead (rounds {rounds[0]}..{rounds[-1]}) announce no "
                                f"(round, state digest) a strict majority of them, and at least {need} of the "
                                f"{len(serving)} live peers, agree on")
    donors = donor_order(self_id, [p for p in serving if (p.round, p.state_hash) == target])
    return HealPlan(round=target[0], state_hash=target[1], donors=tuple(donors),
                    round_ends_at=swarm_round_end(serving, target[0]),
                    problem="" if donors else f"no serving peer announces round {target[0]} with the group's state")


def donor_order(self_id: str, donors: Sequence[P]) -> tuple[P, ...]:
    """`donors` in the order this peer asks them: a hash of (this peer, donor), so that joiners spread over the
    donors instead of all asking the smallest id."""
    return tuple(sorted(donors, key=lambda p: hashlib.sha256(f"{self_id}|{p.peer_id}".encode()).digest()))


def _supported(peers: Sequence[PeerView], need: int) -> tuple[int, str] | None:
    """The (round, digest) a strict majority of `peers`, and at least `need` of them, announce."""
    target = majority_state(peers) if peers else None
    if target is None or sum((p.round, p.state_hash) == target for p in peers) < need:
        return None
    return target


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

"""A round's voters drawn from the contributors of the commit before it: at most `size` of them, ranked by a hash
of the session and each voter, so that every member that builds the session's value names the same ones.

Which voters a round has does not bear on its safety (any fixed set that the committed state names will do: the
decision is single-decree Paxos among them, docs/protocol.md#the-rounds-decision), only on its cost and liveness:
a proposer asks every voter for a promise and an acceptance, and a certificate holds a quorum's signed grants, so
voters by the hundred make every member send and check hundreds of messages a round. A committee of 32 keeps that
bounded, and losing a majority of 32 voters within one round takes far more than a few per cent of churn. The
rank depends on the session (known only once the round's group is), so a peer cannot pick an identity that
is drawn every round.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TypeVar

from swarmtrain.round.ballots import Voter

__all__ = ["committee", "drawn"]

T = TypeVar("T")


def drawn(items: Sequence[T], *, size: int, seed: str, name: Callable[[T], str]) -> tuple[T, ...]:
    """`items` when they are at most `size` (or `size` is 0), else the `size` of them whose `name` hashed with
    `seed` ranks lowest, in their given order: the same on every peer that knows `items` and `seed`, and, with
    some of `items` left out, the next-ranked one in each one's place."""
    if size < 0:
        raise ValueError(f"drawn: size must be >= 0, got {size}")
    if size == 0 or len(items) <= size:
        return tuple(items)

    def rank(i: int) -> bytes:
        return hashlib.sha256(f"{seed}\0{name(items[i])}".encode()).digest()

    chosen = set(sorted(range(len(items)), key=rank)[:size])
    return tuple(item for i, item in enumerate(items) if i in chosen)


def committee(voters: Sequence[Voter], *, size: int, seed: str) -> tuple[Voter, ...]:
    """`voters` when they are at most `size` (or `size` is 0), else the `size` of them whose hash with `seed`
    ranks lowest, in their given order."""
    return drawn(voters, size=size, seed=seed, name=lambda v: f"{v.peer_id}\0{v.incarnation}")

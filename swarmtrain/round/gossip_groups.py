"""Gossip groups: who averages with whom in a round, computed by every peer alone from the round and the
roster (the live peers it reads), without a message.

The round's order of the roster is its peers sorted by BLAKE3(seed, round, peer id): a permutation that
is fresh every round, the same on every peer that reads the same roster, and the same in any language.
Consecutive runs of `size` peers of that order form the groups; the r = len % size peers left at the end
join the first r groups, one each (so a roster of 5 in pairs gives groups of 3, 2). A peer that is not in
the roster it read (its own record not yet visible) counts itself in. A roster of one is a group of one.

When two peers read different rosters (a record that has just expired or appeared), each uses its own
groups; the exchange is one-sided (a peer fetches its partners' parts), so a partner in this peer's group
whose own group differs still serves its part: the round is then asymmetric, never blocked.
"""

from __future__ import annotations

from collections.abc import Iterable

import blake3

__all__ = ["gossip_groups", "gossip_partners"]


def _order(roster: Iterable[str], *, round_index: int, seed: int) -> list[str]:
    def key(peer: str) -> bytes:
        return blake3.blake3(f"swarmtrain gossip\0{seed}\0{round_index}\0{peer}".encode()).digest()

    return sorted(set(roster), key=lambda p: (key(p), p))


def gossip_groups(roster: Iterable[str], *, round_index: int, size: int, seed: int = 0) -> list[tuple[str, ...]]:
    """The round's groups of `roster` (each a tuple in the round's order)."""
    if size < 2:
        raise ValueError(f"a gossip group has at least 2 peers, got size {size}")
    if round_index < 0:
        raise ValueError(f"round must be >= 0, got {round_index}")
    order = _order(roster, round_index=round_index, seed=seed)
    if len(order) <= size:
        return [tuple(order)] if order else []
    count = len(order) // size
    groups = [order[k * size:(k + 1) * size] for k in range(count)]
    for k, peer in enumerate(order[count * size:]):
        groups[k].append(peer)
    return [tuple(g) for g in groups]


def gossip_partners(roster: Iterable[str], self_id: str, *, round_index: int, size: int,
                    seed: int = 0) -> tuple[str, ...]:
    """The peers `self_id` averages with in `round_index` (itself counted into the roster)."""
    peers = set(roster) | {self_id}
    for group in gossip_groups(peers, round_index=round_index, size=size, seed=seed):
        if self_id in group:
            return tuple(p for p in group if p != self_id)
    raise AssertionError("every peer of the roster is in one group")

"""The group's rule for an all-reduce's material: which contributor sets are worth proposing.

An all-reduce holds the means of its contributors C (the members whose Δ every reducer holds). C is worth
proposing as a round's value only when it is at least `averaging.min_peers` and more than half of the group:
a mean of a few stragglers is a poor outer step. This rule is about quality, not safety: whether a value is
chosen is the decision among the round's voters (round/ballots.py, docs/protocol.md#the-decision), which
no contributor set can bypass.
"""

from __future__ import annotations

__all__ = ["has_quorum"]


def has_quorum(num_contributors: int, *, group_size: int, min_peers: int) -> bool:
    """The group's rule: at least `min_peers` and more than half of the group delivered."""
    return num_contributors >= min_peers and 2 * num_contributors > group_size

"""The commit rule of a round, as pure functions: who may commit it, and with how many votes.

A round commits on a member only if all three hold (the all-reduce in averaging/allreduce.py checks
them in this order and aborts at the first that fails):

1. group quorum: the contributors C (members whose Δ every reducer holds) are at least `min_peers`
   and more than half of the group;
2. electorate quorum: C holds more than half of the round's electorate E, the members of the commit
   that produced θ_global less those that announced their departure (empty before the first commit);
3. votes: more than half of the round's eligible voters (E less client-mode peers; the group's
   reducers when E is empty) granted their one vote of the round to this session.

Why two sides of a partition cannot both commit round r: their contributors are disjoint and each
side needs a strict majority of the same E. Why one round cannot commit two different means: two
strict majorities of the voters share a voter, and a voter grants one session per round.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["electorate_problem", "has_quorum", "vote_problem", "voters"]


def has_quorum(num_contributors: int, *, group_size: int, min_peers: int) -> bool:
    """The group's commit rule: at least `min_peers` and more than half of the group delivered."""
    return num_contributors >= min_peers and 2 * num_contributors > group_size


def electorate_problem(contributors: Sequence[str], electorate: Sequence[str]) -> str:
    """Why `contributors` may not commit a round whose electorate is `electorate` ("" when they may):
    they must include a strict majority of it (an empty electorate, before the first commit, allows any)."""
    if not electorate:
        return ""
    present = len(set(contributors) & set(electorate))
    if 2 * present > len(set(electorate)):
        return ""
    return (f"only {present} of the {len(set(electorate))} peers of the previous commit took part; a commit needs "
            f"more than half of them (a partition, or more than half of them gone at once)")


def voters(electorate: Sequence[str], *, reducers: Sequence[str], clients: Sequence[str]) -> tuple[str, ...]:
    """The round's eligible voters: the electorate less client-mode peers (they serve no calls), or
    the group's reducers before the first commit (empty electorate)."""
    if not electorate:
        return tuple(dict.fromkeys(reducers))
    excluded = set(clients)
    return tuple(p for p in dict.fromkeys(electorate) if p not in excluded)


def vote_problem(granted: Sequence[str], eligible: Sequence[str], *, elsewhere: Sequence[str] = (),
                 unanswered: Sequence[str] = ()) -> str:
    """"" when `granted` is a strict majority of `eligible`, else why the session may not commit."""
    if 2 * len(set(granted) & set(eligible)) > len(set(eligible)):
        return ""
    return (f"only {len(set(granted) & set(eligible))} of {len(set(eligible))} votes (a commit needs more than half)"
            + (f"; votes went to other attempts of the round: {sorted(elsewhere)}" if elsewhere else "")
            + (f"; no answer from {list(unanswered)}" if unanswered else ""))

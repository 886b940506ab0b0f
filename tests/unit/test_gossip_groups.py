"""The gossip pairing rule: every peer computes the same groups from the same roster, fresh each round,
and a stated outcome when rosters differ."""

from __future__ import annotations

import random

import pytest

from swarmtrain.round.gossip_groups import gossip_groups, gossip_partners

pytestmark = pytest.mark.unit

ROSTER = [f"peer-{i:02d}" for i in range(9)]


def test_the_same_roster_gives_the_same_groups_in_any_order() -> None:
    shuffled = ROSTER[:]
    random.Random(1).shuffle(shuffled)
    for r in range(20):
        assert gossip_groups(ROSTER, round_index=r, size=2, seed=7) == gossip_groups(shuffled, round_index=r, size=2,
                                                                                     seed=7)
        for peer in ROSTER:  # each peer, alone, finds the partners the others find for it
            partners = gossip_partners(shuffled, peer, round_index=r, size=2, seed=7)
            for other in partners:
                assert peer in gossip_partners(ROSTER, other, round_index=r, size=2, seed=7)


@pytest.mark.parametrize(("n", "size", "sizes"), [(9, 2, [3, 2, 2, 2]), (8, 2, [2, 2, 2, 2]), (7, 3, [4, 3]),
                                                  (3, 2, [3]), (2, 4, [2]), (1, 2, [1]), (0, 2, [])])
def test_every_peer_is_in_one_group_and_the_rest_join_the_first_groups(n: int, size: int, sizes: list[int]) -> None:
    groups = gossip_groups(ROSTER[:n], round_index=3, size=size)
    assert [len(g) for g in groups] == sizes
    members = [p for g in groups for p in g]
    assert sorted(members) == sorted(ROSTER[:n])


def test_pairs_change_from_round_to_round_and_with_the_seed() -> None:
    pairs = {tuple(gossip_groups(ROSTER[:8], round_index=r, size=2)) for r in range(10)}
    assert len(pairs) == 10
    assert gossip_groups(ROSTER[:8], round_index=0, size=2, seed=1) != gossip_groups(ROSTER[:8], round_index=0,
                                                                                     size=2, seed=2)
    # over many rounds every peer meets many others (mixing), not one fixed partner
    met = {p: set() for p in ROSTER[:8]}
    for r in range(50):
        for group in gossip_groups(ROSTER[:8], round_index=r, size=2):
            for p in group:
                met[p] |= set(group) - {p}
    assert all(len(m) == 7 for m in met.values())


def test_a_peer_missing_from_its_own_read_counts_itself_in() -> None:
    assert gossip_partners(["a"], "b", round_index=0, size=2) == ("a",)
    assert gossip_partners([], "b", round_index=0, size=2) == ()


def test_rosters_that_differ_give_each_peer_partners_from_its_own_view() -> None:
    # c's record expired in a's view only: a pairs within {a, b, d}; b and d still see c. Each peer's
    # partners are drawn from its own roster (the exchange is one-sided: a fetches its partners' parts
    # whatever group they computed for themselves).
    full, partial = ["a", "b", "c", "d"], ["a", "b", "d"]
    for r in range(30):
        mine = gossip_partners(partial, "a", round_index=r, size=2)
        assert mine and set(mine) <= {"b", "d"}
        assert "c" not in mine
        theirs = gossip_partners(full, "a", round_index=r, size=2)
        assert len(theirs) == 1


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        gossip_groups(ROSTER, round_index=0, size=1)
    with pytest.raises(ValueError, match="round"):
        gossip_groups(ROSTER, round_index=-1, size=2)

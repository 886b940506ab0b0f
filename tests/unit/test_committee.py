"""A round's voters drawn from a commit's contributors (round/committee.py): bounded, the same for every member
that builds the session's value, in the contributors' order."""

from __future__ import annotations

import pytest

from swarmtrain.config import ConfigError, load_config
from swarmtrain.discovery.coordinator import next_genesis
from swarmtrain.discovery.records import PeerRecord
from swarmtrain.round.ballots import Voter
from swarmtrain.round.committee import committee

VOTERS = tuple(Voter(f"peer-{i:03d}", i % 3) for i in range(100))


def test_a_large_set_is_cut_to_the_size_the_same_way_for_the_same_session() -> None:
    a = committee(VOTERS, size=32, seed="session-1")
    assert len(a) == 32 and len(set(a)) == 32 and set(a) <= set(VOTERS)
    assert committee(list(reversed(VOTERS)), size=32, seed="session-1") == tuple(reversed(a))  # same set, any order
    assert list(a) == [v for v in VOTERS if v in set(a)]  # kept in the contributors' order
    b = committee(VOTERS, size=32, seed="session-2")
    assert set(a) != set(b)  # another session draws others: no identity is a voter every round


def test_small_sets_and_size_zero_keep_every_voter() -> None:
    assert committee(VOTERS[:5], size=32, seed="s") == VOTERS[:5]
    assert committee(VOTERS[:32], size=32, seed="s") == VOTERS[:32]
    assert committee(VOTERS, size=0, seed="s") == VOTERS
    with pytest.raises(ValueError, match="size"):
        committee(VOTERS, size=-1, seed="s")


def test_the_incarnation_takes_part_in_the_rank() -> None:
    one = [Voter("a", 0), Voter("b", 0), Voter("c", 0), Voter("d", 0)]
    draws = {committee([*one[:3], Voter("d", i)], size=2, seed="s") for i in range(20)}
    assert len(draws) > 1


def test_a_run_refuses_a_negative_max_voters_by_name() -> None:
    with pytest.raises(ConfigError, match=r"averaging\.max_voters"):
        load_config(overrides=["averaging.max_voters=-1"])


def test_the_genesis_is_cut_to_max_voters_too() -> None:
    peers = [PeerRecord(run_id="r", peer_id=f"p{i:02d}", endpoint=f"10.0.0.{i}:7000", heartbeat_at=0.0)
             for i in range(10)]
    whole = next_genesis(peers, {}, min_peers=2)
    cut = next_genesis(peers, {}, min_peers=2, max_voters=3, run_nonce="n")
    assert len(whole[""].voters) == 10
    assert len(cut[""].voters) == 3 and set(cut[""].voters) <= set(whole[""].voters)


def test_a_draw_keeps_the_given_order_and_puts_the_next_in_rank_in_a_left_out_one_s_place() -> None:
    from swarmtrain.round.committee import drawn

    items = [f"p{i:02d}" for i in range(20)]
    four = drawn(items, size=4, seed="s", name=str)
    assert len(four) == 4 and list(four) == [i for i in items if i in four]  # a subset, in the given order
    assert drawn(items, size=4, seed="s", name=str) == four and drawn(items, size=4, seed="t", name=str) != four
    assert drawn(items, size=0, seed="s", name=str) == tuple(items) == drawn(items, size=20, seed="s", name=str)
    five = drawn(items, size=5, seed="s", name=str)
    without = drawn([i for i in items if i != four[0]], size=4, seed="s", name=str)
    assert set(without) == set(five) - {four[0]}  # the fifth in rank took the left-out one's place
    with pytest.raises(ValueError, match="size"):
        drawn(items, size=-1, seed="s", name=str)

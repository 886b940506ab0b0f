"""VoteBook: one vote per round, kept across restarts, forgotten rounds refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmtrain.averaging.ballot import VoteBook, VoteBookError

pytestmark = pytest.mark.unit


def test_a_round_gets_one_vote_and_repeats_of_it_are_granted_again() -> None:
    book = VoteBook()
    assert book.vote(3, "s1") == (True, "s1")
    assert book.vote(3, "s1") == (True, "s1")  # the same session asking again (a retried call)
    assert book.vote(3, "s2") == (False, "s1")
    assert book.vote(4, "s2") == (True, "s2")


def test_votes_survive_a_restart_and_forgotten_rounds_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "votes.json"
    book = VoteBook(path)
    assert book.vote(5, "a")[0] and book.vote(6, "b")[0]
    again = VoteBook(path)  # the peer restarted from its checkpoint directory
    assert again.vote(5, "c") == (False, "a")
    again.forget_before(6)
    assert again.vote(5, "a") == (False, "")
    assert VoteBook(path).vote(6, "c") == (False, "b")
    assert VoteBook(path).vote(4, "x") == (False, "")


def test_an_unreadable_book_stops_the_peer_instead_of_voting_twice(tmp_path: Path) -> None:
    path = tmp_path / "votes.json"
    path.write_text("{not json")
    with pytest.raises(VoteBookError, match="unreadable vote book"):
        VoteBook(path)
    path.write_text('{"floor": -1, "votes": {}}')
    with pytest.raises(VoteBookError, match="malformed"):
        VoteBook(path)


def test_a_vote_that_cannot_be_recorded_is_not_granted(tmp_path: Path) -> None:
    book = VoteBook(tmp_path / "gone" / "votes.json")  # its directory does not exist
    assert book.vote(1, "s") == (False, "")
    assert VoteBook().vote(1, "s") == (True, "s")

"""Where a peer reaches the others (driver/contacts.py): every endpoint read, not only the last read's."""

from __future__ import annotations

import pytest

from swarmtrain.driver.contacts import ContactBook
from swarmtrain.round.messages import Contact


def test_a_peer_missing_from_the_last_read_is_still_reachable_and_a_newer_record_wins() -> None:
    book = ContactBook()
    book.remember([Contact("a", "10.0.0.1:7000"), Contact("b", "10.0.0.2:7000")])
    book.remember([Contact("a", "10.0.0.9:7000")])  # a read that came back without b, and a's new address
    assert book.all() == {"a": Contact("a", "10.0.0.9:7000"), "b": Contact("b", "10.0.0.2:7000")}


def test_the_book_is_bounded_and_forgets_the_least_recently_seen() -> None:
    book = ContactBook(limit=3)
    book.remember([Contact(p, f"{p}:1") for p in "abc"])
    book.remember([Contact("a", "a:1")])  # seen again: now the most recent
    book.remember([Contact("d", "d:1")])
    assert sorted(book.all()) == ["a", "c", "d"] and len(book) == 3
    with pytest.raises(ValueError, match="limit"):
        ContactBook(limit=0)

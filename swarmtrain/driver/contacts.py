"""Where to reach the scope's peers: every endpoint this peer has read in their records, not only the last read's.

A DHT read of a key with many subkeys can come back without some of them (a node holding part of the key did not
answer in time: on a loaded swarm of 24 peers, a proposer found 5 of its 9 voters without an endpoint, and the
round could not be decided). A voter's endpoint rarely changes, so one seen in an earlier read is kept; a newer
record replaces it, and one that is stale only fails as an unknown one would. Bounded: the least recently seen go
first.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from swarmtrain.round.messages import Contact

__all__ = ["MAX_CONTACTS", "ContactBook"]

MAX_CONTACTS = 4096


class ContactBook:
    """Peer id -> its latest known Contact, at most `limit` of them."""

    def __init__(self, *, limit: int = MAX_CONTACTS) -> None:
        if limit < 1:
            raise ValueError(f"ContactBook: limit must be >= 1, got {limit}")
        self.limit = limit
        self._contacts: collections.OrderedDict[str, Contact] = collections.OrderedDict()

    def remember(self, contacts: Iterable[Contact]) -> None:
        for c in contacts:
            self._contacts[c.peer_id] = c
            self._contacts.move_to_end(c.peer_id)
        while len(self._contacts) > self.limit:
            self._contacts.popitem(last=False)

    def all(self) -> dict[str, Contact]:
        return dict(self._contacts)

    def __len__(self) -> int:
        return len(self._contacts)

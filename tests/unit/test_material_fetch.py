"""Completing a value's material from its holders (averaging/fetching.py): the missing shards at once, a bounded
number at a time, spread over the holders, each checked; a holder that failed is asked last for the other shards;
a shard no holder serves fails the fetch."""

from __future__ import annotations

import asyncio

import pytest

from swarmtrain.averaging.fetching import FETCHES_AT_ONCE, MaterialFetcher
from swarmtrain.averaging.material import Material, MaterialError, MaterialStore, layout_of
from swarmtrain.round.ballots import MaterialLayout
from swarmtrain.round.messages import Contact
from swarmtrain.rpc.errors import RpcTimeout, RpcUnavailable

pytestmark = pytest.mark.unit

SHARDS = 20
BLOBS = [bytes([j]) * 8 for j in range(SHARDS)]
LAYOUT = layout_of(BLOBS, [(2 * j, 2 * j + 2) for j in range(SHARDS)], numel=2 * SHARDS, codec="fp32", gather=False)
HOLDERS = [Contact(f"h{i}", f"10.0.0.{i}:7000") for i in range(3)]


class Holders:
    """Serves the material's shards after a short wait, counting the calls in flight; `refuse` shards nobody has."""

    def __init__(self, *, refuse: frozenset[int] = frozenset(), stopped: str = "") -> None:
        self.refuse = refuse
        self.stopped = stopped  # a holder that answers nothing: each call to it times out
        self.in_flight = 0
        self.most = 0
        self.asked: dict[str, int] = {h.peer_id: 0 for h in HOLDERS}

    async def material(self, to: Contact, *, scope: str, layout: MaterialLayout, shard: int,
                       timeout_s: float) -> bytes:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        self.asked[to.peer_id] += 1
        try:
            if to.peer_id == self.stopped:
                await asyncio.sleep(0.2)
                raise RpcTimeout(f"DEADLINE_EXCEEDED: {to.endpoint} did not answer")
            await asyncio.sleep(0.01)
            if shard in self.refuse:
                raise RpcUnavailable(f"UNAVAILABLE: {to.endpoint} has no shard {shard}")
            return BLOBS[shard]
        finally:
            self.in_flight -= 1


def _fetcher(transport: Holders, store: MaterialStore) -> MaterialFetcher:
    return MaterialFetcher(transport=transport, store=store, scope="", self_id="me",  # type: ignore[arg-type]
                           check=lambda *_: None, max_bytes=1 << 20)


def test_the_missing_shards_are_fetched_at_once_spread_over_the_holders() -> None:
    holders = Holders()
    store = MaterialStore()
    held = Material(LAYOUT)
    held.put(3, BLOBS[3])  # one shard held already: not fetched again
    store.put(1, held)
    got = asyncio.run(_fetcher(holders, store).complete(1, LAYOUT, HOLDERS, timeout_s=10.0))
    assert got.complete and [bytes(b) for b in got.blobs] == BLOBS  # type: ignore[arg-type]
    assert sum(holders.asked.values()) == SHARDS - 1
    assert holders.most == FETCHES_AT_ONCE, holders.most  # several at a time, never more than the bound
    assert all(n >= (SHARDS - 1) // len(HOLDERS) for n in holders.asked.values()), holders.asked


def test_a_holder_that_does_not_answer_is_asked_last_for_the_other_shards() -> None:
    holders = Holders(stopped="h0")
    got = asyncio.run(_fetcher(holders, MaterialStore()).complete(1, LAYOUT, HOLDERS, timeout_s=10.0))
    assert got.complete and [bytes(b) for b in got.blobs] == BLOBS  # type: ignore[arg-type]
    # Only the shards that asked h0 first before its first call timed out (shards 0, 3 and 6 of the first 8 under
    # way) waited for it; every later shard that starts at h0 asks the others first, and one of them serves it.
    assert holders.asked["h0"] == 3, holders.asked


def test_a_shard_no_holder_serves_fails_the_fetch_and_leaves_nothing_running() -> None:
    holders = Holders(refuse=frozenset({5}))
    store = MaterialStore()
    with pytest.raises(MaterialError, match="shard 5 of the value: no holder served it"):
        asyncio.run(_fetcher(holders, store).complete(1, LAYOUT, HOLDERS, timeout_s=10.0))
    assert holders.in_flight == 0
    assert store.get(LAYOUT) is None  # nothing half-fetched is kept as if whole

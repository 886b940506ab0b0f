"""Which slot a checkpoint's worker state was reading (`swarmtrain.peer.data.saved_slot`)."""

from __future__ import annotations

import pytest

from swarmtrain.peer.data import saved_slot

pytestmark = pytest.mark.unit


def _meta(worker_index: object, num_workers: object) -> dict[str, object]:
    return {"data": {"worker_index": worker_index, "num_workers": num_workers, "position": 7}}


@pytest.mark.parametrize("meta, num_shards, expected", [
    (_meta(2, 4), 4, 2),
    (_meta(0, 4), 4, 0),
    (_meta(2, 4), 3, None),   # saved in a run with another shard count: the resume refuses it, naming why
    (_meta(0, 1), 0, None),   # an unsharded run
    (_meta(5, 4), 4, None),   # out of range: not a slot of this run
    (_meta("1", 4), 4, None),
    ({"data": None}, 4, None),  # a stream that keeps no state
    (None, 4, None),            # no checkpoint
    ({}, 4, None),
])
def test_saved_slot(meta: dict[str, object] | None, num_shards: int, expected: int | None) -> None:
    assert saved_slot(meta, num_shards=num_shards) == expected

"""BufferPool: exact-size views over reused blocks, bounded idle memory, never reusing memory still in use."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.averaging.reducer import _aliases
from swarmtrain.rpc.buffers import BufferPool

pytestmark = pytest.mark.unit

MB = 1 << 20


def test_a_returned_block_serves_the_next_request_of_its_size_class() -> None:
    pool = BufferPool()
    first = pool.take(5 * MB + 3)
    assert first.nbytes == 5 * MB + 3 and not first.readonly
    block = first.obj
    pool.give(first)
    assert pool.idle_bytes == 6 * MB  # rounded up to a whole MiB
    again = pool.take(5 * MB + 100)  # same class: same memory, exact length
    assert again.obj is block and again.nbytes == 5 * MB + 100 and pool.idle_bytes == 0
    other = pool.take(2 * MB)  # another class: fresh memory
    assert other.obj is not block


def test_small_requests_are_not_pooled() -> None:
    pool = BufferPool()
    view = pool.take(1000)
    assert view.nbytes == 1000
    pool.give(view)
    assert pool.idle_bytes == 0


def test_idle_memory_is_bounded_oldest_first() -> None:
    pool = BufferPool(max_bytes=3 * MB)
    views = [pool.take(MB) for _ in range(4)]
    blocks = [v.obj for v in views]
    for v in views:
        pool.give(v)
    assert pool.idle_bytes == 3 * MB
    kept = {id(pool.take(MB).obj) for _ in range(3)}
    assert kept == {id(b) for b in blocks[1:]}  # the first one returned was dropped


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="size"):
        BufferPool().take(-1)
    with pytest.raises(ValueError, match="max_bytes"):
        BufferPool(max_bytes=-1)


def test_the_reducer_never_keeps_a_view_of_a_pooled_payload() -> None:
    """The pool reuses a push's buffer once the reducer accepted it: a codec that decodes to a view of
    its input must be copied."""
    payload = BufferPool().take(4 * MB)
    inside = torch.frombuffer(payload, dtype=torch.float32, count=16, offset=64)
    assert _aliases(inside, payload)
    assert not _aliases(inside.clone(), payload)
    assert not _aliases(torch.zeros(4), payload)

"""BufferPool: exact-size views over reused blocks, bounded idle memory, never reusing memory still in use."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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


def test_lent_memory_comes_back_once_the_last_tensor_over_it_is_gone() -> None:
    pool = BufferPool()
    mean = torch.from_numpy(pool.lend(4 * MB)).view(torch.float32)
    half = mean[: MB // 2]  # a view keeps the memory alive after the tensor itself is dropped
    block_ptr = mean.data_ptr()
    del mean
    assert pool.take(4 * MB).obj is not None and pool.idle_bytes == 0  # still lent: a fresh block
    half.fill_(1.0)
    del half
    again = pool.take(4 * MB)  # the lent block is back
    assert torch.frombuffer(again, dtype=torch.uint8, count=1).data_ptr() == block_ptr


def test_release_idle_frees_every_idle_block_and_keeps_lent_ones_working() -> None:
    pool = BufferPool()
    kept = pool.take(2 * MB)
    idle = pool.take(3 * MB)
    pool.give(idle)
    lent = pool.lend(MB)
    del lent  # returned through the finalizer queue
    assert pool.release_idle() == 3 * MB + MB
    assert pool.idle_bytes == 0
    kept[:4] = b"abcd"  # a block still taken is untouched
    pool.give(kept)
    assert pool.idle_bytes == 2 * MB


def test_threads_taking_giving_and_dropping_lent_memory_never_share_a_block() -> None:
    """Codec threads frame into lent memory while the loop takes and gives receive buffers: no block is ever
    handed to two holders at once (a lent block comes back only once its last reference is gone), and the pool
    still serves afterwards."""
    import threading

    pool = BufferPool(max_bytes=64 * MB)
    owners: dict[int, int] = {}
    clash: list[str] = []
    guard = threading.Lock()

    def work(worker: int) -> None:
        for i in range(200):
            view = pool.take(MB) if i % 2 else pool.lent(MB)
            block = np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]  # where its memory is
            with guard:
                if block in owners:
                    clash.append(f"worker {worker} got the block worker {owners[block]} holds")
                owners[block] = worker
            view[:8] = worker.to_bytes(8, "little")
            with guard:
                del owners[block]
            if i % 2:
                pool.give(view)
            else:
                del view  # a lent block comes back when its last reference goes

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not clash and not any(t.is_alive() for t in threads)
    assert pool.idle_bytes <= 64 * MB and pool.take(MB).nbytes == MB

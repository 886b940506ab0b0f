"""trim_heap: the C heap's free memory goes back to the OS where glibc can do it, and nothing breaks elsewhere."""

from __future__ import annotations

import platform

import pytest

from swarmtrain.peer.heap import round_heap, steps_heap, trim_heap

pytestmark = pytest.mark.unit


def test_trim_heap_runs_where_glibc_has_malloc_trim_and_is_a_no_op_elsewhere() -> None:
    blocks = [bytearray(64 << 10) for _ in range(256)]  # 16 MiB in heap-sized blocks, then freed
    del blocks
    on_glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert trim_heap() is on_glibc


def test_round_and_steps_set_glibcs_thresholds_and_allocation_goes_on() -> None:
    on_glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    try:
        assert round_heap() is on_glibc
        blocks = [bytearray(5 << 20) for _ in range(4)]  # above the round's threshold: mapped on their own
        assert all(len(b) == 5 << 20 for b in blocks)
        del blocks
    finally:
        assert steps_heap() is on_glibc  # this test process goes on with the inner steps' setting

"""Bytes a real swarm would send per peer for one all-reduce (what `simulate` reports)."""

from __future__ import annotations

__all__ = ["allreduce_bytes_per_peer"]


def allreduce_bytes_per_peer(*, contribution_bytes: int, result_bytes: int, num_peers: int) -> int:
    """Bytes one peer sends in a butterfly (reduce-scatter + all-gather) or ring all-reduce.

    Each of K peers reduces 1/K of the vector: it sends the other K−1 shards of its own encoded
    contribution out ((K−1)/K · contribution_bytes) and its reduced shard of the (re-encoded) mean
    to the K−1 others ((K−1)/K · result_bytes), ≈ 2(K−1)/K × the encoded size. A ring all-reduce of
    fp32 gradients (the data-parallel baseline) sends the same 2(K−1)/K × 4 bytes per element.
    Per-shard headers are ignored (they are a few dozen bytes against megabytes).
    """
    if num_peers < 1:
        raise ValueError(f"num_peers must be >= 1, got {num_peers}")
    if contribution_bytes < 0 or result_bytes < 0:
        raise ValueError("contribution_bytes and result_bytes must be >= 0")
    return (num_peers - 1) * (contribution_bytes + result_bytes) // num_peers

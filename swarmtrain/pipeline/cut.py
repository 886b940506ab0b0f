"""Where the model is cut: which transformer blocks each stage holds (the same on every peer)."""

from __future__ import annotations

__all__ = ["stage_blocks", "stage_of_block"]


def stage_blocks(n_layer: int, stages: int) -> list[range]:
    """The blocks of each stage: `stages` contiguous ranges covering 0..n_layer-1 in order, sizes
    differing by at most one (the earlier stages get the extra blocks)."""
    if not 1 <= stages <= n_layer:
        raise ValueError(f"cannot cut {n_layer} blocks into {stages} stages (each stage holds at least one block)")
    base, extra = divmod(n_layer, stages)
    out, start = [], 0
    for k in range(stages):
        size = base + (1 if k < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def stage_of_block(block: int, n_layer: int, stages: int) -> int:
    """The stage that holds `block`."""
    for k, blocks in enumerate(stage_blocks(n_layer, stages)):
        if block in blocks:
            return k
    raise ValueError(f"block {block} is not in a model of {n_layer} blocks")

"""Streaming DiLoCo's fragments: θ cut into P parts by transformer block, synced one per round.

Fragment p holds blocks p, p + P, p + 2P, … (strided, so every fragment spans the model's depth, as in
Streaming DiLoCo); parameters outside the blocks (embeddings, the final norm) go with fragment 0. A block is
a numbered module list: `blocks.N` (the GPT), `layers.N` (Llama and most transformers models), `h.N` (GPT-2
and its relatives), `layer.N` or `block.N`. A
fragment is a list of [lo, hi) ranges of the flat θ (model.parameters() order), adjacent ones merged.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["Ranges", "fragment_params", "fragment_ranges", "gather", "scatter_"]

Ranges = list[tuple[int, int]]
_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layers|h|layer|block)\.(\d+)\.")


def fragment_ranges(model: nn.Module, fragments: int) -> list[Ranges]:
    """The flat ranges of each of `fragments` fragments (ValueError when a fragment would be empty)."""
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {fragments}")
    out: list[Ranges] = [[] for _ in range(fragments)]
    offset = 0
    for name, p in model.named_parameters():
        match = _BLOCK.search(name)
        frag = int(match.group(1)) % fragments if match else 0
        n = p.numel()
        ranges = out[frag]
        if ranges and ranges[-1][1] == offset:
            ranges[-1] = (ranges[-1][0], offset + n)
        else:
            ranges.append((offset, offset + n))
        offset += n
    if fragments > 1 and not any(_BLOCK.search(name) for name, _ in model.named_parameters()):
        raise ValueError(f"diloco.fragments = {fragments}: no parameter of {type(model).__name__} lies in a numbered "
                         "block (blocks.N, layers.N, h.N, layer.N, block.N), so it cannot be cut into fragments")
    empty = [f for f, r in enumerate(out) if not r]
    if empty:
        raise ValueError(f"diloco.fragments = {fragments}: fragment(s) {empty} would hold no parameter (the model "
                         "has fewer transformer blocks than fragments)")
    return out


def fragment_params(params: Sequence[torch.Tensor], ranges: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """The parameters (of `params`, θ's flat order) whose values make up `ranges`, in order, so that a
    fragment is read or written without touching the rest of θ: `flatten` of them is `gather` of the
    flattened θ. ValueError when a range begins or ends inside a parameter."""
    spans = list(ranges)
    out: list[torch.Tensor] = []
    offset = covered = 0
    for p in params:
        lo, hi = offset, offset + p.numel()
        offset = hi
        if any(a <= lo and hi <= b for a, b in spans):
            out.append(p)
            covered += hi - lo
        elif any(a < hi and lo < b for a, b in spans):
            raise ValueError(f"fragment_params: a range of {spans} cuts the parameter at [{lo}, {hi})")
    wanted = sum(b - a for a, b in spans)
    if covered != wanted:
        raise ValueError(f"fragment_params: the parameters cover {covered} of the ranges' {wanted} values")
    return out


def gather(flat: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The values of `ranges` of a flat tensor, as one new contiguous tensor."""
    return torch.cat([flat[lo:hi] for lo, hi in ranges])


def scatter_(flat: torch.Tensor, ranges: Sequence[tuple[int, int]], values: torch.Tensor) -> None:
    """Writes `values` (as `gather` returned them) back into `ranges` of `flat`, in place."""
    at = 0
    for lo, hi in ranges:
        flat[lo:hi].copy_(values[at:at + hi - lo])
        at += hi - lo
    if at != values.numel():
        raise ValueError(f"scatter_: {values.numel()} values for ranges of {at}")

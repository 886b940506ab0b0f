"""A seeded permutation of 0..n-1 evaluated index by index (a Feistel network with cycle walking).

Memory is O(1) whatever n: a peer reading a dataset of billions of windows never holds a permutation of
them (torch.randperm of n windows is 8n bytes). Each epoch's order is a different key.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FeistelPermutation"]

_ROUNDS = 6
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective scramble of uint64 values (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """`perm(idx)` maps indices in [0, n) to a permutation of [0, n) fixed by (n, seed)."""

    def __init__(self, n: int, *, seed: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self._half = (bits + 1) // 2  # the domain 2^(2·half) >= n, below 4n: a walk takes < 4 steps on average
        self._mask = np.uint64((1 << self._half) - 1)
        with np.errstate(over="ignore"):
            base = _mix(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]
            self._keys = [_mix(np.array([base + np.uint64(r + 1)], dtype=np.uint64))[0] for r in range(_ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self._half)
        left, right = x >> h, x & self._mask
        with np.errstate(over="ignore"):
            for key in self._keys:
                left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << h) | right

    def __call__(self, idx: np.ndarray) -> np.ndarray:
        x = np.asarray(idx, dtype=np.uint64)
        if x.size and int(x.max()) >= self.n:
            raise ValueError(f"index {int(x.max())} is outside the permutation's [0, {self.n})")
        out = self._encrypt(x)
        outside = out >= np.uint64(self.n)
        while outside.any():  # cycle walking: a bijection of the domain restricted to [0, n)
            out[outside] = self._encrypt(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)

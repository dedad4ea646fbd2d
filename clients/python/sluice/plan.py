"""Deriving the per-rank read order of a ``SHUFFLE`` plan.

The stage and the client derive the same order independently, so a sampler can
yield indices locally while the stage prefetches them. The algorithm is
specified in ``docs/protocol.md`` ("Deriving a plan"): a Fisher-Yates shuffle
driven by SplitMix64 with rejection sampling, then rank ``r`` of ``w`` takes
``order[r::w]``.
"""

from __future__ import annotations

from .protocol import integer

__all__ = ["GOLDEN_GAMMA", "SplitMix64", "permutation", "shard", "shuffle_plan"]

_MASK = 0xFFFFFFFFFFFFFFFF
_TWO64 = 1 << 64
#: The SplitMix64 increment (2^64 / golden ratio), also the per-epoch seed step.
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


class SplitMix64:
    """The SplitMix64 generator as the protocol defines it.

    ``SplitMix64(seed, epoch)`` starts from ``seed + epoch * GOLDEN_GAMMA``
    (mod 2^64). Used by :func:`permutation`, which inlines the same arithmetic
    for speed; this class is the readable reference.
    """

    def __init__(self, seed: int, epoch: int = 0) -> None:
        self.state = (seed + epoch * GOLDEN_GAMMA) & _MASK

    def next(self) -> int:
        """Returns the next 64-bit output."""
        self.state = (self.state + GOLDEN_GAMMA) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * _MUL1) & _MASK
        z = ((z ^ (z >> 27)) * _MUL2) & _MASK
        return z ^ (z >> 31)

    def below(self, m: int) -> int:
        """Returns an unbiased integer in ``[0, m)`` by rejection sampling."""
        if m <= 0:
            raise ValueError(f"below() needs m >= 1, got {m}")
        limit = m * (_TWO64 // m)
        while True:
            r = self.next()
            if r < limit:
                return r % m


def permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """Returns the whole epoch order over ``n`` files (before sharding).

    With ``shuffle=False`` this is ``[0, 1, ..., n-1]``.
    """
    # Python ints: NumPy's fixed-width arithmetic would overflow below.
    seed = integer(seed, "seed", 64)
    epoch = integer(epoch, "epoch", 64)
    if n < 0:
        raise ValueError(f"file count must be >= 0, got {n}")
    order = list(range(n))
    if not shuffle or n < 2:
        return order
    # Inlined SplitMix64 + below(): this loop is the hot path (20k files in a
    # few tens of milliseconds), so it avoids method calls and attribute loads.
    mask, gamma, mul1, mul2, two64 = _MASK, GOLDEN_GAMMA, _MUL1, _MUL2, _TWO64
    state = (seed + epoch * gamma) & mask
    for i in range(n - 1, 0, -1):
        m = i + 1
        limit = two64 - two64 % m  # == m * floor(2^64 / m)
        while True:
            state = (state + gamma) & mask
            z = ((state ^ (state >> 30)) * mul1) & mask
            z = ((z ^ (z >> 27)) * mul2) & mask
            z ^= z >> 31
            if z < limit:
                break
        j = z % m
        order[i], order[j] = order[j], order[i]
    return order


def shard(order: list[int], rank: int, world_size: int) -> list[int]:
    """Returns rank ``rank`` of ``world_size``'s share: ``order[rank::world_size]``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    return order[rank::world_size]


def shuffle_plan(
    n: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    rank: int = 0,
    world_size: int = 1,
) -> list[int]:
    """Returns the file indices rank ``rank`` reads in ``epoch``, in order.

    This is exactly the order the stage delivers for a ``SHUFFLE`` plan with
    the same ``(seed, shuffle, epoch)`` on a connection with that rank.
    """
    return shard(permutation(n, seed, epoch, shuffle), rank, world_size)

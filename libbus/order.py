"""Sample order: seeded per-epoch shuffles and disjoint shards, reproducible from (seed, epoch)."""

from __future__ import annotations

import numpy as np

__all__ = ["epoch_order", "batches_of"]


def epoch_order(n: int, *, epoch: int, seed: int, shuffle: bool, rank: int = 0,
                world_size: int = 1) -> np.ndarray:
    """The int64 sample indices rank ``rank`` reads in ``epoch``.

    With ``shuffle`` the permutation is drawn from ``(seed, epoch)``: every epoch differs, and the same
    (seed, epoch) always gives the same order. Shards are strided slices of one permutation, so the
    shards of all ranks are disjoint and together cover every sample once.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of {world_size}")
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(n).astype(np.int64)
    else:
        order = np.arange(n, dtype=np.int64)
    return order[rank::world_size]


def batches_of(order: np.ndarray, batch_size: int, drop_last: bool) -> list[np.ndarray]:
    stop = len(order) - len(order) % batch_size if drop_last else len(order)
    return [order[i:i + batch_size] for i in range(0, stop, batch_size)]

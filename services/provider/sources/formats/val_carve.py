"""Which samples become val when a dataset's files hold no val split: every format's carve, in one place.

``val_fraction`` (checked by :func:`~.location.val_fraction`, default 0.1) is the share of train carved
off. Three carves, each kept by the formats it suits; a format's carve never changes, since that would
silently change every user's validation set and move samples users validated on into train
(``tests/provider/formats/test_val_carve.py`` pins each format's on a fixed example):

- **The tail of train** (:func:`tail`): the array layouts of ``file://``, TFRecord, MDS, litData,
  ``save_to_disk`` and Parquet. The last ``round(n * val_fraction)`` samples in file order (half to even,
  as Python's ``round``). Both splits stay contiguous in the files (a read of either coalesces), the
  carve needs no pass over the data and no memory, and the same files always give the same carve. These
  formats name no sample, and their writer chose the order, so there is nothing better to hash.
- **Per class, the names that hash lowest** (:func:`lowest_hashes_per_class`): ImageFolder (a file's
  path under the tree) and WebDataset (a shard's name and the sample's key). ``round(n * val_fraction)``
  of each class: every class is in val in proportion (stratified), and adding files moves no other file
  between the splits, where a tail would shift with every file added at the end.
- **The lines whose number hashes lowest** (:func:`lowest_hashed_lines`): text lines. A line has no
  class and no name but its number; hashing spreads val over the whole corpus, where the tail of a
  concatenated corpus is often one source or one period, and it runs vectorised over millions of lines.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable
from typing import TypeVar

import numpy as np

from libbus.errors import DatasetError

from ..splitmix import GAMMA, MUL1, MUL2

__all__ = ["lowest_hashed_lines", "lowest_hashes_per_class", "shard_rows", "tail"]

Row = TypeVar("Row", bound=Hashable)


def tail(where: str, n: int, fraction: float, unit: str = "train samples") -> int:
    """How many of ``n`` train samples (``unit``, as the error names them) stay train: the first ones;
    val is the rest, the last ``round(n * fraction)``.

    Raises :class:`DatasetError` naming ``where`` when val would leave no sample to train on.
    """
    val = round(n * fraction)
    if n - val < 1:
        raise DatasetError(f"{where}: val_fraction {fraction} of {n} {unit} leaves none to train on")
    return n - val


def shard_rows(
    where: str, counts: dict[str, list[int]], fraction: float, empty: str, unit: str
) -> tuple[dict[str, np.ndarray], float | None]:
    """The samples of a format stored as shards of records (TFRecord, MDS), split by split, with val
    carved off the tail of train (:func:`tail`) where the files hold none.

    Args:
        where: the dataset, as errors name it.
        counts: each split's shards' record counts, for every split in ``SPLITS`` order; shards are
            numbered across the splits in that order.
        fraction: the ``val_fraction`` to carve.
        empty: what the error says when train holds no record; ``unit``: how the carve names them.

    Returns:
        Every split's ``(n, 2)`` rows (shard number, record number), and the fraction carved (None: the
        files hold a val split).

    Raises :class:`DatasetError` naming ``where`` when train holds nothing, or val would leave nothing.
    """
    rows: dict[str, np.ndarray] = {}
    number = 0
    for split, sizes in counts.items():
        parts = [np.stack([np.full(n, number + i), np.arange(n)], 1) for i, n in enumerate(sizes)]
        number += len(sizes)
        rows[split] = np.concatenate(parts or [np.empty((0, 2), np.int64)]).astype(np.int64)
    if not len(rows["train"]):
        raise DatasetError(f"{where}: {empty}")
    if len(rows["val"]):
        return rows, None
    train = rows["train"]
    keep = tail(where, len(train), fraction, unit)
    rows["train"], rows["val"] = train[:keep], train[keep:]
    return rows, fraction


def lowest_hashes_per_class(
    rows: list[Row], fraction: float, label: Callable[[Row], Hashable], name: Callable[[Row], str]
) -> tuple[list[Row], list[Row]]:
    """``(train, val)`` of ``rows``, each in ``rows``' order: of each class (``label``), the
    ``round(n * fraction)`` rows whose ``name`` hashes lowest (BLAKE2b, 8 bytes) go to val."""
    by_class: dict[Hashable, list[Row]] = {}
    for row in rows:
        by_class.setdefault(label(row), []).append(row)
    val: set[Row] = set()
    for members in by_class.values():
        ranked = sorted(members, key=lambda r: hashlib.blake2b(name(r).encode(), digest_size=8).digest())
        val.update(ranked[: int(round(len(members) * fraction))])
    return [r for r in rows if r not in val], [r for r in rows if r in val]


def lowest_hashed_lines(n: int, fraction: float) -> np.ndarray:
    """Which of ``n`` lines go to val (a boolean mask): the ``round(n * fraction)`` whose number hashes
    lowest."""
    rank = np.argsort(_line_hash(np.arange(n, dtype=np.uint64)), kind="stable")
    val = np.zeros(n, bool)
    val[rank[: int(round(n * fraction))]] = True
    return val


def _line_hash(z: np.ndarray) -> np.ndarray:
    """A fixed, well-mixed order of line numbers, from SplitMix64's constants (not SplitMix64 itself,
    :mod:`..splitmix`: kept, so the order stays)."""
    with np.errstate(over="ignore"):
        z = (z + GAMMA) * MUL1
        z = (z ^ (z >> np.uint64(27))) * MUL2
    return z ^ (z >> np.uint64(31))

"""Sample order: shuffle modes, shards and a resumable cursor, all reproducible from ``(seed, epoch)``.

The trainer decides which samples it reads and in what order; providers only answer "give me
these indices". This module is the one place that order is computed. Everything here is a pure
function of its arguments, so two processes (or one process before and after a restart) that agree
on the arguments agree on every index.

Shuffle modes (:class:`Shuffle`):

- ``none``: ``0, 1, …, n-1``; sequential I/O.
- ``full``: a seeded permutation of all ``n`` indices, a new one per epoch.
- ``block``: the indices are cut into blocks of ``block_size`` consecutive indices (the last block
  may be short); the epoch reads the blocks in a seeded random order, each block sequentially.
  Mostly sequential I/O with much of the randomness of ``full``. With ``block_size=1`` it is
  exactly ``full``.

Shards (``world_size > 1``): the epoch's order (one per epoch, the same on every rank) is cut into
``world_size`` contiguous slices whose lengths differ by at most one; rank ``r`` reads slice ``r``.
The shards are disjoint and cover every sample exactly once per epoch. Contiguous slices keep the
runs of ``none`` and ``block`` sequential on every rank (at most two blocks per rank are split).
With ``drop_uneven=True`` the last ``n % world_size`` samples of the epoch's order are left out so
that every rank reads the same number of samples (what data-parallel training needs to keep its
collectives in step); in the shuffled modes the left-out samples change from epoch to epoch.

Cursor: a rank's position is ``(epoch, position)``, ``position`` being the number of samples of this
rank's epoch order already delivered. :meth:`Order.state` turns it into a small JSON-serialisable
dict that also records what the order depends on; :meth:`Order.restore` checks such a dict against
the current settings and refuses one from a different dataset size, seed, mode or world size.

    order = Order(n=60_000, seed=7, shuffle="block", block_size=512, rank=0, world_size=4,
                  batch_size=64)
    for batch in order.batches(epoch, start=position):
        ...                                  # position += len(batch) once it is delivered
    checkpoint["order"] = order.state(epoch, position)
    epoch, position = order.restore(checkpoint["order"])
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from libbus.errors import BadRequest

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "MAX_SKIP_RANGES",
    "STATE_VERSION",
    "Cursor",
    "Order",
    "Shuffle",
    "batches_of",
    "check_skips",
    "epoch_order",
    "kept_mask",
    "shard_bounds",
    "shift_skips",
    "skip_ranges",
]

#: Block length of ``block`` mode when none is given: long enough for sequential reads to pay off
#: (several batches per block), short enough that a 60k-sample dataset still has ~60 blocks to shuffle.
DEFAULT_BLOCK_SIZE = 1024

#: Version of the dict :meth:`Order.state` writes; bumped if its meaning ever changes.
STATE_VERSION = 1

#: The most index ranges a job's skips hold in all (they ride in its spec and every cursor's digest).
MAX_SKIP_RANGES = 4096
#: The most skips (each a list of ranges) one order takes.
MAX_SKIPS = 256

#: Skips: each a tuple of ``(start, stop)`` index ranges, in the order they were made.
Skips = tuple[tuple[tuple[int, int], ...], ...]


class Shuffle(enum.StrEnum):
    """How an epoch orders the samples: ``none``, ``full`` or ``block`` (see the module docstring)."""

    NONE = "none"
    FULL = "full"
    BLOCK = "block"

    @classmethod
    def parse(cls, value: Shuffle | str | bool) -> Shuffle:
        """The mode named by ``value``: a :class:`Shuffle`, its name, or a bool (True = full, False = none).

        Raises:
            BadRequest: ``value`` names no mode.
        """
        if isinstance(value, bool):  # the loader's historical ``shuffle: bool``
            return cls.FULL if value else cls.NONE
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        raise BadRequest(
            f"shuffle mode {value!r} is not one of none, full, block (or a bool: True for full, False for none)"
        )


class Cursor(NamedTuple):
    """A rank's place in the stream: ``position`` samples of epoch ``epoch`` already delivered."""

    epoch: int
    position: int

    def shown(self) -> str:
        """The place as every display says it, epochs counted from 1: ``"in epoch 2"`` within one,
        ``"after epoch 1"`` at a boundary (a cursor past an epoch's last sample is at the next one's
        start, position 0)."""
        return f"after epoch {self.epoch}" if self.position == 0 and self.epoch > 0 else f"in epoch {self.epoch + 1}"

    @classmethod
    def of_checkpoint(cls, record: Mapping[str, Any]) -> Cursor:
        """A checkpoint record's train cursor (``epoch``, and ``cursor.position`` where it has one)."""
        cursor = record.get("cursor")
        position = cursor.get("position", 1) if isinstance(cursor, dict) else 1
        return cls(int(record.get("epoch", 0)), int(position) if isinstance(position, int) else 1)


# -- checks ----------------------------------------------------------------------------------------
def _int(name: str, value: Any, low: int) -> int:
    """``value`` as a plain int, at least ``low``; bools and floats are refused, numpy ints accepted."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise BadRequest(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise BadRequest(f"{name} must be at least {low}, got {value}")
    return int(value)


def _check_shard(rank: Any, world_size: Any) -> tuple[int, int]:
    world_size = _int("world_size", world_size, 1)
    rank = _int("rank", rank, 0)
    if rank >= world_size:
        raise BadRequest(f"rank {rank} outside a world of {world_size} (ranks are 0..{world_size - 1})")
    return rank, world_size


# -- skips ----------------------------------------------------------------------------------------
def check_skips(skips: Any, n: int | None = None) -> Skips:
    """``skips`` (a list of skips, each a list of ``[start, stop)`` index ranges) checked and as tuples.

    Raises:
        BadRequest: not such a list, a range with ``start >= stop`` or negative, past ``n`` (when
            given), or more than :data:`MAX_SKIPS` skips or :data:`MAX_SKIP_RANGES` ranges in all.
    """
    if not isinstance(skips, (list, tuple)):
        raise BadRequest(f"skips must be a list of skips, each a list of [start, stop] ranges; got {skips!r:.80}")
    if len(skips) > MAX_SKIPS:
        raise BadRequest(f"{len(skips)} skips; at most {MAX_SKIPS}")
    out, total = [], 0
    for one in skips:
        if not isinstance(one, (list, tuple)):
            raise BadRequest(f"a skip is a list of [start, stop] ranges, got {one!r:.80}")
        total += len(one)
        if total > MAX_SKIP_RANGES:
            raise BadRequest(
                f"skips hold more than {MAX_SKIP_RANGES} index ranges in all; skip fewer or longer stretches"
            )
        ranges = []
        for r in one:
            ok = (
                isinstance(r, (list, tuple))
                and len(r) == 2
                and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in r)
                and 0 <= r[0] < r[1]
            )
            if not ok:
                raise BadRequest(f"a skipped range is [start, stop] with 0 <= start < stop, got {r!r:.80}")
            if n is not None and r[1] > n:
                raise BadRequest(f"skipped range [{r[0]}, {r[1]}) is past the {n} samples of the order")
            ranges.append((int(r[0]), int(r[1])))
        out.append(tuple(ranges))
    return tuple(out)


def shift_skips(skips: Skips, first: int, n: int) -> Skips:
    """``skips`` of a split's indices as the indices of an order over its records ``first..first+n-1``
    (a loader's ``samples`` range): shifted, cut to the range; each skip kept, even if empty there."""
    return tuple(
        tuple((max(a - first, 0), min(b - first, n)) for a, b in one if min(b - first, n) > max(a - first, 0))
        for one in skips
    )


def skip_ranges(skips: Skips) -> np.ndarray:
    """The union of ``skips`` as sorted, disjoint ``(start, stop)`` rows of an int64 array."""
    rows = sorted(r for one in skips for r in one)
    merged: list[list[int]] = []
    for a, b in rows:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return np.array(merged, dtype=np.int64).reshape(-1, 2)


def kept_mask(indices: np.ndarray, ranges: np.ndarray) -> np.ndarray:
    """A mask of ``indices`` that no row of ``ranges`` (see :func:`skip_ranges`) covers."""
    if not len(ranges):
        return np.ones(len(indices), dtype=bool)
    at = np.searchsorted(ranges[:, 0], indices, side="right") - 1
    return ~((at >= 0) & (indices < ranges[np.maximum(at, 0), 1]))


def _skipped_below(ranges: np.ndarray, n: int) -> int:
    """How many of ``0..n-1`` the ranges cover."""
    return int(np.clip(ranges[:, 1], 0, n).sum() - np.clip(ranges[:, 0], 0, n).sum()) if len(ranges) else 0


# -- the pure functions ----------------------------------------------------------------------------
def shard_bounds(n: int, *, rank: int = 0, world_size: int = 1, drop_uneven: bool = False) -> tuple[int, int]:
    """The slice ``[lo, hi)`` of an epoch's order of ``n`` samples that rank ``rank`` reads.

    The first ``n % world_size`` ranks read one sample more than the others, unless ``drop_uneven``,
    where the order's last ``n % world_size`` samples are read by nobody this epoch.

    Raises:
        BadRequest: ``n`` negative, ``world_size`` below 1, or ``rank`` outside ``0..world_size-1``.
    """
    n = _int("n", n, 0)
    rank, world_size = _check_shard(rank, world_size)
    base, extra = divmod(n, world_size)
    if drop_uneven:
        extra = 0
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def _block_order(n: int, block_size: int, rng: np.random.Generator) -> np.ndarray:
    """All ``n`` indices as blocks of ``block_size`` in a random block order, sequential inside."""
    num_blocks = -(-n // block_size)
    starts = rng.permutation(num_blocks).astype(np.int64) * block_size
    lengths = np.minimum(block_size, n - starts)  # only the block holding n-1 is short
    # Position i of the output lies in some block b at offset i - out_start[b]; its index is
    # starts[b] + that offset. One repeat per array instead of a Python loop over the blocks.
    out_starts = np.cumsum(lengths) - lengths
    return np.arange(n, dtype=np.int64) + np.repeat(starts - out_starts, lengths)


def epoch_order(
    n: int,
    *,
    epoch: int,
    seed: int,
    shuffle: Shuffle | str | bool,
    rank: int = 0,
    world_size: int = 1,
    block_size: int = DEFAULT_BLOCK_SIZE,
    drop_uneven: bool = False,
) -> np.ndarray:
    """The int64 sample indices rank ``rank`` reads in ``epoch``, in the order it reads them.

    Args:
        n: samples in the split.
        epoch, seed: the shuffled modes draw from ``numpy.random.default_rng([seed, epoch])``, so each
            epoch differs and the same ``(seed, epoch)`` always gives the same order.
        shuffle: ``none``, ``full`` or ``block`` (a :class:`Shuffle`, its name, or a bool: True is
            ``full``, False is ``none``).
        rank, world_size: read shard ``rank`` of ``world_size`` (see :func:`shard_bounds`).
        block_size: block length of ``block`` mode (ignored by the others).
        drop_uneven: leave out the epoch's last ``n % world_size`` samples so all shards are equal.

    Returns:
        A new int64 array; the shards of all ranks are disjoint and, without ``drop_uneven``, their
        union is ``range(n)``.

    Raises:
        BadRequest: an unknown mode, or an argument out of range (named in the message).
    """
    mode = Shuffle.parse(shuffle)
    n, epoch, seed = _int("n", n, 0), _int("epoch", epoch, 0), _int("seed", seed, 0)
    block_size = _int("block_size", block_size, 1)
    lo, hi = shard_bounds(n, rank=rank, world_size=world_size, drop_uneven=drop_uneven)
    if mode is Shuffle.NONE:
        return np.arange(lo, hi, dtype=np.int64)
    # Every rank draws the whole epoch's order and keeps its slice: that is what makes the shards
    # agree without talking to each other. Full mode stays ``permutation(n)`` of this generator,
    # the order earlier versions produced, so old seeds read the same samples.
    rng = np.random.default_rng([seed, epoch])
    if mode is Shuffle.FULL:
        order = rng.permutation(n).astype(np.int64, copy=False)
    else:
        order = _block_order(n, block_size, rng)
    if lo == 0 and hi == n:
        return order
    return order[lo:hi].copy()  # a copy, so the rest of the epoch's order can be freed


def batches_of(order: np.ndarray, batch_size: int, drop_last: bool, start: int = 0) -> list[np.ndarray]:
    """Cut ``order[start:]`` into consecutive batches of ``batch_size`` (views of ``order``).

    Batches are counted from ``start``: resuming at a batch boundary gives exactly the batches the
    uninterrupted epoch had left; resuming elsewhere (after a change of batch size) still delivers
    every remaining sample once, in order.

    Args:
        order: an epoch's order (see :func:`epoch_order`).
        batch_size: samples per batch.
        drop_last: leave out a final batch shorter than ``batch_size``.
        start: samples of ``order`` already delivered.

    Returns:
        The batches, in order; empty when nothing (or, with ``drop_last``, less than a batch) remains.

    Raises:
        BadRequest: ``batch_size`` below 1, or ``start`` outside ``0..len(order)``.
    """
    batch_size = _int("batch_size", batch_size, 1)
    start = _int("start", start, 0)
    if start > len(order):
        raise BadRequest(f"start {start} is past the end of an epoch of {len(order)} samples")
    remaining = len(order) - start
    stop = start + (remaining - remaining % batch_size if drop_last else remaining)
    return [order[i : i + batch_size] for i in range(start, stop, batch_size)]


# -- the object a loader holds ---------------------------------------------------------------------
#: Fields a saved state must match: a different value reads different samples at the same position.
_CHECKED = ("n", "seed", "shuffle", "block_size", "world_size", "drop_uneven")


@dataclass(frozen=True)
class Order:
    """Everything that fixes one rank's order, with the batches and the cursor built on it.

    Args:
        n: samples in the split.
        seed: seed of the shuffled modes.
        shuffle: ``none``, ``full`` or ``block`` (or a bool; stored as a :class:`Shuffle`).
        block_size: block length of ``block`` mode.
        rank, world_size: this rank's shard of ``world_size``.
        batch_size, drop_last: as in ``torch.utils.data.DataLoader``.
        drop_uneven: equal shards, leaving out the epoch's last ``n % world_size`` samples.
        skip: skips (each a tuple of ``(start, stop)`` index ranges, oldest first): those indices are
            left out of every epoch's order *before* it is cut into shards, so the shards stay disjoint
            and equal and every other sample is read once (libbus/order/elastic.py resumes a cursor
            saved under fewer skips).

    Raises:
        BadRequest: an unknown mode or an argument out of range, named in the message.
    """

    n: int
    seed: int = 0
    shuffle: Shuffle | str | bool = Shuffle.FULL
    block_size: int = DEFAULT_BLOCK_SIZE
    rank: int = 0
    world_size: int = 1
    batch_size: int = 1
    drop_last: bool = False
    drop_uneven: bool = False
    skip: Skips = ()

    def __post_init__(self) -> None:
        # Normalise once here, so every method (and the saved state) sees plain ints and a Shuffle.
        rank, world_size = _check_shard(self.rank, self.world_size)
        fields = {
            "n": _int("n", self.n, 0),
            "seed": _int("seed", self.seed, 0),
            "shuffle": Shuffle.parse(self.shuffle),
            "block_size": _int("block_size", self.block_size, 1),
            "rank": rank,
            "world_size": world_size,
            "batch_size": _int("batch_size", self.batch_size, 1),
            "drop_last": bool(self.drop_last),
            "drop_uneven": bool(self.drop_uneven),
            "skip": check_skips(self.skip),
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @property
    def kept(self) -> int:
        """Samples of an epoch's order once the skipped ones are left out (``n`` without skips)."""
        return self.n - _skipped_below(skip_ranges(self.skip), self.n) if self.skip else self.n

    @property
    def shard_size(self) -> int:
        """Samples this rank reads per epoch (the same every epoch)."""
        lo, hi = shard_bounds(self.kept, rank=self.rank, world_size=self.world_size, drop_uneven=self.drop_uneven)
        return hi - lo

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's int64 sample indices for ``epoch``, in reading order (see :func:`epoch_order`)."""
        if self.skip:
            whole = epoch_order(self.n, epoch=epoch, seed=self.seed, shuffle=self.shuffle, block_size=self.block_size)
            whole = whole[kept_mask(whole, skip_ranges(self.skip))]
            lo, hi = shard_bounds(len(whole), rank=self.rank, world_size=self.world_size, drop_uneven=self.drop_uneven)
            return whole[lo:hi].copy()
        return epoch_order(
            self.n,
            epoch=epoch,
            seed=self.seed,
            shuffle=self.shuffle,
            rank=self.rank,
            world_size=self.world_size,
            block_size=self.block_size,
            drop_uneven=self.drop_uneven,
        )

    def batches(self, epoch: int, start: int = 0) -> list[np.ndarray]:
        """The batches of ``epoch`` after the first ``start`` samples (see :func:`batches_of`).

        Raises:
            BadRequest: ``epoch`` negative or ``start`` outside ``0..shard_size``.
        """
        return batches_of(self.indices(epoch), self.batch_size, self.drop_last, start=start)

    def num_batches(self, *, start: int = 0) -> int:
        """Batches an epoch yields after its first ``start`` samples (all of them for ``start=0``).

        Raises:
            BadRequest: ``start`` outside ``0..shard_size``.
        """
        start = _int("start", start, 0)
        if start > self.shard_size:
            raise BadRequest(f"start {start} is past the end of an epoch of {self.shard_size} samples")
        remaining = self.shard_size - start
        return remaining // self.batch_size if self.drop_last else -(-remaining // self.batch_size)

    def cursor(self, epoch: int, position: int) -> Cursor:
        """``(epoch, position)`` checked, with a finished epoch written as the start of the next.

        An epoch is finished when it has delivered something (``position > 0``) and no batch
        remains after ``position`` (with ``drop_last``: fewer than ``batch_size`` samples remain).
        ``position`` may exceed this rank's shard by one: a state saved by a rank with one sample
        more (uneven shards) at the end of its epoch.

        Raises:
            BadRequest: ``epoch`` or ``position`` negative, or ``position`` past the longest shard.
        """
        epoch, position = self._check_position(epoch, position)
        # position 0 stays put even when the shard yields no batch at all: otherwise saving and
        # restoring an empty shard would skip an epoch each time.
        if position > 0 and self.num_batches(start=min(position, self.shard_size)) == 0:
            return Cursor(epoch + 1, 0)
        return Cursor(epoch, position)

    def _check_position(self, epoch: int, position: int) -> tuple[int, int]:
        epoch, position = _int("epoch", epoch, 0), _int("position", position, 0)
        kept = self.kept
        longest = kept // self.world_size if self.drop_uneven else -(-kept // self.world_size)
        if position > longest:
            raise BadRequest(
                f"position {position} is past the end of an epoch of {self.shard_size} samples "
                f"(n={self.n}, world_size={self.world_size})"
            )
        return epoch, position

    def state(self, epoch: int, position: int) -> dict[str, Any]:
        """A JSON-serialisable record of ``(epoch, position)`` for a checkpoint.

        It holds the cursor as given and the settings the order depends on, so that :meth:`restore`
        can refuse it under other settings (and there move a finished epoch on to the next, under
        the batch size it resumes with). ``rank`` is recorded but not
        checked: one rank's checkpoint is commonly restored by every rank, and all ranks are at the
        same position when they have taken the same number of steps. ``batch_size`` is not recorded:
        a run may resume with another batch size and still read every remaining sample once.

        Raises:
            BadRequest: ``epoch`` or ``position`` negative, or ``position`` past the longest shard.
        """
        epoch, position = self._check_position(epoch, position)
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "position": position,
            "n": self.n,
            "seed": self.seed,
            "shuffle": str(self.shuffle),
            "block_size": self.block_size,
            "world_size": self.world_size,
            "drop_uneven": self.drop_uneven,
            "rank": self.rank,
            **skip_state(self.skip),
        }

    def restore(self, state: Mapping[str, Any]) -> Cursor:
        """The cursor saved in ``state`` by :meth:`state`, checked against these settings.

        Returns:
            The :class:`Cursor` to continue from (see :meth:`cursor`):
            ``batches(cursor.epoch, start=cursor.position)`` yields exactly the batches not yet
            delivered.

        Raises:
            BadRequest: ``state`` is not such a record, is of another version, or was saved under
                other settings (every differing field is named, with both values).
        """
        if not isinstance(state, Mapping):
            raise BadRequest(f"order state must be a mapping, got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise BadRequest(f"order state version {state.get('version')!r} is not {STATE_VERSION}")
        missing = [k for k in ("epoch", "position", *_CHECKED) if k not in state]
        if missing:
            raise BadRequest(f"order state lacks {', '.join(missing)}")
        checked = [k for k in _CHECKED if k != "block_size" or self.shuffle is Shuffle.BLOCK]
        mine = {
            "n": self.n,
            "seed": self.seed,
            "shuffle": str(self.shuffle),
            "block_size": self.block_size,
            "world_size": self.world_size,
            "drop_uneven": self.drop_uneven,
        }
        differ = [f"{k} was {state[k]!r}, is {mine[k]!r}" for k in checked if state[k] != mine[k]]
        if differ:
            raise BadRequest(
                "order state was saved under other settings, so its position would "
                f"point at other samples: {'; '.join(differ)}"
            )
        return self.cursor(state["epoch"], state["position"])


def skip_state(skips: Skips) -> dict[str, Any]:
    """What a cursor records of the skips it was saved under: their number and a digest (none
    without skips, so a cursor without any reads as before)."""
    if not skips:
        return {}
    return {"skips": len(skips), "skips_digest": skips_digest(skips)}


def skips_digest(skips: Skips) -> str:
    """A short digest of ``skips``: a cursor saved under some skips resumes only under them and more."""
    import hashlib

    return hashlib.blake2b(repr(skips).encode(), digest_size=8).hexdigest()

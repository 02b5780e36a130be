"""The batches a loader's pass thread asks for, numbered on across the epoch boundary.

A pass is one epoch's batches (from the cursor on). The epoch after it is known as soon as the pass
begins: :class:`~libbus.loader.remote.RemoteLoader`'s next ``iter()`` reads epoch + 1 from its start
unless the user says otherwise (``set_epoch`` to another epoch, ``load_state_dict``, ``rewind``,
``close``). :class:`BatchStream` is the pass's batches followed, once all of them have been asked for,
by the next epoch's (``follow(epoch)``), numbered on: batch ``len(pass)`` is the next epoch's first. The
request window keeps ``inflight`` requests out across the boundary, so the link never drains while the
last batches of an epoch are read and the next ``iter()`` finds its first batches on their way.

The next pass takes them only if its batches are exactly the ones the stream holds for it
(:meth:`BatchStream.segment_at` compared with what the loader's order names); otherwise the pass
thread is stopped and its requests discarded as a pass left early (:mod:`libbus.loader.remote`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

__all__ = ["BatchStream", "Segment"]


@dataclass(frozen=True)
class Segment:
    """One epoch's batches in the stream: batch numbers ``start .. start + len(batches) - 1``."""

    epoch: int
    start: int
    batches: list[np.ndarray]

    @property
    def stop(self) -> int:
        return self.start + len(self.batches)


class BatchStream(Sequence[np.ndarray]):
    """A pass's ``batches`` of ``epoch``, then the following epochs' (``follow(epoch)``, computed on the
    pass thread when every batch before them has been asked for; ``None``: the pass alone).

    Read by the pass thread (:meth:`extend`, items, :meth:`epoch_of`, :meth:`forget_below`) and, between
    passes, by the consumer (:meth:`segment_at`): a lock keeps the segment list whole for both.
    """

    def __init__(self, epoch: int, batches: list[np.ndarray], follow: Callable[[int], list[np.ndarray]] | None):
        self._segments = [Segment(epoch, 0, list(batches))]
        self._follow = follow
        self._count = len(batches)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Batches known so far (numbered ``0 .. len - 1``), the ones forgotten included."""
        return self._count

    def extend(self) -> bool:
        """Append the epoch after the last one: ``False`` (and never again) when there is no
        ``follow``, or that epoch has no batch."""
        if self._follow is None:
            return False
        last = self._segments[-1]
        batches = self._follow(last.epoch + 1)
        if not batches:
            self._follow = None  # an empty epoch: nothing to ask for ahead (and no end to the loop)
            return False
        with self._lock:
            self._segments.append(Segment(last.epoch + 1, self._count, list(batches)))
            self._count += len(batches)
        return True

    def _segment_of(self, batch_no: int) -> Segment:
        for seg in self._segments:
            if seg.start <= batch_no < seg.stop:
                return seg
        raise IndexError(f"batch {batch_no} is not in the stream (forgotten, or not yet known)")

    @overload
    def __getitem__(self, key: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, key: slice) -> list[np.ndarray]: ...
    def __getitem__(self, key: int | slice) -> np.ndarray | list[np.ndarray]:
        """Batch ``key``, or a list of the known batches of a slice (step 1), across epochs."""
        if isinstance(key, slice):
            start, stop, _ = key.indices(self._count)
            return [self[n] for n in range(start, stop)]
        seg = self._segment_of(key)
        return seg.batches[key - seg.start]

    def epoch_of(self, batch_no: int) -> int:
        return self._segment_of(batch_no).epoch

    def forget_below(self, batch_no: int) -> None:
        """Drop the epochs whose batches all come before ``batch_no`` (let go by the consumer), the last
        one kept: a long run holds one or two epochs' orders, not every epoch's."""
        with self._lock:
            while len(self._segments) > 1 and self._segments[0].stop <= batch_no:
                self._segments.pop(0)

    def segment_at(self, start: int) -> Segment | None:
        """The epoch whose batches begin at batch number ``start``, if the stream has it."""
        with self._lock:
            for seg in self._segments:
                if seg.start == start and seg.batches:
                    return seg
        return None

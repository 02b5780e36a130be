"""The order is the prefetch plan: a loader tells its provider which samples it will ask for next.

A loader's future batches follow from (seed, epoch, cursor, skips): the whole pass is known when it
begins. Where the provider says its dataset can use it (DatasetInfo ``read_ahead``: a remote store with
a RAM cache of blocks), :class:`ReadAheadPlan` sends it the samples of the ``depth`` batches after those
in flight (:class:`~libbus.wire.messages.ReadAhead`), and again each time half of them have been asked
for, so the provider's cache fetches their blocks while the batches before them are read. Each plan
replaces the last: a new pass (``set_epoch``, a seek, a resume, skips) begins with its own, and a closed
loader's session ends its plan on the provider.

Sent to one provider only: with several replicas, which one reads a batch is decided when it is asked
for, and every replica fetching every block would multiply the store's traffic. The replies (``Ok``)
are not waited for; they arrive as replies to no batch and are dropped (:mod:`libbus.loader.window`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["READ_AHEAD", "ReadAheadPlan"]

#: Batches told ahead of those in flight, by default.
READ_AHEAD = 16


class ReadAheadPlan:
    """Sends ``send(indices)`` for ``batches[n + inflight : n + inflight + depth]`` as the pass reaches
    batch ``n`` (:meth:`at`), at the start and again each time half of the last plan has been asked for."""

    def __init__(self, batches: Sequence[np.ndarray], inflight: int, depth: int, send: Callable[[np.ndarray], None]):
        self.batches, self.inflight, self.depth, self.send = batches, inflight, max(1, depth), send
        self._until = -1  # the batch the last plan ran to (exclusive); -1: none sent yet

    def at(self, next_yield: int) -> None:
        """The pass hands out batch ``next_yield`` next: send a new plan when the last one runs short."""
        start = min(next_yield + self.inflight, len(self.batches))
        if self._until >= 0 and self._until - start > self.depth // 2:
            return
        stop = min(start + self.depth, len(self.batches))
        if stop <= start or stop == self._until:
            return
        self._until = stop
        self.send(np.concatenate(self.batches[start:stop]).astype("<i8", copy=False))

"""What the provider's handler needs for x/y batches besides the handler itself: the indices a
request names (:func:`batch_indices`), and where ring slots are filled (:class:`Filler`).

A ring slot filled on the serving loop's thread holds up every other request for the gather's
time: about two thirds of the provider's CPU per 3 MB batch. With a core to spare, a fill thread
does the gather (numpy copies without the GIL) while the loop receives, checks and answers the next
request; the handler returns a :class:`~concurrent.futures.Future` that the server answers when it
completes (:mod:`libbus.server`, woken by :mod:`libbus.wakeup`). One thread, so fills finish in
the order they were asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from libbus.constants import MAX_BATCH_INDICES
from libbus.errors import BadRequest, OutOfRange, TooLarge
from libbus.messages import BatchRequest, frame_buffer
from libbus.sockets import frame_len
from shm import Ring

from .sources.formats.dataset import usable_cores

__all__ = ["FILL_THREAD", "Filler", "batch_indices"]

#: Fill ring slots on a thread of their own by default only with four cores or more. On two, the
#: serving loop, the fill thread and a same-host trainer contend for the same two cores, and the
#: hand-off (a futex wake-up, a GIL switch, the loop's wake-up per reply) costs more than the
#: overlap gives (docs/performance.md, "What bounds the shm row").
FILL_THREAD = usable_cores() >= 4


def batch_indices(msg: BatchRequest, num_samples: int, split: str) -> np.ndarray:
    """The int64 indices a BatchRequest names, checked against the split's size.

    Raises :class:`BadRequest` (neither or both of range/frame, bad frame), :class:`TooLarge`
    (too many indices) or :class:`OutOfRange` (naming the first bad index).
    """
    if msg.range is not None and msg.frames:
        raise BadRequest("BatchRequest gives both a range and an indices frame; send one")
    if msg.range is not None:
        r = msg.range
        if len(r) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in r) or r[0] > r[1]:
            raise BadRequest(f"BatchRequest.range must be [start, end) integers with start <= end, got {r}")
        start, end = r
        if end - start > MAX_BATCH_INDICES:
            raise TooLarge(f"range of {end - start} samples; at most {MAX_BATCH_INDICES} per request")
        if start < 0 or end > num_samples:
            raise OutOfRange(f"range [{start}, {end}) is outside {split} (0..{num_samples})")
        return np.arange(start, end, dtype=np.int64)
    if not msg.frames:
        raise BadRequest("BatchRequest needs a range or an int64 indices frame")
    frame = msg.frames[0]
    size = frame_len(frame)
    if size % 8:
        raise BadRequest(f"indices frame is {size} bytes; expected a multiple of 8 (int64)")
    if size // 8 > MAX_BATCH_INDICES:
        raise TooLarge(f"{size // 8} indices; at most {MAX_BATCH_INDICES} per request")
    buf = frame_buffer(frame)
    indices = np.frombuffer(buf, dtype="<i8")
    if len(indices):
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= num_samples:
            bad = lo if lo < 0 else hi
            raise OutOfRange(f"index {bad} is outside {split} (0..{num_samples - 1})")
    return indices


class Filler:
    """Runs ring-slot fills on a thread of its own (``threaded``; default :data:`FILL_THREAD`),
    started on the first fill and stopped by :meth:`close`, or on the caller's thread.

    A ring must not be unmapped while a fill writes into it: :meth:`close_ring` closes it on the
    fill thread, after every fill queued before.
    """

    def __init__(self, threaded: bool | None = None):
        self.threaded = FILL_THREAD if threaded is None else threaded
        self._pool: ThreadPoolExecutor | None = None

    def run(self, fill: Callable[..., Any], *args) -> Any:
        """``fill(*args)``: its result here, or a Future of it from the fill thread."""
        if not self.threaded:
            return fill(*args)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fill")
        return self._pool.submit(fill, *args)

    def close_ring(self, ring: Ring) -> None:
        """Unmap ``ring`` once no fill can be writing into it."""
        if self._pool is not None:
            try:
                self._pool.submit(ring.close)
                return
            except RuntimeError:  # shut down meanwhile: no fill runs any more
                pass
        ring.close()

    def close(self) -> None:
        """Stop the fill thread after the fills under way (a millisecond each); fill inline after."""
        pool, self._pool, self.threaded = self._pool, None, False
        if pool is not None:
            pool.shutdown(wait=True)

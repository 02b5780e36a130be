"""Where the provider reads a batch: on the serving loop's thread, on its fill thread, or on its
overlap threads. The source's :class:`~.sources.base.ReadPolicy` and the destination pick one
(:meth:`Fillers.for_batch`); each is a :class:`Filler`.

A ring slot filled on the serving loop's thread holds up every other request for the gather's
time: about two thirds of the provider's CPU per 3 MB batch. With a core to spare, a fill thread
does the gather (numpy copies without the GIL) while the loop receives, checks and answers the next
request; the handler returns a :class:`~concurrent.futures.Future` that the server answers when it
completes (:mod:`libbus.serve.server`, woken by :mod:`libbus.serve.wakeup`).

A source whose reads mostly wait on threads of its own (a pipeline: its stages) is read off the
loop on several threads, whatever the cores: while one batch's last chunk goes through the last
stages, the next batch's chunks are already in the first ones, and the loop answers meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shm import Ring

from .sources.base import ReadPolicy
from .sources.formats.dataset import usable_cores

__all__ = ["FILL_THREAD", "OVERLAP_READS", "Filler", "Fillers", "RingUse"]

#: Fill ring slots on a thread of their own by default only with four cores or more. On two, the
#: serving loop, the fill thread and a same-host trainer contend for the same two cores, and the
#: hand-off (a futex wake-up, a GIL switch, the loop's wake-up per reply) costs more than the
#: overlap gives (docs/performance.md, "What bounds the shm row").
FILL_THREAD = usable_cores() >= 4

#: Batches of a source with :attr:`ReadPolicy.OVERLAP` (a pipeline) read at once: the next batch's chunks
#: enter its first stages while the last stages finish the one before.
OVERLAP_READS = 2


class RingUse:
    """The fills under way per ring, across fillers: a ring is unmapped once its last one has ended
    (one under way still writes into it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: dict[int, int] = {}  # id(ring) -> its fills under way (each holds the ring)
        self._closing: dict[int, Ring] = {}  # rings to unmap when their last fill ends

    def hold(self, ring: Ring) -> None:
        with self._lock:
            self._busy[id(ring)] = self._busy.get(id(ring), 0) + 1

    def release(self, ring: Ring) -> None:
        with self._lock:
            left = self._busy.pop(id(ring)) - 1
            if left:
                self._busy[id(ring)] = left
                return
            closing = self._closing.pop(id(ring), None)
        if closing is not None:
            closing.close()

    def close(self, ring: Ring) -> None:
        """Unmap ``ring`` now, or once no fill can be writing into it."""
        with self._lock:
            if self._busy.get(id(ring)):
                self._closing[id(ring)] = ring
                return
        ring.close()


class Filler:
    """Runs batch reads and ring-slot fills on ``threads`` threads of their own (``threaded``;
    default :data:`FILL_THREAD`), started on the first and stopped by :meth:`close`, or on the
    caller's thread. A fill names its ring, held in ``rings`` until the fill ends."""

    def __init__(self, rings: RingUse, threaded: bool | None = None, threads: int = 1, name: str = "fill"):
        self.rings = rings
        self.threaded = FILL_THREAD if threaded is None else threaded
        self.threads, self.name = threads, name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def run(self, fill: Callable[..., Any], *args, ring: Ring | None = None) -> Any:
        """``fill(*args)``: its result here, or a Future of it from a thread of this filler's."""
        with self._lock:
            pool = self._pool
            if self.threaded and pool is None:
                pool = self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self.name)
            if pool is not None and ring is not None:
                self.rings.hold(ring)
            future = pool.submit(fill, *args) if pool is not None else None
        if future is None:
            return fill(*args)
        if ring is not None:
            future.add_done_callback(lambda _: self.rings.release(ring))
        return future

    def close(self) -> None:
        """Stop the threads after the work under way (its rings unmapped as it ends); run inline after."""
        with self._lock:
            pool, self._pool, self.threaded = self._pool, None, False
        if pool is not None:
            pool.shutdown(wait=True)


class Fillers:
    """The provider's three fillers, over one :class:`RingUse`: the loop's thread, the fill thread
    (``fill_thread``; default :data:`FILL_THREAD`) and the overlap threads."""

    def __init__(self, fill_thread: bool | None = None):
        #: Rings are unmapped through this, once no fill writes into them.
        self.rings = RingUse()
        self.loop = Filler(self.rings, False, name="loop")
        self.fill = Filler(self.rings, fill_thread)
        self.overlap = Filler(self.rings, True, OVERLAP_READS, "overlap")

    def for_batch(self, policy: ReadPolicy, ring: Ring | None) -> Filler:
        """Where a batch of a source with ``policy`` is read, into ``ring``'s slot or (``None``) the
        reply's frames: a source that may be read from one thread only, on the loop; one whose reads
        may run side by side fills ring slots on the fill thread (the socket's batches stay on the
        loop); one whose reads wait on threads of its own, on the overlap threads, always."""
        if policy is ReadPolicy.OVERLAP:
            return self.overlap
        if policy is ReadPolicy.CONCURRENT and ring is not None:
            return self.fill
        return self.loop

    def close(self) -> None:
        """Stop the threads after the reads under way (the fills under way finish first)."""
        self.overlap.close()
        self.fill.close()

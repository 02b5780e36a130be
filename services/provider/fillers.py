"""Where the provider reads a batch: on the serving loop's thread, or on a lane of threads off it.
The source's :class:`~.sources.base.ReadPolicy`, whether its bytes are remote, whether its reads are
memory-speed gathers, and the destination pick one (:meth:`Fillers.for_batch`); each is a :class:`Filler`.

**The loop reads nothing slow.** It receives, checks and answers; a batch whose read takes time (a
store's round trips, a decode, a generator, a Parquet page) is read on a lane, and the handler returns
a :class:`~concurrent.futures.Future` that the server answers when it completes (:mod:`libbus.serve.server`,
woken by :mod:`libbus.serve.wakeup`). So ``Hello``, ``Resolve`` and ``DatasetInfo`` are answered at once
whatever the sources are doing, and the time a batch waits for its read is measured as its ``queue``
(its read began later than the loop took it), not lost in the socket where the loader's stall split
would call it ``transfer``.

**Each dataset has its own lanes.** Threads are not shared between datasets (but for the serial lane,
below), so a slow store (a remote dataset whose every GET takes 100 ms, or one that is failing and
retrying) delays only its own batches. Within a lane, batches are read in the order they arrived.

- **remote** (a source whose bytes come over the network: ``http(s)://``, an object store): ``remote_reads``
  (:data:`~libbus.constants.REMOTE_READS`) batches of the dataset at once, so the GETs of every batch in
  flight overlap instead of one batch's after another's. Beside another dataset, the reads themselves run
  in a helper process (:mod:`.read_helper`) and these threads only wait for it and copy the bytes.
- **overlap** (:attr:`ReadPolicy.OVERLAP`: a pipeline, whose reads mostly wait on its stages' threads):
  :data:`OVERLAP_READS` batches at once: while one batch's last chunk goes through the last stages, the
  next batch's chunks are already in the first ones.
- **fill** (:attr:`ReadPolicy.CONCURRENT`: reads that share no state): ``fill_threads`` threads of the
  dataset's (default: one per core), so a node with 8 GPUs is fed by one provider: numpy gathers,
  generators and ``preadv`` release the GIL.
- **serial** (:attr:`ReadPolicy.LOOP`: reads that share state): one thread for all such datasets together,
  as on the loop before (a mix and its member, served under two names, are one object), but off the loop.
- **loop**: a local file source's memory-speed gathers (:attr:`~.sources.base.Source.gather`: RAM or the
  page cache) into the reply's frames, and on fewer than four cores into ring slots too. A gather of a
  3 MB batch takes about a millisecond; on two cores the loop, a fill thread and a same-host trainer
  would contend for the same cores, and the hand-off (a futex wake-up, a GIL switch, the loop's wake-up
  per reply) costs more than the overlap gives (docs/performance.md, "What bounds the shm row").
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from libbus.constants import REMOTE_READS
from shm import Ring

from .sources.base import ReadPolicy, Source
from .sources.formats.dataset import usable_cores
from .sources.storage.inflight import lower_priority

__all__ = ["FILL_THREAD", "OVERLAP_READS", "REMOTE_READS", "Filler", "Fillers", "RingUse"]

#: Fill ring slots on threads of their own by default only with four cores or more (see the module doc).
FILL_THREAD = usable_cores() >= 4

#: The one lane of every source whose reads share state (:attr:`ReadPolicy.LOOP`), all datasets together:
#: serialised as on the loop (a mix and its member, served under two names, are one object), but off it.
SERIAL = ("serial", 1)

#: Batches of a source with :attr:`ReadPolicy.OVERLAP` (a pipeline) read at once.
OVERLAP_READS = 2

# REMOTE_READS (the ``remote_reads`` setting's default): batches of one remote dataset read at once.
# Each batch's own requests run concurrently too, within the dataset's and the host's caps
# (:mod:`.sources.storage.httprange`, :mod:`.sources.storage.objects`), so it only needs to cover the
# batches a few loaders keep in flight.


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

    def __init__(
        self, rings: RingUse, threaded: bool | None = None, threads: int = 1, name: str = "fill", lowered: bool = False
    ):
        self.rings = rings
        #: Its threads run below the serving loop's priority (a remote dataset's: :func:`lower_priority`).
        self.lowered = lowered
        self.threaded = FILL_THREAD if threaded is None else threaded
        self.threads, self.name = threads, name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def run(self, fill: Callable[..., Any], *args, ring: Ring | None = None) -> Any:
        """``fill(*args)``: its result here, or a Future of it from a thread of this filler's."""
        with self._lock:
            pool = self._pool
            if self.threaded and pool is None:
                pool = self._pool = ThreadPoolExecutor(
                    self.threads, thread_name_prefix=self.name, initializer=lower_priority if self.lowered else None
                )
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
    """The provider's fillers, over one :class:`RingUse`: the loop's thread, and each dataset's lanes
    (see the module doc), started on the dataset's first batch of that lane.

    ``fill_thread``: whether local ring fills leave the loop (default :data:`FILL_THREAD`);
    ``fill_threads``: their threads per dataset (0: one per core); ``remote_reads``: batches of one
    remote dataset read at once."""

    def __init__(self, fill_thread: bool | None = None, fill_threads: int = 0, remote_reads: int = REMOTE_READS):
        #: Rings are unmapped through this, once no fill writes into them.
        self.rings = RingUse()
        self.loop = Filler(self.rings, False, name="loop")
        self.fill_thread = FILL_THREAD if fill_thread is None else fill_thread
        self.fill_threads = fill_threads or usable_cores()
        self.remote_reads = max(1, remote_reads)
        self._lanes: dict[tuple[str, str], Filler] = {}
        self._lock = threading.Lock()
        self._closed = False

    def lane(self, source: Source, ring: Ring | None) -> tuple[str, int] | None:
        """The lane a batch of ``source`` into ``ring`` (``None``: the reply's frames) is read on, as
        ``(name, threads)``, or ``None`` for the loop's thread (see the module doc)."""
        policy = source.read_policy
        if policy is ReadPolicy.LOOP:  # reads share state, maybe with another dataset's (a mix's member)
            return SERIAL
        if source.remote:
            return "remote", self.remote_reads
        if policy is ReadPolicy.OVERLAP:
            return "overlap", OVERLAP_READS
        if source.gather and (ring is None or not self.fill_thread):
            return None
        return "fill", self.fill_threads

    def for_batch(self, dataset: str, source: Source, ring: Ring | None) -> Filler:
        """The filler a batch of ``dataset`` (served by ``source``) into ``ring`` is read on."""
        lane = self.lane(source, ring)
        if lane is None:
            return self.loop
        name, threads = lane
        key = ("", name) if lane is SERIAL else (dataset, name)
        with self._lock:
            filler = self._lanes.get(key)
            if filler is None:
                label = "-".join(filter(None, (name, key[0])))[:15]
                filler = Filler(self.rings, not self._closed, threads, label, lowered=name == "remote")
                self._lanes[key] = filler
            return filler

    def lanes(self) -> dict[str, dict[str, int]]:
        """``{dataset: {lane: threads}}`` of the lanes started so far (the provider's stats)."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            for (dataset, name), filler in self._lanes.items():
                out.setdefault(dataset or "*", {})[name] = filler.threads
        return out

    def close(self) -> None:
        """Stop every lane's threads after the reads under way (the fills under way finish first)."""
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
        for filler in lanes:
            filler.close()

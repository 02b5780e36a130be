"""Where a checked BatchRequest's batch is written, and the write itself.

A batch goes to one of two destinations: the reply's payload frames (:class:`Frames`), or the ring
slot the request names (:class:`Slot`, begun on the serving loop so that a stale slot is refused
before anything is read). :func:`write_batch` reads the batch from its source straight into the
destination, in either payload form (two fixed arrays ``x``/``y`` through ``Source.serve_into``, or
named fields through ``Source.read_fields``, encoded or packed by :mod:`libbus.wire.fields`), and
answers it; it runs on whichever thread :mod:`.fillers` picks.

A slot that no longer awaits its request (the trainer gave up on it and asked again, or scribbled on
its table) is refused in one place, :meth:`Slot._fresh`: when the fill begins, when the slot's memory
is taken, and when it is marked filled. Nothing is marked filled for a stale request.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypedDict, cast

import numpy as np

from libbus.constants import MAX_BATCH_BYTES, MAX_UNDECLARED_BATCH
from libbus.errors import BadRequest, BusError, ShmError, TooLarge, Unavailable
from libbus.serve.metrics import LatencyHistogram
from libbus.wire.fields import Field, FieldBatch, encode_frames, pack_slot
from libbus.wire.messages import BatchRequest, BatchResponse
from shm import Ring

from .sources import Source
from .sources.timing import BatchTiming, timed

__all__ = [
    "BatchCounters",
    "DatasetServed",
    "Destination",
    "Frames",
    "Slot",
    "batch_bytes",
    "check_batch_size",
    "write_batch",
]

#: Bytes of a variable field's index per sample beyond its shape dims: its offset (int64).
_INDEX_BYTES = 8


def _sample_bound(fields: list[Field]) -> int:
    """The most bytes one sample of ``fields`` can take in a batch: a fixed field's exact size, a
    variable field's declared ``max_bytes`` plus its index (offset and shape), and for a variable
    field that declares no maximum, its index only (the least it can take)."""
    total = 0
    for f in fields:
        if f.variable:
            total += f.max_bytes + _INDEX_BYTES * (1 + f.ndim)
        else:
            total += f.sample_nbytes
    return total


def batch_bytes(source: Source, fields: list[Field] | None, n: int) -> int:
    """The bytes a batch of ``n`` samples sent as frames holds: an x/y batch exactly, named fields at most
    (their declared maxima), never more than the batch limit."""
    per_sample = source.x_nbytes + source.y_nbytes if fields is None else _sample_bound(fields)
    return min(n * per_sample, MAX_BATCH_BYTES)


def check_batch_size(source: Source, fields: list[Field] | None, n: int) -> None:
    """Refuse (:class:`TooLarge`) a batch of ``n`` samples that would, or could, pass the batch limit,
    before anything is read: an x/y batch by its exact size, a batch of named fields by the most its
    fields declare (so the same request is refused or not whatever samples it names). A field that
    declares no maximum counts by its index alone, and such a batch holds at most
    :data:`MAX_UNDECLARED_BATCH` samples (its bytes are bounded again once encoded)."""
    if fields is None:
        per_sample, what = source.x_nbytes + source.y_nbytes, "bytes"
    else:
        per_sample, what = _sample_bound(fields), "bytes at most (the fields' declared maxima)"
        undeclared = [f.name for f in fields if f.variable and not f.max_bytes]
        if undeclared and n > MAX_UNDECLARED_BATCH:
            raise TooLarge(
                f"{n} samples: field(s) {', '.join(undeclared)} declare no max_bytes, so a batch holds at "
                f"most {MAX_UNDECLARED_BATCH} samples (the dataset's operator can declare max_bytes)"
            )
    if n * per_sample > MAX_BATCH_BYTES:
        raise TooLarge(
            f"{n} samples of {per_sample} {what} exceed the {MAX_BATCH_BYTES} byte batch limit; "
            f"ask for at most {MAX_BATCH_BYTES // max(per_sample, 1)} samples per batch"
        )


class DatasetServed(TypedDict, total=False):
    """What a provider served of one dataset since the start (its stats' ``datasets`` rows): each key
    appears once it is counted (``queue_s`` and ``fill_s`` with the first batch)."""

    batches: int
    samples: int
    bytes: int
    #: Batches written to a loader's shared-memory ring.
    shm_batches: int
    #: Evaluations of its private test split.
    evaluations: int
    #: Seconds batches waited before their read began.
    queue_s: float
    #: Seconds their reads took.
    fill_s: float


class BatchCounters:
    """What the provider counts of the batches it serves and refuses, written from the loop and the
    fill threads alike (under ``lock``, which ``stats()`` takes to read them)."""

    def __init__(self, datasets: Iterable[str], lock: threading.Lock):
        self.lock = lock
        #: dataset → batches, samples, bytes, shm_batches (and the evaluations the handler counts).
        self.served: dict[str, Counter] = defaultdict(Counter)
        #: dataset → seconds batches waited before their read began (``queue_s``) and took to read (``fill_s``).
        self.spent: dict[str, dict[str, float]] = defaultdict(lambda: {"queue_s": 0.0, "fill_s": 0.0})
        #: why → requests refused.
        self.refused: Counter = Counter()
        #: dataset → time to assemble a batch; keyed only by datasets served here (bounded labels).
        self.latency: dict[str, LatencyHistogram] = {name: LatencyHistogram() for name in datasets}

    def datasets(self) -> dict[str, DatasetServed]:
        """What was served of each dataset (under ``lock``, which the caller holds)."""
        return {
            name: cast(DatasetServed, {**c, **self.spent.get(name, {})})  # Counter keys: those counted
            for name, c in self.served.items()
        }

    def refuse(self, why: str) -> None:
        with self.lock:
            self.refused[why] += 1

    def serve(
        self, msg: BatchRequest, reply: BatchResponse, n: int, started: float, queue_s: float = 0.0, fill_s: float = 0.0
    ) -> BatchResponse:
        """Count ``reply``, a batch of ``n`` samples asked for at ``started`` (``perf_counter``) that
        waited ``queue_s`` before its read began and took ``fill_s`` to read."""
        with self.lock:
            counters = self.served[msg.dataset]
            if msg.slot is not None:
                counters["shm_batches"] += 1
            counters["batches"] += 1
            counters["samples"] += n
            counters["bytes"] += reply.nbytes
            spent = self.spent[msg.dataset]
            spent["queue_s"] += queue_s
            spent["fill_s"] += fill_s
            self.latency[msg.dataset].observe(time.perf_counter() - started)
        return reply


class Destination(ABC):
    """Where the batch of ``msg`` is written; counts what it serves and refuses in ``counters``."""

    #: The ring the batch is written into (held open by the filler while it writes), or ``None``.
    ring: Ring | None = None

    def __init__(self, msg: BatchRequest, counters: BatchCounters):
        self.msg, self.counters = msg, counters

    @abstractmethod
    def arrays(self, n: int, source: Source) -> tuple[np.ndarray, np.ndarray]:
        """Arrays for ``n`` samples and labels of an x/y ``source``, for it to read into."""

    @abstractmethod
    def pack(self, fields: list[Field], batch: FieldBatch, n: int) -> tuple[list, list, list, int]:
        """Write a batch of named fields here: ``(frames, shapes, dtypes, nbytes)`` of its reply."""

    def done(
        self, reply: BatchResponse, n: int, started: float, queue_s: float = 0.0, fill_s: float = 0.0
    ) -> BatchResponse:
        """The batch of ``reply`` (``n`` samples asked for at ``started``, queued ``queue_s`` and read in
        ``fill_s``) is written: counted, answered."""
        return self.counters.serve(self.msg, reply, n, started, queue_s, fill_s)

    @contextmanager
    def _declared(self) -> Iterator[None]:
        """A batch of named fields beyond the declared maxima, the slot or the batch limit is
        ``TOO_LARGE`` naming the field and sizes; one that is not what its fields declare (a source
        serving what it does not say) ``BAD_REQUEST``."""
        where = f"{self.msg.dataset}/{self.msg.split}"
        try:
            yield
        except TooLarge as err:
            self.counters.refuse("too_large")
            raise TooLarge(f"{where}: {err}") from err
        except BusError as err:
            raise BadRequest(f"{where}: {err}") from err


class Frames(Destination):
    """The reply's payload frames: the batch is read into fresh arrays and sent over the socket."""

    def arrays(self, n: int, source: Source) -> tuple[np.ndarray, np.ndarray]:
        return np.empty((n, *source.sample_shape), source.dtype), np.empty((n, *source.label_shape), source.label_dtype)

    def pack(self, fields: list[Field], batch: FieldBatch, n: int) -> tuple[list, list, list, int]:
        with self._declared():
            frames, shapes, dtypes, nbytes = encode_frames(fields, batch, n)
            if nbytes > MAX_BATCH_BYTES:
                raise TooLarge(f"a batch of {n} samples is {nbytes} bytes; the batch limit is {MAX_BATCH_BYTES}")
        return frames, shapes, dtypes, nbytes


class Slot(Destination):
    """Slot ``slot`` of the session's ``ring``, while it awaits request ``seq``; the reply carries no frames."""

    ring: Ring

    def __init__(self, msg: BatchRequest, counters: BatchCounters, ring: Ring, slot: int, seq: int):
        super().__init__(msg, counters)
        self.ring, self.slot, self.seq = ring, slot, seq

    @classmethod
    def begin(cls, msg: BatchRequest, counters: BatchCounters, ring: Ring | None) -> Slot:
        """The slot ``msg`` names in the session's ``ring``, marked as being filled; a stale one
        refused (``batch not written``). Raises :class:`BadRequest`."""
        if msg.slot is None or msg.seq is None:
            raise BadRequest("BatchRequest names a ring slot with both 'slot' and 'seq', or neither")
        if ring is None:
            raise BadRequest("BatchRequest names a ring slot but this session attached no ring (send AttachRing first)")
        slot = cls(msg, counters, ring, msg.slot, msg.seq)
        with slot._fresh():
            ring.begin_fill(slot.slot, slot.seq)
        return slot

    def arrays(self, n: int, source: Source) -> tuple[np.ndarray, np.ndarray]:
        x_shape, y_shape = (n, *source.sample_shape), (n, *source.label_shape)
        with self._fresh():  # a batch that does not fit the slot is refused as a stale one is
            return self.ring.views(self.slot, x_shape, source.dtype, y_shape, source.label_dtype)

    def pack(self, fields: list[Field], batch: FieldBatch, n: int) -> tuple[list, list, list, int]:
        with self._fresh(), self.ring.slot_buffer(self.slot) as buf, self._declared():
            shapes, dtypes, nbytes = pack_slot(fields, batch, n, buf)
        return [], shapes, dtypes, nbytes

    def done(
        self, reply: BatchResponse, n: int, started: float, queue_s: float = 0.0, fill_s: float = 0.0
    ) -> BatchResponse:
        with self._fresh():  # the trainer may have moved on while the slot was written
            self.ring.finish_fill(self.slot, self.seq)
        reply.frames = []  # the batch is in the slot
        return super().done(reply, n, started, queue_s, fill_s)

    @contextmanager
    def _fresh(self) -> Iterator[None]:
        """The stale-slot check: a ring refusing this request's slot is ``BAD_REQUEST`` (``batch not
        written``), counted ``stale_slot``."""
        try:
            yield
        except ShmError as err:
            self.counters.refuse("stale_slot")
            raise BadRequest(f"batch not written: {err}") from err


def write_batch(
    source: Source,
    msg: BatchRequest,
    indices: np.ndarray,
    dest: Destination,
    fields: list[Field] | None,
    started: float,
    ended: Callable[[], bool] | None = None,
) -> BatchResponse:
    """Read the samples ``indices`` of ``msg.split`` from ``source`` into ``dest`` and answer them:
    an x/y batch (``fields`` is ``None``) straight into the destination's arrays, a batch of named
    ``fields`` read whole, then encoded or packed. Raises what the source raises, and
    ``BAD_REQUEST``/``TOO_LARGE`` for a stale slot or a batch that does not fit.

    The time from ``started`` (the serving loop took the request) to here is the batch's queueing,
    from here to the end of the read its fill; a request that asks for its timing gets both in the
    reply, the fill split by the source (:mod:`.sources.timing`). ``ended()`` true: the session that
    asked has ended while the batch waited, and it is not read (``UNAVAILABLE``)."""
    if ended is not None and ended():
        raise Unavailable("the session that asked for this batch has ended; it was not read")
    began = time.perf_counter()
    n = len(indices)
    timing = BatchTiming() if msg.timing else None
    with timed(timing):
        if fields is None:
            x, y = dest.arrays(n, source)
            source.serve_into(msg.split, indices, x, y, epoch=msg.epoch)
            filled = time.perf_counter()
            shapes, dtypes, nbytes = [list(x.shape), list(y.shape)], [x.dtype.str, y.dtype.str], x.nbytes + y.nbytes
            frames, names = [x.data, y.data], None
        else:
            batch = source.read_fields(msg.split, indices, msg.epoch)
            filled = time.perf_counter()
            frames, shapes, dtypes, nbytes = dest.pack(fields, batch, n)
            names = [f.name for f in fields]
    queue_s, fill_s = began - started, filled - began
    reply = BatchResponse(
        shapes=shapes,
        dtypes=dtypes,
        nbytes=nbytes,
        names=names,
        slot=msg.slot,
        seq=msg.seq,
        frames=frames,
        timing=dict(timing.reply(queue_s, fill_s)) if timing is not None else None,  # the message's JSON object
    )
    return dest.done(reply, n, started, queue_s, fill_s)

"""A ring of equal batch slots in one shared-memory segment, with its slot protocol.

Layout (little-endian)::

    0     header: magic, version, slots, slot_bytes, label_offset, creator pid, creator start time
    64    slot table: per slot (state u64, seq u64)
    4096  slot 0 | slot 1 | ...   each page-aligned; data at 0, labels at ``label_offset``
                                  (or, for a batch of named fields, each field's index and
                                  values back to back from 0: :meth:`Ring.slot_buffer`)

A slot moves ``FREE → REQUESTED → FILLED → IN_USE → FREE``. The consumer (the trainer, who created
the ring) requests a slot under a fresh sequence number and names both in its BatchRequest; the
producer (the provider) writes only into a slot that is ``REQUESTED`` under *that* sequence number,
and checks again before marking it ``FILLED``. So a late or duplicate request — one the consumer
has given up on and resent under a new number, or one it sends twice — can never write into a slot
the consumer is reading.

Each field has one writer at a time: the consumer moves FREE→REQUESTED and FILLED→IN_USE→FREE, the
producer REQUESTED→FILLED, and a ring has one producer, which fills one request at a time. Aligned
8-byte stores are atomic on the platforms we run on, and the request and reply messages that travel
between the two processes order the stores on either side.
"""

from __future__ import annotations

import math
import os
import stat
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import numpy as np

from shm.errors import ShmError

from .names import SHM_DIR, new_name, path_of, process_start
from .segment import Segment

__all__ = ["HEADER", "MAGIC", "VERSION", "Ring", "RingLayout", "SlotState", "read_header"]

MAGIC = b"BBRING\x00\x00"
VERSION = 1
#: The header's layout (see the module doc): magic, version, slots, slot_bytes, label_offset, pid, start.
HEADER = struct.Struct("<8sIIQQQQ")
_TABLE_OFFSET = 64
_PAGE = 4096
#: Sanity bounds on what a peer may ask us to map.
MAX_SLOTS = 64
MAX_SLOT_BYTES = 1 << 30


class SlotState(IntEnum):
    """Where a slot is in its cycle. ``FREE`` is 0: a fresh segment is all zeros."""

    FREE = 0
    REQUESTED = 1
    FILLED = 2
    IN_USE = 3


def _state_name(word: int) -> str:
    """A slot-table state word as a name; a word no state has (a peer scribbled on the table) as such."""
    try:
        return SlotState(word).name.lower()
    except ValueError:
        return f"in unknown state {word}"


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class RingLayout:
    """The geometry both sides must agree on before a byte is written."""

    slots: int
    slot_bytes: int
    label_offset: int

    def check(self) -> None:
        """Raise :class:`ShmError` unless the geometry is sane."""
        if not 1 <= self.slots <= MAX_SLOTS:
            raise ShmError(f"ring slots must be 1..{MAX_SLOTS}, got {self.slots}")
        if not 1 <= self.slot_bytes <= MAX_SLOT_BYTES:
            raise ShmError(f"ring slot_bytes must be 1..{MAX_SLOT_BYTES}, got {self.slot_bytes}")
        if not 0 <= self.label_offset <= self.slot_bytes or self.label_offset % 64:
            raise ShmError(
                f"ring label_offset {self.label_offset} must be a multiple of 64 within the {self.slot_bytes}-byte slot"
            )

    @property
    def stride(self) -> int:
        return _round_up(self.slot_bytes, _PAGE)

    @property
    def data_offset(self) -> int:
        return _round_up(_TABLE_OFFSET + 16 * self.slots, _PAGE)

    @property
    def size(self) -> int:
        return self.data_offset + self.slots * self.stride

    @classmethod
    def for_batch(cls, slots: int, x_bytes: int, y_bytes: int) -> RingLayout:
        """A layout whose slots hold ``x_bytes`` of data and ``y_bytes`` of labels."""
        label_offset = _round_up(max(x_bytes, 1), 64)
        return cls(slots, label_offset + max(y_bytes, 1), label_offset)


def _view(buf, offset: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """An array over ``buf[offset:]`` that pins the mapping while it lives.

    Through a memoryview, not ``np.ndarray(buffer=mmap)``: numpy releases the buffer it was given
    right away, so an mmap could be closed under a live array (a segfault on the next access). A
    memoryview holds its export until it is garbage, and the array holds the memoryview.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    return np.frombuffer(memoryview(buf)[offset : offset + nbytes], dtype=dtype).reshape(shape)


def read_header(path: Path) -> dict[str, int] | None:
    """The header fields of the ring file at ``path``, or ``None`` if it is not a ring."""
    try:
        # O_NONBLOCK: anyone may plant a FIFO in /dev/shm, and a plain open of one blocks forever.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.pread(fd, HEADER.size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) < HEADER.size:
        return None
    magic, version, slots, slot_bytes, label_offset, pid, start = HEADER.unpack(raw)
    if magic != MAGIC:
        return None
    return {
        "version": version,
        "slots": slots,
        "slot_bytes": slot_bytes,
        "label_offset": label_offset,
        "pid": pid,
        "start": start,
    }


class Ring:
    """A mapped ring. Create it in the consumer (:meth:`create`), attach in the producer."""

    def __init__(self, segment: Segment, layout: RingLayout):
        self.segment = segment
        self.layout = layout
        self.name = segment.name
        # (state, seq) per slot as native uint64 words: a memoryview, whose item access costs a
        # fraction of a numpy scalar's, and this table is touched several times per batch.
        self._table = memoryview(segment.mapping())[_TABLE_OFFSET : _TABLE_OFFSET + 16 * layout.slots].cast("Q")
        self._closed = False
        self._next_seq = 1
        # Views are made once per (slot, shapes, dtypes) and reused: building them costs more than
        # the rest of a small batch's bookkeeping. They hold the mapping until close() drops them.
        self._views: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    # -- creating and attaching -------------------------------------------------------------------
    @classmethod
    def create(cls, layout: RingLayout, *, name: str | None = None, shm_dir: Path = SHM_DIR) -> Ring:
        """Create a ring of ``layout`` under a fresh name. Raises :class:`ShmError`."""
        layout.check()
        segment = Segment.create(name or new_name(), layout.size, shm_dir)
        pid = os.getpid()
        HEADER.pack_into(
            segment.mapping(),
            0,
            MAGIC,
            VERSION,
            layout.slots,
            layout.slot_bytes,
            layout.label_offset,
            pid,
            process_start(pid) or 0,
        )
        return cls(segment, layout)

    @classmethod
    def attach(cls, name: str, layout: RingLayout, *, shm_dir: Path = SHM_DIR) -> Ring:
        """Attach ring ``name``, refusing it unless its header and size match ``layout``.

        Raises :class:`ShmError` naming what differs.
        """
        layout.check()
        segment = Segment.attach(name, shm_dir)
        try:
            segment.check_size()  # shrunk since it was mapped: reading the header would be SIGBUS
            if segment.size < HEADER.size:
                raise ShmError(f"{name}: {segment.size} bytes is too small for a ring header")
            magic, version, slots, slot_bytes, label_offset, _, _ = HEADER.unpack_from(segment.mapping(), 0)
            if magic != MAGIC:
                raise ShmError(f"{name}: bad magic {magic!r}; not a batchbus ring")
            if version != VERSION:
                raise ShmError(f"{name}: ring version {version}; this build speaks {VERSION}")
            found = RingLayout(slots, slot_bytes, label_offset)
            if found != layout:
                raise ShmError(f"{name}: header says {found}, the request says {layout}")
            if segment.size != layout.size:
                raise ShmError(f"{name}: segment is {segment.size} bytes; {layout} needs {layout.size}")
        except ShmError:
            segment.close()
            raise
        segment.populate()  # checked: now map its pages, not one fault per page in the first pass
        return cls(segment, layout)

    @staticmethod
    def path(name: str, shm_dir: Path = SHM_DIR) -> Path:
        return path_of(name, shm_dir)

    # -- slot table -------------------------------------------------------------------------------
    def state(self, slot: int) -> SlotState:
        return SlotState(self._table[2 * slot])

    def seq(self, slot: int) -> int:
        return self._table[2 * slot + 1]

    def _check_slot(self, slot: int) -> None:
        """Before any access to the ring's memory: open, ``slot`` in range, and (an attacher) the
        file not shrunk under the mapping (:meth:`Segment.check_size`: the table and the slot would
        be SIGBUS)."""
        if self._closed:
            raise ShmError(f"ring {self.name} is closed")
        if not 0 <= slot < self.layout.slots:
            raise ShmError(f"slot {slot} outside ring {self.name} of {self.layout.slots} slots")
        self.segment.check_size()

    def _expect(self, slot: int, seq: int | None, *states: SlotState) -> None:
        self._check_slot(slot)
        # raw words, compared as ints: a SlotState is made only for the message (this runs
        # twice per batch on each side, and an enum lookup costs more than the rest of it)
        state, current = self._table[2 * slot], self._table[2 * slot + 1]
        if state not in states or (seq is not None and current != seq):
            want = "/".join(s.name.lower() for s in states)
            raise ShmError(
                f"slot {slot} of {self.name} is {_state_name(state)} under sequence "
                f"{current}; expected {want}" + (f" under {seq}" if seq is not None else "")
            )

    # consumer side
    def request(self, slot: int) -> int:
        """Claim ``slot`` for a new request and return its sequence number.

        The slot may be free, or hold a request the consumer is giving up on: still requested, or
        already filled by a provider whose reply was lost with the old connection. Never in use.
        """
        self._expect(slot, None, SlotState.FREE, SlotState.REQUESTED, SlotState.FILLED)
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        self._table[2 * slot + 1] = seq
        self._table[2 * slot] = SlotState.REQUESTED
        return seq

    def take(self, slot: int, seq: int) -> None:
        """A reply says ``slot`` holds request ``seq``: check that, and mark it in use."""
        self._expect(slot, seq, SlotState.FILLED)
        self._table[2 * slot] = SlotState.IN_USE

    def release(self, slot: int) -> None:
        """The consumer is done with ``slot``."""
        self._check_slot(slot)
        self._table[2 * slot] = SlotState.FREE

    # producer side
    def begin_fill(self, slot: int, seq: int) -> None:
        """Check that ``slot`` awaits request ``seq``: raises :class:`ShmError` for a stale one."""
        self._expect(slot, seq, SlotState.REQUESTED)

    def finish_fill(self, slot: int, seq: int) -> None:
        """Mark ``slot`` filled, if it still awaits ``seq`` (the consumer may have moved on)."""
        self._expect(slot, seq, SlotState.REQUESTED)
        self._table[2 * slot] = SlotState.FILLED

    # -- data -------------------------------------------------------------------------------------
    def views(self, slot: int, x_shape: tuple, x_dtype, y_shape: tuple, y_dtype) -> tuple[np.ndarray, np.ndarray]:
        """Numpy arrays over ``slot``'s data and label areas. Raises :class:`ShmError` if they do not fit."""
        self._check_slot(slot)
        key = (slot, x_shape, x_dtype, y_shape, y_dtype)
        cached = self._views.get(key)
        if cached is not None:
            return cached
        if self.segment.buf is None:
            raise ShmError(f"ring {self.name} is closed")
        x_dtype, y_dtype = np.dtype(x_dtype), np.dtype(y_dtype)
        x_bytes = math.prod(x_shape) * x_dtype.itemsize
        y_bytes = math.prod(y_shape) * y_dtype.itemsize
        lay = self.layout
        if x_bytes > lay.label_offset or y_bytes > lay.slot_bytes - lay.label_offset:
            raise ShmError(
                f"a batch of {x_bytes} + {y_bytes} bytes does not fit slots of "
                f"{lay.label_offset} + {lay.slot_bytes - lay.label_offset} bytes"
            )
        base = lay.data_offset + slot * lay.stride
        views = (
            _view(self.segment.buf, base, x_shape, x_dtype),
            _view(self.segment.buf, base + lay.label_offset, y_shape, y_dtype),
        )
        if len(self._views) > 16 * lay.slots:  # a pass's last, short batch adds shapes: stay bounded
            self._views.clear()
        self._views[key] = views
        return views

    def slot_buffer(self, slot: int) -> memoryview:
        """The bytes of ``slot`` (all ``slot_bytes`` of them), for batches of named fields packed
        from the slot's start (:mod:`libbus.wire.fields`). Release it (``with``) when done: a live
        export keeps the mapping from being closed."""
        self._check_slot(slot)
        if self.segment.buf is None:
            raise ShmError(f"ring {self.name} is closed")
        base = self.layout.data_offset + slot * self.layout.stride
        return memoryview(self.segment.buf)[base : base + self.layout.slot_bytes]

    def close(self) -> None:
        """Unmap (once no views are alive), and unlink if this process created the ring."""
        if not self._closed:
            self._table.release()  # a released view refuses every access
            self._closed = True
        self._views.clear()
        owner = self.segment.owner
        self.segment.close()
        if owner:
            self.segment.unlink()

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

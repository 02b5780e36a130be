"""Positional, coalescing reads of fixed-size records from files, straight into caller buffers.

A :class:`ByteSpace` lays parts of files end to end (the CIFAR batches, a run of token shards) and
reads any byte range of it with ``os.preadv``, splitting a read at file boundaries. :class:`Records`
sees a byte space as fixed-size records holding one or more fields (CIFAR: a label byte then 3072
pixel bytes) and gathers the records a batch names into one destination buffer per field.

Why ``preadv`` and not ``np.memmap``: pages read with ``pread`` live in the page cache, which the
kernel reclaims freely and which never counts as the process's resident memory; mapped pages do. A
provider that streams a dataset larger than its RAM budget so keeps its RSS at the size of the
batches in flight.

A segment may also be a byte range of a file behind HTTP (:mod:`.httprange`): the same layouts then read
it with one Range request per contiguous run, the runs of one batch fetched concurrently.
"""

from __future__ import annotations

import bisect
import os
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from libbus.errors import DatasetError

__all__ = [
    "COALESCE_BYTES",
    "ByteSpace",
    "Records",
    "Remote",
    "RemoteClient",
    "OpenFiles",
    "Segment",
    "coalesce",
    "read_at",
    "read_spaces",
]

#: Most buffers one ``preadv`` call takes (Linux: 1024).
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024

#: Runs of one remote file at most this many bytes apart are fetched as one request, the bytes between
#: them read into scratch and dropped: a store's first byte costs a round trip (10-100 ms), in which a
#: link moves far more than this, and a request saved is a slot of the dataset's concurrency freed.
COALESCE_BYTES = 64 << 10


class RemoteClient(Protocol):
    """What reads remote files (an HTTP client)."""

    def read_runs(self, runs: list[tuple[Any, int, list[memoryview]]]) -> None:
        """Fill each run's buffers with the bytes of its file from its offset on, all runs before
        returning (concurrently where it can). Raises :class:`DatasetError`. Each run's file is a
        :class:`Remote` of this client's own kind (a client reads only its own: runs are grouped by client)."""


class Remote(Protocol):
    """A file read by byte ranges from somewhere else (an HTTP URL), through its client."""

    @property
    def client(self) -> RemoteClient: ...


@dataclass(frozen=True)
class Segment:
    """``length`` bytes of the open file ``fd`` (called ``name`` in messages) from ``offset``; or,
    with ``remote`` set (and ``fd`` -1), of that remote file."""

    name: str
    fd: int
    offset: int
    length: int
    remote: Remote | None = None


def read_at(seg: Segment, nbytes: int, at: int = 0) -> bytes:
    """Up to ``nbytes`` of ``seg`` from its byte ``at`` (fewer at its end): headers, small reads."""
    nbytes = max(0, min(nbytes, seg.length - at))
    if seg.remote is None:
        return os.pread(seg.fd, nbytes, seg.offset + at)
    buf = bytearray(nbytes)
    if nbytes:
        seg.remote.client.read_runs([(seg.remote, seg.offset + at, [memoryview(buf)])])
    return bytes(buf)


class ByteSpace:
    """Segments of files laid end to end into one address space, read by position."""

    def __init__(self, segments: list[Segment]):
        self.segments = [s for s in segments if s.length > 0]
        self.starts = []
        pos = 0
        for seg in self.segments:
            self.starts.append(pos)
            pos += seg.length
        self.size = pos

    def readv(self, offset: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` in turn with the bytes from ``offset`` on.

        Raises :class:`DatasetError` when the range runs past the end of the space or a file turns
        out shorter than when it was opened.
        """
        self.read_runs([(offset, buffers)])

    def read_runs(self, runs: list[tuple[int, list[memoryview]]]) -> None:
        """:meth:`readv` for each ``(offset, buffers)`` run (:func:`read_spaces` of this space alone)."""
        read_spaces([(self, runs)])

    def blocks(self, offsets: np.ndarray, length: int, block: int) -> list[tuple[Any, int]]:
        """The ``(remote file, block number)`` pairs that ``length`` bytes from each of ``offsets`` (in the
        space) lie in, blocks of ``block`` bytes of each file, each once, in the order first needed. Local
        files have none."""
        out: dict[tuple[int, int], tuple[Any, int]] = {}
        first = np.searchsorted(self.starts, offsets, side="right") - 1
        last = np.searchsorted(self.starts, offsets + max(length, 1) - 1, side="right") - 1
        for at, i, j in zip(np.asarray(offsets).tolist(), first.tolist(), last.tolist()):
            for k in range(max(i, 0), j + 1):
                seg, seg_at = self.segments[k], self.starts[k]
                if seg.remote is None:
                    continue
                a = max(at, seg_at) - seg_at + seg.offset
                b = min(at + length, seg_at + seg.length) - seg_at + seg.offset
                for n in range(a // block, (b - 1) // block + 1):
                    out.setdefault((id(seg.remote), n), (seg.remote, n))
        return list(out.values())

    def remote_pieces(self, runs: list[tuple[int, list[memoryview]]], remote: dict[int, list]) -> None:
        """Read the runs' pieces in local files now; add those of remote files to ``remote`` (by client)."""
        for offset, buffers in runs:
            for i, at, piece in self._pieces(offset, buffers):
                seg = self.segments[i]
                if seg.remote is None:
                    _pread(seg, seg.offset + at - self.starts[i], piece)
                else:
                    remote.setdefault(id(seg.remote.client), []).append(
                        (seg.remote, seg.offset + at - self.starts[i], piece)
                    )

    def _pieces(self, offset: int, buffers: list[memoryview]):
        """``(segment number, offset in the space, buffers)`` per stretch of one segment (local
        stretches also cut at ``IOV_MAX`` buffers)."""
        total = sum(len(b) for b in buffers)
        if offset < 0 or offset + total > self.size:
            raise DatasetError(
                f"read of {total} bytes at {offset} is outside the {self.size} bytes of "
                f"{', '.join(s.name for s in self.segments)}"
            )
        i = bisect.bisect_right(self.starts, offset) - 1
        batch: list[memoryview] = []
        pos, batch_at = offset, offset
        for buf in buffers:
            while len(buf):
                seg_end = self.starts[i] + self.segments[i].length
                if pos == seg_end:  # this segment is done: flush, move to the next file
                    if batch:
                        yield i, batch_at, batch
                    i, batch, batch_at = i + 1, [], pos
                    continue
                n = min(len(buf), seg_end - pos)
                batch.append(buf[:n])
                buf, pos = buf[n:], pos + n
                if len(batch) == IOV_MAX and self.segments[i].remote is None:
                    yield i, batch_at, batch
                    batch, batch_at = [], pos
        if batch:
            yield i, batch_at, batch


def read_spaces(reads: list[tuple[ByteSpace, list[tuple[int, list[memoryview]]]]]) -> None:
    """Each ``(space, runs)``'s runs, as :meth:`ByteSpace.readv` reads one: local files in turn, and the
    pieces of remote files of every space handed to their client together, so that one batch's ``x``
    and ``y`` files (or all of a record's field files) are fetched side by side, not one after the other."""
    remote: dict[int, list] = {}
    for space, runs in reads:
        space.remote_pieces(runs, remote)
    for pieces in remote.values():
        pieces[0][0].client.read_runs(pieces)


def coalesce(pieces: list[tuple[Any, int, list[memoryview]]], gap: int = COALESCE_BYTES) -> list:
    """``(remote file, offset, buffers)`` pieces, those of one file at most ``gap`` bytes apart merged
    into one piece (the bytes between them land in a scratch buffer), by file (in the order they first
    appear) and offset. Pieces
    that overlap (a batch naming a sample twice) stay apart."""
    out: list[tuple[Any, int, list[memoryview]]] = []
    first: dict[int, int] = {}  # files in the order they first appear: the same request order every time
    for p in pieces:
        first.setdefault(id(p[0]), len(first))
    ordered = sorted(pieces, key=lambda p: (first[id(p[0])], p[1]))
    file, start, end, buffers = None, 0, 0, []
    for f, offset, bufs in ordered:
        if f is file and 0 <= offset - end <= gap:
            if offset > end:
                buffers.append(memoryview(bytearray(offset - end)))
        else:
            if file is not None:
                out.append((file, start, buffers))
            file, start, end, buffers = f, offset, offset, []
        buffers.extend(bufs)
        end = offset + sum(len(b) for b in bufs)
    if file is not None:
        out.append((file, start, buffers))
    return out


def _pread(seg: Segment, offset: int, buffers: list[memoryview]) -> None:
    while buffers:
        got = os.preadv(seg.fd, buffers, offset)
        if got == 0:
            raise DatasetError(
                f"{seg.name}: unexpected end of file at byte {offset}; the file was truncated after it was opened"
            )
        offset += got
        # a short read (a signal, or over 2 GiB at once): drop what is full, resume in the rest
        while buffers and got >= len(buffers[0]):
            got -= len(buffers[0])
            buffers = buffers[1:]
        if buffers and got:
            buffers = [buffers[0][got:], *buffers[1:]]


class Records:
    """``count`` records of ``record`` bytes from ``base`` in a :class:`ByteSpace`.

    ``fields`` are ``(offset, nbytes)`` within a record, in offset order, not overlapping; bytes
    between them are read into a scratch buffer (one read per run beats skipping a byte).
    """

    def __init__(self, space: ByteSpace, base: int, record: int, count: int, fields: list[tuple[int, int]]):
        self.space, self.base, self.record, self.count = space, base, record, count
        self.fields = fields
        # the record as pieces: (field number or None for a gap, nbytes)
        self.pieces: list[tuple[int | None, int]] = []
        at = 0
        for f, (off, nbytes) in enumerate(fields):
            if off > at:
                self.pieces.append((None, off - at))
            self.pieces.append((f, nbytes))
            at = off + nbytes
        if at < record:
            self.pieces.append((None, record - at))
        self.scratch = memoryview(bytearray(max(n for _, n in self.pieces)))
        self.whole = len(fields) == 1 and fields[0] == (0, record)

    def gather(self, indices: np.ndarray, dests: list[memoryview | None]) -> None:
        """Row ``r`` of field ``f`` in ``dests[f]`` (flat bytes) gets field ``f`` of record ``indices[r]``
        (the reads of :meth:`runs`)."""
        self.space.read_runs(self.runs(indices, dests))

    def runs(self, indices: np.ndarray, dests: list[memoryview | None]) -> list[tuple[int, list[memoryview]]]:
        """The ``(offset in the space, buffers)`` reads that put field ``f`` of record ``indices[r]`` in
        row ``r`` of ``dests[f]`` (flat bytes).

        Indices are visited in file order; each run of consecutive records is one ``preadv`` (or
        one HTTP Range request) that scatters straight into the destination rows, wherever they are (argsort maps them back), so
        unsorted and duplicate indices cost no temporary copy. A ``None`` destination is skipped.
        """
        n = len(indices)
        if n == 0:
            return []
        order = np.argsort(indices, kind="stable")
        ordered = indices[order]
        new_run = np.diff(ordered) != 1  # the next sample is not adjacent on disk
        run_ends = np.flatnonzero(new_run) + 1
        if self.whole and dests[0] is not None:
            # one buffer per stretch that is consecutive both on disk and in the destination, found
            # without a Python object per row: a sorted request is a single buffer, a single read
            dest, w = dests[0], self.record
            cuts = np.flatnonzero(new_run | (np.diff(order) != 1)) + 1
            firsts = np.r_[0, cuts].astype(np.int64)
            stretches = zip(firsts.tolist(), np.r_[cuts, n].tolist(), order[firsts].tolist())
            run_at = set(run_ends.tolist())
            buffers: list[memoryview] = []
            runs = [(self.base + int(ordered[0]) * w, buffers)]
            for a, b, row in stretches:
                if a in run_at:
                    buffers = []
                    runs.append((self.base + int(ordered[a]) * w, buffers))
                buffers.append(dest[row * w : (row + b - a) * w])
            return runs
        rows_all = order.tolist()
        ends = run_ends.tolist()
        runs = []
        for a, b in zip([0, *ends], [*ends, n]):
            buffers = []
            for r in rows_all[a:b]:
                for f, nbytes in self.pieces:
                    into = dests[f] if f is not None else None
                    buffers.append(self.scratch[:nbytes] if into is None else into[r * nbytes : (r + 1) * nbytes])
            runs.append((self.base + int(ordered[a]) * self.record, buffers))
        return runs


class OpenFiles:
    """Read-only descriptors of a dataset's local files, each opened on its first read and kept until
    :meth:`close`: a shard read thousands of times a second is opened once, and since ``os.pread`` takes
    its own offset, every reading thread shares the one descriptor."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: os.PathLike[str] | str) -> int:
        key = os.fspath(path)
        with self._lock:
            if key not in self._fds:
                self._fds[key] = os.open(key, os.O_RDONLY | os.O_CLOEXEC)
            return self._fds[key]

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

"""A file-backed :class:`Source`: a format's :class:`Layout` (where each split's bytes are) served
from RAM or streamed with positional reads, with val carved from train where the files have none.

Val carving: when the files hold no val split, val is the last ``val_fraction`` of train in file
order (a fixed tail, ``round(n * val_fraction)`` samples) and train is the rest. A tail keeps both
splits contiguous on disk, costs no memory, and is the same on every open of the same files.
"""

from __future__ import annotations

import bisect
import os
import stat
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from libbus.errors import DatasetError

from ..base import ReadPolicy, Source, SourceInfo, relative_name
from ..storage.confine import Confinement
from ..storage.reader import ByteSpace, Records, Segment, read_spaces
from . import val_carve
from .dataset_toml import DatasetSettings

__all__ = ["MEMORY_MODES", "Context", "FilePath", "FileSource", "Gatherer", "Layout", "Table", "usable_cores"]

MEMORY_MODES = ("auto", "ram", "stream")
#: ``memory=auto`` keeps a dataset in RAM only below both this and a quarter of MemAvailable.
RAM_CAP_BYTES = 2 << 30
#: Bytes read per step when loading into RAM or scanning labels: bounds the temporaries.
CHUNK_BYTES = 64 << 20


class FilePath(Protocol):
    """A file a layout names under its root: a local :class:`~pathlib.Path`, or a remote location's own
    path (an HTTP listing's, an object store's), which has the part of ``Path`` layouts use."""

    @property
    def name(self) -> str: ...


class Context:
    """What a format opener gets: the directory, the settings, and the files it opens (closed by
    the source, or here when opening fails). Remote locations override :meth:`segment`."""

    def __init__(
        self,
        uri: str,
        root: Path,
        cache_dir: Path,
        settings: DatasetSettings,
        toml: dict,
        allowed: tuple[Path, ...] = (),
        location=None,
    ):
        self.uri, self.root, self.cache_dir = uri, root, cache_dir
        #: The :class:`~.location.Location` the files are read from (``None``: plain local files).
        self.location = location
        self.settings = settings  # query over dataset.toml: seq_len, token_bytes, vocab_size, ...
        self.toml = toml
        self.fds: list[int] = []
        #: Where the files this dataset opens may really be (symlinks resolved): its directory, its
        #: cache, and what the operator allowed (``?allow_paths=``). Empty: anywhere.
        self.confinement = Confinement(root, allowed)

    def segment(self, path: FilePath, offset: int = 0, length: int | None = None, name: str | None = None) -> Segment:
        """Open ``path`` (once per call) and describe ``length`` bytes of it from ``offset``. Each context
        opens the files of its own location (here: local files)."""
        if not isinstance(path, Path):
            raise DatasetError(f"{path}: not a local file")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise DatasetError(f"{path}: cannot open it: {err.strerror}") from err
        self.fds.append(fd)
        self.confinement.check_fd(path, fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DatasetError(f"{path}: not a regular file")
        size = st.st_size
        return Segment(name or str(path), fd, offset, size - offset if length is None else length)

    def close(self) -> None:
        _close_all(self.fds)


def _close_all(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


@dataclass
class Table:
    """One split as stored: ``count`` samples whose x and y bytes lie in record files. Each part
    is a :class:`Records` whose fields feed ``"x"``, ``"y"`` or nothing (``None``)."""

    count: int
    parts: list[tuple[Records, list[str | None]]]
    label_name: str = ""  # the file the labels come from, for messages

    @classmethod
    def single(cls, segment: Segment, count: int, nbytes: int, column: str) -> tuple[Records, list]:
        """A part: ``count`` back-to-back records of ``nbytes`` in one segment, feeding ``column``."""
        return Records(ByteSpace([segment]), 0, nbytes, count, [(0, nbytes)]), [column]

    def read(self, rows: np.ndarray, xbytes: memoryview | None, ybytes: memoryview | None) -> None:
        """Rows ``rows`` into ``xbytes`` and ``ybytes`` (flat; ``None``: not wanted), every part's reads
        together (:func:`~services.provider.sources.storage.reader.read_spaces`: a remote ``x`` and ``y`` are fetched side by side)."""
        reads = []
        for records, feeds in self.parts:
            dests = [xbytes if c == "x" else ybytes if c == "y" else None for c in feeds]
            if any(d is not None for d in dests):
                reads.append((records.space, records.runs(rows, dests)))
        read_spaces(reads)


@dataclass
class Layout:
    """What a format opener found: per-split tables and how their samples are typed on disk."""

    format: str
    tables: dict[str, Table]
    sample_shape: tuple[int, ...]
    x_dtype: np.dtype  # as stored, byte order included
    label_shape: tuple[int, ...] = ()
    y_dtype: np.dtype | None = None  # as stored; None: no labels
    num_classes: int | None = None  # None: count them from the labels
    class_names: list[str] = field(default_factory=list)
    kind: str = "image"
    extra: SourceInfo = field(default_factory=SourceInfo)  # more DatasetInfo keys (tokens: seq_len, vocab_size)

    @classmethod
    def of_splits(
        cls, format: str, tables: dict[str, Table], kinds: set[tuple], settings: DatasetSettings, missing: str
    ) -> Layout:
        """The layout of an array format whose splits are typed alike: ``kinds`` holds the one ``(x dtype,
        sample shape, y dtype, label shape)`` they share; ``num_classes`` and ``class_names`` come from
        ``settings``. Raises :class:`DatasetError` saying ``missing`` when no split was found."""
        if not tables:
            raise DatasetError(missing)
        xdt, sample, ydt, label_shape = next(iter(kinds))
        return cls(
            format,
            tables,
            sample,
            xdt,
            label_shape,
            ydt,
            settings.get("num_classes"),
            settings.get("class_names") or [],
        )


def _flat(a: np.ndarray) -> memoryview:
    return a.reshape(-1).view(np.uint8).data


def mem_available() -> int:
    """MemAvailable from /proc/meminfo in bytes; 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


#: Gathers of at least this many bytes are split in two, the second half on a helper thread: numpy
#: releases the GIL while it copies, and one thread does not saturate memory bandwidth.
SPLIT_GATHER_BYTES = 1 << 20


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: Split only where a core is left for it: the provider's own thread and a same-host trainer take
#: about one core between them. On two cores the helper only competes with them: each batch then
#: cost ~200 us more CPU (the hand-off, two copies contending for memory) and the shm row ran
#: slower, not faster (docs/performance.md, "What bounds the shm row").
SPLIT_GATHER = usable_cores() >= 3


class Gatherer:
    """``out[:] = src[rows]`` with no temporary, large gathers split with a helper thread of its own
    (where :data:`SPLIT_GATHER`: three cores or more).

    The thread starts on the first large gather and stops at :meth:`close` (the source's), so a closed
    source leaves no thread behind; after that, gathers run on the caller's thread alone.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._lock = threading.Lock()

    def __call__(self, src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
        """Gather (``rows`` already checked to be in range)."""
        # mode="clip": numpy buffers ``out`` under the default mode="raise" (a hidden temporary that
        # makes the gather ~4x slower); the rows were checked by the caller.
        pool = self._helper() if SPLIT_GATHER and out.nbytes >= SPLIT_GATHER_BYTES else None
        if pool is None:
            np.take(src, rows, axis=0, out=out, mode="clip")
            return
        half = len(rows) // 2
        other = pool.submit(np.take, src, rows[half:], 0, out[half:], "clip")
        np.take(src, rows[:half], axis=0, out=out[:half], mode="clip")
        other.result()

    def _helper(self) -> ThreadPoolExecutor | None:
        with self._lock:
            if self._pool is None and not self._closed:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="gather")
            return self._pool

    def close(self) -> None:
        """Stop the helper thread (after the gathers under way)."""
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=True)


class FileSource(Source):
    """Samples from files in a directory, in RAM (``memory=ram``) or read per batch with
    positional reads (``memory=stream``), so memory stays bounded whatever the dataset's size."""

    #: Reads may run on two threads at once (the provider's fill thread and its serving loop):
    #: RAM gathers and positional reads share no state.
    read_policy = ReadPolicy.CONCURRENT

    def __init__(self, uri: str, root: Path, layout: Layout, ctx: Context, memory: str, val_fraction: float):
        self.uri, self.root, self.layout = uri, root, layout
        #: Where the files are (each batch's reads run under its :meth:`~.location.Location.batch`).
        self.location = ctx.location
        self.remote = self.location is not None and self.location.kind != "file"
        self.gather = not self.remote
        self.sample_shape = layout.sample_shape
        self.dtype = layout.x_dtype.newbyteorder("=")
        y = layout.y_dtype
        self.label_shape = layout.label_shape if y is not None else (0,)
        # class ids are served as int64 whatever their width on disk; other targets as stored
        self.label_dtype = np.dtype(np.int64) if y is None or y.kind in "iub" else y.newbyteorder("=")
        self.kind = layout.kind
        self._fds = ctx.fds
        self._finalizer = weakref.finalize(self, _close_all, self._fds)
        self._gather = Gatherer()
        weakref.finalize(self, self._gather.close)
        self._splits = self._carve(layout.tables, val_fraction)
        self.val_fraction = val_fraction if "val" not in layout.tables else None
        tables = {id(t): t for t, _, _ in self._splits.values() if t is not None}.values()
        total = sum(t.count for t in tables) * self.sample_nbytes
        if memory == "auto":
            memory = "ram" if total < min(RAM_CAP_BYTES, mem_available() // 4) else "stream"
        self.memory = memory
        self._ram: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if memory == "ram":
            for t in tables:
                self._ram[id(t)] = self._load(t)
            _close_all(self._fds)  # all in RAM: the files are no longer needed
        self._class_labels = self.label_shape == () and self.label_dtype.kind in "iu"
        self.num_classes = layout.num_classes or (self._count_classes(tables) if self._class_labels else 0)
        self.class_names = layout.class_names or (
            [str(i) for i in range(self.num_classes)] if self._class_labels else []
        )
        if self.class_names and len(self.class_names) != self.num_classes:
            raise DatasetError(f"{uri}: {len(self.class_names)} class names for {self.num_classes} classes")
        #: RAM tables whose every label is a class id below num_classes: a batch of them needs no
        #: check (a scan of the labels once, instead of two reductions per batch).
        self._labels_ok = {key for key, (_, ys) in self._ram.items() if self._labels_in_range(ys)}

    def _carve(self, tables: dict[str, Table], fraction: float) -> dict[str, tuple[Table | None, int, int]]:
        if "train" not in tables:
            raise DatasetError(f"{self.uri}: found {', '.join(tables) or 'no'} split(s) but no train split")
        train = tables["train"]
        out: dict[str, tuple[Table | None, int, int]] = {s: (t, 0, t.count) for s, t in tables.items()}
        if "val" not in tables:
            keep = val_carve.tail(self.uri, train.count, fraction)
            out["train"] = (train, 0, keep)
            out["val"] = (train, keep, train.count - keep)
        out.setdefault("test", (None, 0, 0))
        return out

    def close(self) -> None:
        """Close the dataset's files (a RAM source has already closed them), stop its gather thread
        and release its location's client."""
        _close_all(self._fds)
        self._gather.close()
        if self.location is not None:
            self.location.close()

    def num_samples(self, split: str) -> int:
        return self._splits[split][2]

    def info(self) -> SourceInfo:
        info = super().info()
        info.update({"format": self.layout.format, "memory": self.memory, "path": str(self.root)})
        info.update(self.layout.extra)
        if self.location is not None:
            info.update(self.location.info())
            if getattr(getattr(self.location, "client", None), "memory", None) is not None:
                info["read_ahead"] = True  # loaders may send ReadAhead: its RAM cache fetches blocks ahead
        if self.val_fraction is not None:
            info["val_fraction"] = self.val_fraction
            info["val_carved"] = "the tail of train, in file order"
        return info

    def locate(self, split: str, indices: np.ndarray) -> list[str]:
        """``FILE@OFFSET+LENGTH`` per index: the file (relative to the dataset's root) and the byte range
        of the sample's ``x`` as stored (a sample that runs on into the next file names where it starts)."""
        table, start, _ = self._splits[split]
        if table is None:
            return [""] * len(indices)
        part = next(((r, feeds.index("x")) for r, feeds in table.parts if "x" in feeds), None)
        if part is None:
            return [""] * len(indices)
        records, f = part
        at, nbytes = records.fields[f]
        space = records.space
        out = []
        for row in np.asarray(indices, dtype=np.int64).tolist():
            pos = records.base + (row + start) * records.record + at
            i = bisect.bisect_right(space.starts, pos) - 1
            seg = space.segments[i]
            # a gzip file, a compressed npz member: offsets of the decompressed bytes, as read
            note = " (decompressed)" if " (decompressed to " in seg.name or " (extracted to " in seg.name else ""
            out.append(f"{relative_name(seg.name, self.root)}@{seg.offset + pos - space.starts[i]}+{nbytes}{note}")
        return out

    def read_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        """Write samples ``indices`` of ``split`` into ``x`` and ``y`` (see :meth:`Source.read_into`).

        Streamed, the bytes go from the file straight into ``x`` (and ``y`` when labels are stored
        as served), whatever the order of ``indices``. Raises ``IndexError`` for an index outside
        the split, ``ValueError`` for destinations of the wrong shape, :class:`DatasetError` for
        data that is not what the files promised (a label or token out of range, a shrunk file).
        """
        with self.location.batch() if self.location is not None else nullcontext():
            self._read_into(split, indices, x, y)

    def _read_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        table, start, count = self._splits[split]
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(idx)
        if x.shape != (n, *self.sample_shape) or y.shape != (n, *self.label_shape):
            raise ValueError(
                f"read_into needs x of shape {(n, *self.sample_shape)} and y of shape "
                f"{(n, *self.label_shape)}, got {x.shape} and {y.shape}"
            )
        if n == 0:
            return
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= count:
            raise IndexError(f"index {lo if lo < 0 else hi} is outside {split} (0..{count - 1})")
        rows = idx + start if start else idx
        assert table is not None  # only the empty test split has no table, and no index is inside it
        if self.memory == "ram":
            xs, ys = self._ram[id(table)]
            self._gather(xs, rows, x)
            np.take(ys, rows, axis=0, out=y, mode="clip")
        else:
            self._stream(table, rows, x, y)
        self._check(table, x, y)

    def read_ahead(self, split: str, indices: np.ndarray, owner: object) -> int:
        """Have the remote client fetch ahead the blocks that samples ``indices`` of ``split`` lie in (see
        :class:`~libbus.wire.messages.ReadAhead`); empty ``indices`` cancel ``owner``'s plan. Returns the
        blocks planned: 0 where the dataset keeps no RAM cache of a remote store."""
        client = getattr(self.location, "client", None)
        memory = getattr(client, "memory", None)
        if client is None or memory is None:
            return 0
        table, start, count = self._splits[split]
        if table is None or not len(indices):
            memory.cancel(owner)
            return 0
        rows = np.asarray(indices, dtype=np.int64) + start
        blocks = []
        for records, feeds in table.parts:
            if any(c is not None for c in feeds):
                blocks.extend(records.space.blocks(records.base + rows * records.record, records.record, memory.block))
        return client.read_ahead(owner, blocks)

    def _stream(self, table: Table, rows: np.ndarray, x: np.ndarray | None, y: np.ndarray | None) -> None:
        n = len(rows)
        xb = None
        if x is not None:
            xb = x if x.flags.c_contiguous and x.dtype == self.dtype else np.empty(x.shape, self.dtype)
        yb, stored = None, self.layout.y_dtype
        if y is not None and stored is not None:
            yb = y if y.flags.c_contiguous and y.dtype == stored else np.empty((n, *self.label_shape), stored)
        table.read(rows, None if xb is None else _flat(xb), None if yb is None else _flat(yb))
        if x is not None and xb is not None:
            if not self.layout.x_dtype.isnative:
                xb.byteswap(inplace=True)  # IDX is big-endian on disk; serve native order
            if xb is not x:
                x[...] = xb
        if y is not None and yb is not None and yb is not y:
            y[...] = yb  # widens class ids to int64, fixes byte order

    def _load(self, table: Table) -> tuple[np.ndarray, np.ndarray]:
        xs = np.empty((table.count, *self.sample_shape), self.dtype)
        ys = np.empty((table.count, *self.label_shape), self.label_dtype)
        step = max(1, CHUNK_BYTES // max(1, self.sample_nbytes))
        for a in range(0, table.count, step):
            b = min(a + step, table.count)
            self._stream(table, np.arange(a, b), xs[a:b], ys[a:b])
        return xs, ys

    def _count_classes(self, tables) -> int:
        """1 + the largest class id in any split's labels, read in bounded chunks."""
        top = -1
        for t in tables:
            step = 1 << 18
            for a in range(0, t.count, step):
                b = min(a + step, t.count)
                if id(t) in self._ram:
                    ys = self._ram[id(t)][1][a:b]
                else:
                    ys = np.empty(b - a, self.label_dtype)
                    self._stream(t, np.arange(a, b), None, ys)
                if len(ys) and ys.min() < 0:
                    raise DatasetError(f"{t.label_name}: label {ys.min()} is negative; class labels are 0..N-1")
                top = max(top, int(ys.max()) if len(ys) else -1)
        return top + 1

    def _labels_in_range(self, ys: np.ndarray) -> bool:
        if not (self._class_labels and self.num_classes):
            return False
        return not len(ys) or (int(ys.min()) >= 0 and int(ys.max()) < self.num_classes)

    def _check(self, table: Table, x: np.ndarray, y: np.ndarray) -> None:
        # never serve what a model would choke on: a class id or token beyond what info() promised
        if self._class_labels and self.num_classes and len(y) and id(table) not in self._labels_ok:
            lo, hi = int(y.min()), int(y.max())
            if lo < 0 or hi >= self.num_classes:
                raise DatasetError(
                    f"{table.label_name}: label {lo if lo < 0 else hi} is outside the "
                    f"{self.num_classes} classes 0..{self.num_classes - 1}"
                )
        if self.kind == "tokens" and x.size and int(x.max()) >= self.num_classes:
            raise DatasetError(
                f"{self.root}: token {int(x.max())} is not below vocab_size "
                f"{self.num_classes}; set vocab_size to the tokenizer's"
            )

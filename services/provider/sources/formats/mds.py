"""MosaicML Streaming's MDS shards, served as written: ``index.json`` and its shards, read as named fields in
their own column order (or ``(x, y)``).

Where: ``DIR/train/index.json`` (``val``/``validation``, ``test`` beside it: Streaming's split folders), else
``DIR/index.json``, all train (without val, val is the tail of train in shard order: ``val_fraction``,
default 0.1). An index lists shards (``format: mds``, ``version: 2``), each with its columns (names,
encodings, fixed sizes), its sample count and its file: ``raw_data`` read as it is, or, where only the
compressed ``zip_data`` is there (``compression`` ``zstd``, ``gz``, ``bz2``, ``br`` or ``snappy``), a copy
decompressed once into the location's cache. A shard is ``uint32 n | uint32 offsets[n + 1] | ... samples``;
a sample is the ``uint32`` sizes of its variable columns, then each column's bytes in column order. The
offsets of every shard are read at open (its header: one read); a batch's samples are read shard by
shard in offset order, neighbours in one read.

Column encodings → fields: ``bytes`` → ``bytes``; ``str`` and ``json`` → ``str``; ``int`` → ``int64 ()``;
``int8`` … ``uint64``, ``float16`` … ``float64`` → that dtype ``()``; ``str_int`` → ``int64 ()``,
``str_float`` → ``float64 ()``; ``ndarray:DTYPE:SHAPE`` → ``DTYPE SHAPE``; ``ndarray:DTYPE`` and
``ndarray`` → ``DTYPE (?, …)`` (the dtype and number of dimensions of the first sample; a later sample
that differs is refused naming it); ``jpeg``, ``png`` → ``bytes`` (the encoded file: a pipeline's image
stages decode it on the provider); ``pil`` → ``uint8 (?, ?, ?)`` (height, width, channels). Anything else
(``pkl``, which is never unpickled; ``list[…]``, ``jpeg_array``, ``str_decimal``) is refused at open
naming the column, unless ``?fields=`` leaves it out. A variable field's ``max_bytes`` is the largest
sample's size, read from the offsets, so a same-host trainer gets batches through shared memory.
``?fields=``, ``?label=``, ``?shape=``: :mod:`.fieldpick`; a label's ``num_classes`` comes from
``?classes=``, else from one pass over the label column at open.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from libbus.errors import DatasetError

from ..base import SPLITS, Field, FieldBatch, ReadPolicy, SourceInfo
from ..storage.reader import OpenFiles
from . import val_carve
from .fieldpick import PickedSource, classes, fill, select
from .location import Format, Location, val_fraction

__all__ = [
    "EXPECTED",
    "FORMAT",
    "Columns",
    "MDSSource",
    "Shard",
    "column_field",
    "detect",
    "index_paths",
    "open_location",
    "pil",
    "read_index",
    "read_offsets",
]

EXPECTED = "MDS (MosaicML Streaming): index.json and its shards, in DIR or DIR/train, DIR/val, DIR/test"
PARAMS = ("fields", "label", "shape", "classes", "val_fraction")
SPLIT_DIRS = {"train": ("train",), "val": ("val", "validation", "valid"), "test": ("test",)}
#: Samples closer than this in one shard are read together (one read) rather than apart.
COALESCE_GAP = 64 << 10
_SCALARS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64")
#: ``ndarray`` encodings: the dtype codes of a dynamic dtype, the shape dtypes of a dynamic shape.
_VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32", 33: "int32"}
_VALUE_DTYPES |= {34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
_SHAPE_DTYPES = {0: "<u1", 1: "<u2", 2: "<u4", 3: "<u8"}
_PIL_CHANNELS = {"L": 1, "RGB": 3, "RGBA": 4, "CMYK": 4, "LA": 2}  # 8-bit modes: served uint8
_WHY = {
    "pkl": "is pickled (encoding 'pkl'), and batchbus never unpickles what it serves",
    "str_decimal": "is a decimal (encoding 'str_decimal'), which has no numeric dtype to serve it as",
}


def index_paths(root) -> dict[str, str]:
    """split → the folder of its shards under ``root``, as a prefix (``train/``; ``""``: the root itself,
    whose ``index.json`` lists them). A prefix, not a folder: HTTP locations name files, not folders."""
    found = {}
    for split, names in SPLIT_DIRS.items():
        for name in names:
            if (root / f"{name}/index.json").is_file():
                found[split] = f"{name}/"
                break
    if not found and (root / "index.json").is_file():
        found["train"] = ""
    return found


def read_index(loc: Location, path) -> dict:
    try:
        index = json.loads(loc.read(path))
    except ValueError as err:
        raise DatasetError(f"{path}: not JSON: {err}") from None
    return index if isinstance(index, dict) else {}


def _is_mds(loc: Location, path) -> bool:
    try:
        index = read_index(loc, path)
    except DatasetError:
        return False
    shards = index.get("shards")
    return isinstance(shards, list) and all(isinstance(s, dict) and s.get("format") == "mds" for s in shards)


def detect(loc: Location) -> bool:
    return any(_is_mds(loc, loc.root / f"{p}index.json") for p in index_paths(loc.root).values())


# -- columns -------------------------------------------------------------------------------------------


def column_field(name: str, encoding: str, first: bytes | None) -> Field | str:
    """The field column ``name`` of ``encoding`` is served as, or why it cannot be (a str). ``first`` is the
    column's bytes in the first sample, for encodings whose dtype or rank the index does not say."""
    base, _, rest = encoding.partition(":")
    if encoding == "bytes" or encoding in ("jpeg", "png"):
        return Field(name, "bytes", ())
    if encoding in ("str", "json"):
        return Field(name, "str", ())
    if encoding in ("int", "str_int"):
        return Field(name, "int64", ())
    if encoding == "str_float":
        return Field(name, "float64", ())
    if encoding in _SCALARS:
        return Field(name, encoding, ())
    if encoding == "pil":
        return Field(name, "uint8", (None, None, None))
    if base == "ndarray":
        dtype, _, shape = rest.partition(":")
        if dtype and dtype not in _SCALARS:
            return f"is an ndarray of {dtype!r}, which has no batchbus dtype"
        if dtype and shape:
            return Field(name, dtype, tuple(int(d) for d in shape.split(",")))
        if first is None:
            return "is an ndarray of dynamic shape, and the dataset has no sample to learn its rank from"
        got = _ndarray(first, dtype or None, None, name)
        return Field(name, got.dtype.name, (None,) * got.ndim)
    return _WHY.get(encoding, f"has encoding {encoding!r}, which batchbus does not map to a field")


def _ndarray(data: bytes, dtype: str | None, shape: tuple[int, ...] | None, name: str) -> np.ndarray:
    """An ``ndarray`` column's value (Streaming's layout: ``[dtype code] [ndim << 2 | shape dtype] [shape]
    values``, the parts the encoding fixes left out)."""
    pos = 0
    if dtype is None:
        if data[0] not in _VALUE_DTYPES:
            raise DatasetError(f"column {name!r}: unknown ndarray dtype code {data[0]}")
        dtype, pos = _VALUE_DTYPES[data[0]], 1
    if shape is None:
        ndim, code = data[pos] >> 2, data[pos] & 3
        shape = tuple(int(d) for d in np.frombuffer(data, _SHAPE_DTYPES[code], ndim, pos + 1))
        pos += 1 + ndim * np.dtype(_SHAPE_DTYPES[code]).itemsize
    values = np.frombuffer(data, np.dtype(dtype).newbyteorder("<"), offset=pos)
    if values.size != int(np.prod(shape)):
        raise DatasetError(f"column {name!r}: {values.size} values for shape {shape}")
    return values.reshape(shape)


def pil(data: bytes, name: str) -> np.ndarray:
    width, height, mode_size = (int(v) for v in np.frombuffer(data, "<u4", 3))
    mode = data[12 : 12 + mode_size].decode()
    if mode not in _PIL_CHANNELS:
        raise DatasetError(f"column {name!r}: a PIL image of mode {mode!r}; served modes: {', '.join(_PIL_CHANNELS)}")
    pixels = np.frombuffer(data, np.uint8, offset=12 + mode_size)
    return pixels.reshape(height, width, _PIL_CHANNELS[mode])


def _decoder(encoding: str, field: Field, name: str) -> Callable[[bytes], Any]:
    """bytes of one column of one sample → its value as ``field`` serves it."""
    base, _, rest = encoding.partition(":")
    if field.dtype == "bytes":
        return bytes
    if field.dtype == "str":
        return lambda b: b.decode("utf-8")
    if encoding in ("int", *_SCALARS):
        dt = np.dtype("<i8" if encoding == "int" else np.dtype(encoding).newbyteorder("<"))
        return lambda b: np.frombuffer(b, dt, 1)[0]
    if encoding == "str_int":
        return lambda b: int(b.decode())
    if encoding == "str_float":
        return lambda b: float(b.decode())
    if encoding == "pil":
        return lambda b: pil(b, name)
    dtype, _, shape = rest.partition(":")
    fixed = tuple(int(d) for d in shape.split(",")) if shape else None

    def array(b: bytes) -> np.ndarray:
        a = _ndarray(b, dtype or None, fixed, name)
        if a.dtype.name != field.dtype or a.ndim != len(field.shape):
            raise DatasetError(
                f"column {name!r}: a sample is {a.dtype.name} of {a.ndim} dimensions; the first was {field.describe()}"
            )
        return a

    return array


# -- shards --------------------------------------------------------------------------------------------


@dataclass
class Shard:
    """One shard: its columns, the path read (or its decompressed copy) and its samples' offsets."""

    name: str
    path: Any
    local: Path | None
    names: list[str]
    encodings: list[str]
    sizes: list[int | None]
    offsets: np.ndarray  # n + 1 absolute byte offsets


def _decompress(algo: str, data: bytes, where: str) -> bytes:
    try:
        if algo == "gz":
            return gzip.decompress(data)
        if algo == "bz2":
            return bz2.decompress(data)
        if algo == "zstd":
            import zstd  # optional: MDS shards compressed with zstd (Streaming's own choice of library)

            return zstd.decompress(data)
        if algo == "br":
            import brotli  # optional: MDS shards compressed with Brotli

            return brotli.decompress(data)
        if algo == "snappy":
            import snappy  # optional: MDS shards compressed with snappy

            return snappy.decompress(data)
    except ImportError as err:
        raise DatasetError(f"{where}: compressed with {algo}: pip install 'batchbus[mds]' ({err.name})") from None
    except Exception as err:  # noqa: BLE001 - each library raises its own error for damaged data
        raise DatasetError(f"{where}: cannot decompress it ({algo}): {err}; the file is damaged or truncated") from None
    raise DatasetError(f"{where}: compression {algo!r} is not one of zstd, gz, bz2, br, snappy")


def _local_copy(loc: Location, path, algo: str) -> Path:
    """A compressed shard decompressed once into the location's cache (per size and stamp)."""
    size, stamp = loc.stamp(path)
    key = hashlib.blake2b(f"{size}:{stamp}".encode(), digest_size=8).hexdigest()
    dest = loc.index_path(path, f".{key}.mds")
    if dest.is_file():
        return dest
    data = _decompress(algo, loc.read(path), str(path))
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, dest)
    except OSError as err:
        raise DatasetError(
            f"{path}: cannot write its decompressed copy to {dest.parent} ({err.strerror}); "
            "name a writable directory with ?cache=DIR"
        ) from err
    return dest


def read_offsets(loc: Location, path, local: Path | None, n: int, said: str) -> np.ndarray:
    """The ``n + 1`` sample offsets in the header of shard ``path`` (read from ``local``, its decompressed
    copy, when it has one), checked against ``n`` (what ``said`` says) and the shard's size."""
    if local is not None:
        with open(local, "rb") as f:
            head = f.read(4 * (n + 2))
    else:
        head = loc.pread(path, 0, 4 * (n + 2))
    if n < 0 or len(head) != 4 * (n + 2) or int(np.frombuffer(head, "<u4", 1)[0]) != n:
        raise DatasetError(f"{path}: its header does not hold the {n} samples {said} says (a damaged shard)")
    offsets = np.frombuffer(head, "<u4", n + 1, 4).astype(np.int64)
    size = os.path.getsize(local) if local is not None else loc.stamp(path)[0]
    if n and (np.any(np.diff(offsets) < 0) or offsets[-1] > size):
        raise DatasetError(f"{path}: its sample offsets run past its {size} bytes (a damaged or cut shard)")
    return offsets


def _shard(loc: Location, prefix: str, entry: dict, where: str) -> Shard:
    if entry.get("version") != 2 or entry.get("format") != "mds":
        raise DatasetError(
            f"{where}: a shard of format {entry.get('format')!r} version {entry.get('version')}: MDS 2 only"
        )
    raw, packed = entry.get("raw_data") or {}, entry.get("zip_data") or {}
    local = None
    if raw.get("basename") and (loc.root / f"{prefix}{raw['basename']}").is_file():
        path = loc.root / f"{prefix}{raw['basename']}"
    elif packed.get("basename") and (loc.root / f"{prefix}{packed['basename']}").is_file():
        path = loc.root / f"{prefix}{packed['basename']}"
        local = _local_copy(loc, path, str(entry.get("compression") or "").split(":")[0])
    else:
        raise DatasetError(f"{where}: shard {raw.get('basename') or packed.get('basename')!r} is missing")
    offsets = read_offsets(loc, path, local, int(entry.get("samples", -1)), "index.json")
    names, encodings, sizes = entry.get("column_names"), entry.get("column_encodings"), entry.get("column_sizes")
    if not (isinstance(names, list) and isinstance(encodings, list) and isinstance(sizes, list)):
        raise DatasetError(f"{where}: a shard without column_names, column_encodings and column_sizes")
    return Shard(str(path), path, local, names, encodings, sizes, offsets)


def _columns(data: bytes, shard: Shard, at: str) -> dict[str, bytes]:
    """One sample's bytes, by column."""
    out, pos, lengths = {}, 0, []
    for size in shard.sizes:
        if size:
            lengths.append(size)
        else:
            lengths.append(int(np.frombuffer(data, "<u4", 1, pos)[0]))
            pos += 4
    for name, n in zip(shard.names, lengths):
        out[name] = data[pos : pos + n]
        pos += n
    if pos != len(data):
        raise DatasetError(f"{at}: the sample's columns add up to {pos} bytes, not its {len(data)} (a damaged shard)")
    return out


# -- the source ----------------------------------------------------------------------------------------


class Columns:
    """How a format's column encodings become fields (:func:`column_field`) and values (:func:`_decoder`):
    MDS's here; litData's chunks have the same shard layout and their own encodings (:mod:`.litdata`)."""

    format = "mds"
    #: What messages call a column.
    what = "column"

    def field(self, name: str, encoding: str, first: bytes | None) -> Field | str:
        return column_field(name, encoding, first)

    def decoder(self, encoding: str, field: Field, name: str) -> Callable[[bytes], Any]:
        return _decoder(encoding, field, name)


class MDSSource(PickedSource):
    """The samples of MDS shards (or litData chunks: ``kinds``) as named fields in their column order, or
    ``(x, y)`` (see the module doc)."""

    def __init__(
        self,
        loc: Location,
        shards: dict[str, list[Shard]],
        params: dict[str, str],
        val_fraction: float,
        kinds: Columns | None = None,
    ):
        self.uri, self.location, self.root = loc.uri, loc, loc.root
        #: Reads share no state (file descriptors under a lock; a store's client is thread-safe): batches
        #: of a remote dataset are read several at once, a local one's on its fill lane (fillers.py).
        self.read_policy = ReadPolicy.CONCURRENT
        self.remote = loc.kind != "file"
        self.kinds = kinds = kinds or Columns()
        self.shards = [s for split in SPLITS for s in shards.get(split, [])]
        first = self.shards[0]
        for s in self.shards[1:]:
            if (s.names, s.encodings) != (first.names, first.encodings):
                raise DatasetError(f"{self.uri}: {s.name} has other columns than {first.name}")
        self._files = OpenFiles()
        #: split → (n, 2) rows: shard number, record number (val carved from train where there is none)
        self.rows, self.val_fraction = val_carve.shard_rows(
            self.uri,
            {split: [len(s.offsets) - 1 for s in shards.get(split, [])] for split in SPLITS},
            val_fraction,
            "the train shards hold no samples",
            "samples",
        )
        largest = max(int(np.diff(s.offsets).max(initial=0)) for s in self.shards)
        sample0 = {}
        if len(first.offsets) > 1:
            with loc.batch():
                sample0 = _columns(self._read([(0, 0)])[0], first, f"{first.name} sample 0")
        columns: dict[str, Field] = {}
        refused: dict[str, str] = {}
        for name, enc in zip(first.names, first.encodings):
            got = kinds.field(name, enc, sample0.get(name))
            if isinstance(got, str):
                refused[name] = got
            else:
                columns[name] = Field(got.name, got.dtype, got.shape, largest if got.variable else 0)
        self.selection = select(self.uri, columns, refused, params, kinds.what)
        encoding = dict(zip(first.names, first.encodings))
        self._decode = {
            p.column: kinds.decoder(encoding[p.column], columns[p.column], p.column) for p in self.selection.picks
        }
        self.label, self.num_classes = self.selection.label, 0
        if self.selection.xy:
            x = self.selection.picks[0].field
            self.sample_shape, self.dtype, self.kind = x.fixed_shape, x.np_dtype, "image"
        else:
            self.sample_shape, self.dtype, self.kind = (0,), np.dtype(np.uint8), "fields"
        if self.label is not None:
            lo, hi = self._label_range() if not params.get("classes") else (0, -1)
            self.num_classes = classes(self.uri, self.label, lo, hi, params.get("classes"))
            self.class_names = [str(i) for i in range(self.num_classes)]

    def _label_range(self) -> tuple[int, int]:
        """The smallest and largest label (one pass over every sample: ``?classes=`` skips it)."""
        lo, hi = 0, -1
        for split in ("train", "val", "test"):
            rows = self.rows[split]
            for start in range(0, len(rows), 4096):
                ys = self._values(split, np.arange(start, min(start + 4096, len(rows))), [self.selection.picks[-1]])
                if len(ys["y"]):
                    lo, hi = (
                        (int(ys["y"].min()), int(ys["y"].max()))
                        if hi < lo
                        else (min(lo, int(ys["y"].min())), max(hi, int(ys["y"].max())))
                    )
        return lo, hi

    @property
    def fields(self) -> list[Field]:
        return self.selection.fields

    def num_samples(self, split: str) -> int:
        return len(self.rows[split])

    def _read(self, rows: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of samples ``(shard, sample)``: each shard's in offset order, neighbours in one read."""
        runs: list[tuple[int, int, int, list[tuple[int, int, int]]]] = []  # shard, start, end, [(i, begin, end)]
        order = sorted(range(len(rows)), key=lambda i: (rows[i][0], self.shards[rows[i][0]].offsets[rows[i][1]]))
        for i in order:
            shard, sample = rows[i]
            begin, end = (int(v) for v in self.shards[shard].offsets[sample : sample + 2])
            if runs and runs[-1][0] == shard and begin - runs[-1][2] <= COALESCE_GAP:
                runs[-1][3].append((i, begin, end))
                runs[-1] = (shard, runs[-1][1], max(runs[-1][2], end), runs[-1][3])
            else:
                runs.append((shard, begin, end, [(i, begin, end)]))
        remote = [r for r in runs if self.shards[r[0]].local is None]
        got = dict(
            zip(map(id, remote), self.location.read_ranges([(self.shards[s].path, a, b - a) for s, a, b, _ in remote]))
        )
        out: list[bytes] = [b""] * len(rows)
        for run in runs:
            shard, start, end, members = run
            data = got[id(run)] if id(run) in got else os.pread(self._local_fd(shard), end - start, start)
            if len(data) != end - start:
                raise DatasetError(f"{self.uri}: {self.shards[shard].name} changed or was cut short while read")
            for i, begin, stop in members:
                out[i] = data[begin - start : stop - start]
        return out

    def _local_fd(self, shard: int) -> int:
        local = self.shards[shard].local
        assert local is not None, "a shard read from its file is local"
        return self._files.fd(local)

    def _values(self, split: str, indices: np.ndarray, picks=None) -> FieldBatch:
        idx = np.asarray(indices, np.int64).reshape(-1)
        n = len(self.rows[split])
        if len(idx) and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"index {int(idx.min() if idx.min() < 0 else idx.max())} is outside {split} (0..{n - 1})")
        rows = [(int(s), int(i)) for s, i in self.rows[split][idx]]
        with self.location.batch():
            data = self._read(rows)
        samples = [
            _columns(d, self.shards[s], f"{self.uri}: {self.shards[s].name} sample {i}")
            for d, (s, i) in zip(data, rows)
        ]
        out: FieldBatch = {}
        for pick in picks or self.selection.picks:
            decode = self._decode[pick.column]
            values = [decode(c[pick.column]) for c in samples]
            out[pick.field.name] = fill(
                pick, values, lambda i: f"{self.uri}: {self.shards[rows[i][0]].name} sample {rows[i][1]}"
            )
        if picks is None:
            self.check_labels(out, split)
        return out

    def info(self) -> SourceInfo:
        info = super().info()
        info.update({"format": self.kinds.format, "path": str(self.root), "shards": len(self.shards)})
        info["columns"] = dict(zip(self.shards[0].names, self.shards[0].encodings))
        info.update(self.location.info())
        if self.val_fraction is not None:
            info["val_fraction"] = self.val_fraction
            info["val_carved"] = "the tail of train, in shard order"
        return info

    def close(self) -> None:
        self._files.close()
        self.location.close()


def open_location(loc: Location) -> MDSSource:
    """The MDS dataset at ``loc`` (local files, HTTP, an object store), popping the parameters this layout
    knows (see the module doc). Raises :class:`DatasetError`."""
    params = {k: loc.params.pop(k) for k in PARAMS if k in loc.params}
    fraction = val_fraction(loc.uri, params.get("val_fraction", "0.1"))
    indexes = index_paths(loc.root)
    if "train" not in indexes:
        raise DatasetError(f"{loc.uri}: no MDS index.json in {loc.root} or {loc.root}/train; expected {EXPECTED}")
    shards: dict[str, list[Shard]] = {}
    for split, prefix in indexes.items():
        path = loc.root / f"{prefix}index.json"
        entries = read_index(loc, path).get("shards")
        if not isinstance(entries, list):
            raise DatasetError(f"{path}: not an MDS index (no 'shards' list)")
        shards[split] = [_shard(loc, prefix, e, f"{path} shard {i}") for i, e in enumerate(entries)]
    if not shards["train"]:
        raise DatasetError(f"{loc.root / (indexes['train'] + 'index.json')}: lists no shards")
    return MDSSource(loc, shards, params, fraction)


#: This layout's line in the registry (:mod:`..layouts`).
FORMAT = Format("mds", detect, open_location, EXPECTED, "source")

"""TFRecord files of ``tf.train.Example``\\ s, served as they are: named fields, or ``(x, y)``.

Files: every file whose name has ``.tfrec`` in it (``*.tfrecord``, ``*.tfrecords``, ``*.tfrec``, TFDS's
``mnist-train.tfrecord-00000-of-00001``, each optionally gzip: ``.gz`` or gzip's magic), in name order.
The split is the first word of the name that is ``train``, ``validation``/``valid``/``val``/``dev``/``eval``
or ``test``; when no name says a split, every file is train. Without val files, val is the tail of
train in file order (``val_fraction``, default 0.1).

A record is ``uint64 length | uint32 masked crc32c(length) | data | uint32 masked crc32c(data)``. One
pass over each file at open finds its records, checks both CRCs of each and reads every Example's
features (:mod:`.tfexample`): their kinds, how many values each holds (fewest, most) and, for int64
lists, the smallest and largest value. That index is kept in the location's cache directory
(:meth:`~.location.Location.index_path`), keyed by the file's size and mtime (ETag remotely), and
rebuilt when either changes. A gzip file is decompressed once into that cache (read through the
location, so gzip files in a bucket work too) and read from the copy. Reads go by record: a batch's
records are read shard by shard in offset order, neighbours in one read, and each record's data CRC
is checked again as read. A corrupt or cut record is refused naming its file and byte offset.

Fields (``?fields=a,b,c``: those features, in that order; default every feature, by name): a bytes
feature with one value per record is ``bytes`` (encoded images stay encoded: a pipeline's image stages
decode them); a float (``float32``) or int64 feature is a scalar ``()`` where every record holds one
value, ``(n,)`` where every record holds ``n``, else ``(?,)``; a variable field's ``max_bytes`` is its
largest record's, from the index, so a same-host trainer gets batches through shared memory.
``?label=NAME``: an int64 feature of one value per record, the class id, served as ``y``
(``num_classes`` from ``?classes=``, else its largest value + 1); with one other field left, a fixed
one of numbers, that field is ``x`` and the dataset is an ``(x, y)`` one that the built-in models train
on (``?shape=1,28,28`` reshapes ``x``): the rule of :mod:`.fieldpick`, shared with MDS. A bytes feature
of several values per record is refused, naming it (leave it out with ``?fields=``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import tempfile
import zlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from libbus.errors import DatasetError

from ..base import SPLITS, Field, FieldBatch, SourceInfo, relative_name
from ..storage.reader import OpenFiles
from . import val_carve
from .fieldpick import PickedSource, classes, fill, select
from .location import Format, Location, val_fraction
from .tfexample import BYTES, FLOAT, INT64, parse_example

__all__ = ["EXPECTED", "FORMAT", "TFRecordSource", "detect", "masked_crc", "open_location", "split_of"]

log = logging.getLogger(__name__)

EXPECTED = "TFRecord: *.tfrecord, *.tfrecords or *.tfrec files of tf.train.Example (gzip or not)"
PARAMS = ("fields", "label", "shape", "classes", "val_fraction")  # fields, label, shape: .fieldpick
INDEX_VERSION = 1
#: Records closer than this in one file are read together (one read) rather than apart.
COALESCE_GAP = 64 << 10
#: Bytes read per step while decompressing a gzip file into the cache.
CHUNK = 4 << 20
HEADER, FOOTER = 12, 4
_MASK_DELTA = 0xA282EAD8
SPLIT_WORDS = {
    "train": "train",
    "validation": "val",
    "valid": "val",
    "val": "val",
    "dev": "val",
    "eval": "val",
    "test": "test",
}
_DTYPES: dict[str, np.dtype] = {FLOAT: np.dtype(np.float32), INT64: np.dtype(np.int64)}


def _crc32c() -> Callable[[Any], int]:
    try:
        import crc32c  # optional: TFRecord datasets only
    except ImportError as err:
        raise DatasetError("TFRecord datasets need crc32c: pip install 'batchbus[tfrecord]'") from err
    return crc32c.crc32c


def masked_crc(data: bytes | memoryview) -> int:
    """TFRecord's checksum: crc32c, rotated right by 15 bits, plus a constant (mod 2**32)."""
    crc = _crc32c()(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def is_tfrecord(name: str) -> bool:
    lower = name.lower()
    return ".tfrec" in lower and not lower.endswith((".index", ".idx", ".json"))


def split_of(name: str) -> str | None:
    """The split a file's name says (its first word that names one), or None."""
    for word in re.split(r"[^a-z]+", name.lower()):
        if word in SPLIT_WORDS:
            return SPLIT_WORDS[word]
    return None


def detect(root) -> bool:
    return any(is_tfrecord(p.name) and p.is_file() for p in root.iterdir())


# -- the index: one pass over a file -------------------------------------------------------------


@dataclass
class Shard:
    """One file: where its records are (``frames``: header offset, data length) and what they hold."""

    name: str  # how messages name it
    path: Any  # the location's path
    local: Path | None  # its decompressed copy (a gzip file), read instead
    frames: np.ndarray
    #: feature → {kind, min, max (values per record), bytes (most per record), lo, hi (int64 values)}
    features: dict[str, dict]


def _summarise(summary: dict[str, dict], example: dict, where: str) -> None:
    for name, (kind, values) in example.items():
        n = len(values)
        nbytes = sum(len(v) for v in values) if kind == BYTES else n * 8 if kind == INT64 else n * 4
        s = summary.get(name)
        if s is None:
            s = summary[name] = {"kind": kind, "min": n, "max": n, "bytes": nbytes, "present": 0, "lo": 0, "hi": -1}
        elif s["kind"] != kind:
            raise DatasetError(
                f"{where}: feature {name!r} is a {kind} list here, a {s['kind']} list in earlier records"
            )
        s["min"], s["max"], s["bytes"] = min(s["min"], n), max(s["max"], n), max(s["bytes"], nbytes)
        s["present"] += 1
        if kind == INT64 and n:
            lo, hi = int(values.min()), int(values.max())
            s["lo"], s["hi"] = (lo, hi) if s["hi"] < s["lo"] else (min(s["lo"], lo), max(s["hi"], hi))


def build_index(name: str, pread: Callable[[int, int], bytes], size: int, read_ahead: int) -> tuple[np.ndarray, dict]:
    """Walk the file ``name`` (``size`` bytes, read with ``pread(offset, n)``): each record's header
    offset and data length, and a summary of its features. Raises :class:`DatasetError` naming the
    file and offset of a record that is corrupt, cut short or not an Example."""
    frames = array("q")  # header offset, data length: 16 bytes a record, however many records
    summary: dict[str, dict] = {}
    buf, buf_start = b"", 0

    def get(off: int, n: int) -> bytes:
        nonlocal buf, buf_start
        if off < buf_start or off + n > buf_start + len(buf):
            buf, buf_start = pread(off, min(max(n, read_ahead), size - off)), off
            if len(buf) < n:
                raise DatasetError(f"{name}: changed while indexed (read {len(buf)} of {n} bytes at byte {off})")
        return buf[off - buf_start : off - buf_start + n]

    pos = 0
    while pos < size:
        where = f"{name}: record {len(frames) // 2} at byte {pos}"
        if size - pos < HEADER:
            raise DatasetError(f"{where} is cut short: {size - pos} bytes left of a 12-byte header")
        head = get(pos, HEADER)
        length, length_crc = struct.unpack("<QI", head)
        if masked_crc(head[:8]) != length_crc:
            raise DatasetError(f"{where}: the length's CRC does not match (a corrupt record, or not a TFRecord file)")
        if pos + HEADER + length + FOOTER > size:
            raise DatasetError(
                f"{where} is cut short: it needs {HEADER + length + FOOTER} bytes, {size - pos} are left"
            )
        body = get(pos + HEADER, length + FOOTER)
        if masked_crc(body[:length]) != struct.unpack_from("<I", body, length)[0]:
            raise DatasetError(f"{where}: the data's CRC does not match (a corrupt record)")
        try:
            example = parse_example(body[:length])
        except ValueError as err:
            raise DatasetError(f"{where} is not a tf.train.Example: {err}") from None
        _summarise(summary, example, where)
        frames.extend((pos, length))
        pos += HEADER + length + FOOTER
    for s in summary.values():
        if s.pop("present") < len(frames) // 2:
            s["min"] = 0  # missing from some records
    return np.frombuffer(frames, np.int64).reshape(-1, 2).copy(), summary


def _load_index(path: Path, size: int, stamp: str) -> tuple[np.ndarray, dict] | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("version") == INDEX_VERSION and meta.get("size") == size and meta.get("stamp") == stamp:
                return z["frames"].reshape(-1, 2), meta["features"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _save_index(path: Path, frames: np.ndarray, features: dict, size: int, stamp: str) -> None:
    meta = json.dumps({"version": INDEX_VERSION, "size": size, "stamp": stamp, "features": features})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, frames=frames, meta=np.array(meta))
        os.replace(tmp, path)
    except OSError as err:
        log.warning("cannot keep the TFRecord index at %s: %s", path, err)


def _is_gzip(loc: Location, path, size: int) -> bool:
    if str(path.name).lower().endswith(".gz"):
        return True
    head = loc.pread(path, 0, min(HEADER, size))
    # gzip's magic, where a TFRecord header would not check out
    return head[:3] == b"\x1f\x8b\x08" and (len(head) < HEADER or masked_crc(head[:8]) != head[8:12])


def _decompressed(loc: Location, path, size: int, stamp: str) -> Path:
    """A gzip file's decompressed copy in the location's cache (made once per size and stamp)."""
    key = hashlib.blake2b(f"{size}:{stamp}".encode(), digest_size=8).hexdigest()
    dest = loc.index_path(path, f".{key}.tfrecord")
    if dest.is_file():
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    except OSError as err:
        raise DatasetError(
            f"{path}: cannot write its decompressed copy to {dest.parent} ({err.strerror}); "
            "name a writable directory with ?cache=DIR"
        ) from err
    try:
        with os.fdopen(fd, "wb") as out:
            d, pos, inside = zlib.decompressobj(16 + zlib.MAX_WBITS), 0, False
            while pos < size:
                data = loc.pread(path, pos, min(CHUNK, size - pos))
                if not data:
                    raise DatasetError(f"{path}: changed while decompressed (nothing at byte {pos} of {size})")
                pos += len(data)
                while data:  # concatenated gzip members, one after the other
                    out.write(d.decompress(data))
                    inside, data = not d.eof, d.unused_data if d.eof else b""
                    if d.eof:
                        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            if inside:
                raise DatasetError(f"{path}: the gzip stream is cut short (the file is truncated)")
        os.replace(tmp, dest)
    except zlib.error as err:
        os.unlink(tmp)
        raise DatasetError(f"{path}: cannot decompress it: {err}; the file is damaged or truncated") from err
    except BaseException:
        os.unlink(tmp)
        raise
    return dest


def _shard(loc: Location, path) -> Shard:
    """``path``'s index from the cache when its size and stamp match, else built and kept there."""
    size, stamp = loc.stamp(path)
    local = _decompressed(loc, path, size, stamp) if size and _is_gzip(loc, path, size) else None
    cached = loc.index_path(path, ".tfrecord-index.npz")
    found = _load_index(cached, size, stamp)
    if found is None:
        try:
            if local is not None:
                with open(local, "rb") as f:
                    n = os.fstat(f.fileno()).st_size
                    found = build_index(str(path), lambda off, k: os.pread(f.fileno(), k, off), n, CHUNK)
            else:
                found = build_index(str(path), lambda off, k: loc.pread(path, off, k), size, loc.read_ahead)
        except OSError as err:
            raise DatasetError(f"{loc.uri}: cannot read {path}: {err.strerror or err}") from None
        _save_index(cached, *found, size, stamp)
    return Shard(str(path), path, local, *found)


# -- the source ------------------------------------------------------------------------------------


class TFRecordSource(PickedSource):
    """The records of a set of TFRecord files as named fields, or ``(x, y)`` (see the module doc)."""

    def __init__(self, loc: Location, shards: dict[str, list[Shard]], params: dict[str, str], val_fraction: float):
        self.uri, self.location, self.root = loc.uri, loc, loc.root
        self.shards = [s for split in SPLITS for s in shards.get(split, [])]
        self._files = OpenFiles()
        #: split → (n, 2) rows: shard number, record number (val carved from train where there is none)
        self.rows, self.val_fraction = val_carve.shard_rows(
            self.uri,
            {split: [len(s.frames) for s in shards.get(split, [])] for split in SPLITS},
            val_fraction,
            "the train files hold no records",
            "records",
        )
        self.features = _merged([s.features for s in self.shards])
        self._pick(params)

    # -- which features become which fields --------------------------------------------------------

    def _pick(self, params: dict[str, str]) -> None:
        columns: dict[str, Field] = {}
        refused: dict[str, str] = {}
        for name, s in sorted(self.features.items()):
            kind, lo, hi = s["kind"], s["min"], s["max"]
            if kind == BYTES and hi > 1:
                refused[name] = f"holds up to {hi} byte strings per record; a field serves one"
            elif kind == BYTES:
                columns[name] = Field(name, "bytes", (), int(s["bytes"]))
            elif lo == hi:
                columns[name] = Field(name, _DTYPES[kind].name, () if hi == 1 else (hi,))
            else:
                columns[name] = Field(name, _DTYPES[kind].name, (None,), int(s["bytes"]))
        self.selection = select(self.uri, columns, refused, params, "feature")
        self.label = label = self.selection.label
        self.num_classes = 0
        if label is not None:
            s = self.features[label]
            self.num_classes = classes(self.uri, label, s["lo"], s["hi"], params.get("classes"))
            self.class_names = [str(i) for i in range(self.num_classes)]
        if self.selection.xy:
            x = self.selection.picks[0].field
            self.sample_shape, self.dtype, self.kind = x.fixed_shape, x.np_dtype, "image"
        else:
            self.sample_shape, self.dtype, self.kind = (0,), np.dtype(np.uint8), "fields"
        self._fields = self.selection.fields
        self._wanted = self.selection.columns

    @property
    def fields(self) -> list[Field]:
        return list(self._fields)

    # -- reads -----------------------------------------------------------------------------------

    def num_samples(self, split: str) -> int:
        return len(self.rows[split])

    def locate(self, split: str, indices: np.ndarray) -> list[str]:
        """``FILE@OFFSET+LENGTH`` per index: the file (relative to the dataset's root) and its record's
        frame (length, CRCs and the Example) as its index has it (a gzip file: in the decompressed bytes)."""
        out = []
        for shard, record in self.rows[split][np.asarray(indices, np.int64).reshape(-1)].tolist():
            s = self.shards[shard]
            off, length = (int(v) for v in s.frames[record])
            note = " (decompressed)" if s.local is not None else ""
            out.append(f"{relative_name(s.name, self.root)}@{off}+{HEADER + length + FOOTER}{note}")
        return out

    def _records(self, split: str, indices: np.ndarray) -> list[dict]:
        """The wanted features of records ``indices`` of ``split``: each file's records in offset
        order, neighbours in one read, every record's CRC checked."""
        idx = np.asarray(indices, np.int64).reshape(-1)
        n = len(self.rows[split])
        if len(idx) and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"index {int(idx.min() if idx.min() < 0 else idx.max())} is outside {split} (0..{n - 1})")
        rows = self.rows[split][idx]
        runs: list[tuple[int, int, int, list[tuple[int, int, int]]]] = []  # shard, start, end, [(row, off, len)]
        for shard in np.unique(rows[:, 0]).tolist() if len(rows) else []:
            mine = np.flatnonzero(rows[:, 0] == shard)
            frames = self.shards[shard].frames[rows[mine, 1]]
            for r in np.argsort(frames[:, 0], kind="stable").tolist():
                off, length = (int(v) for v in frames[r])
                end = off + HEADER + length + FOOTER
                if runs and runs[-1][0] == shard and off - runs[-1][2] <= COALESCE_GAP:
                    runs[-1][3].append((int(mine[r]), off, length))
                    runs[-1] = (shard, runs[-1][1], max(runs[-1][2], end), runs[-1][3])
                else:
                    runs.append((shard, off, end, [(int(mine[r]), off, length)]))
        out: list[dict] = [{}] * len(idx)
        for (shard, start, end, members), data in zip(runs, self._read(runs)):
            name = self.shards[shard].name
            if len(data) != end - start:
                raise DatasetError(f"{self.uri}: {name} changed or was cut short while read (at byte {start})")
            for row, off, length in members:
                at = off - start
                got, _ = struct.unpack_from("<QI", data, at)
                body = memoryview(data)[at + HEADER : at + HEADER + length]
                if got != length or masked_crc(body) != struct.unpack_from("<I", data, at + HEADER + length)[0]:
                    raise DatasetError(
                        f"{self.uri}: {name}: record at byte {off}: its CRC does not match (a corrupt record, "
                        "or the file changed since it was indexed)"
                    )
                try:
                    out[row] = parse_example(bytes(body), self._wanted)
                except ValueError as err:
                    raise DatasetError(f"{self.uri}: {name}: record at byte {off} is not an Example: {err}") from None
        return out

    def _read(self, runs: list) -> list[bytes]:
        remote = [(i, r) for i, r in enumerate(runs) if self.shards[r[0]].local is None]
        out: list[bytes] = [b""] * len(runs)
        with self.location.batch():
            got = self.location.read_ranges([(self.shards[s].path, a, b - a) for _, (s, a, b, _) in remote])
        for (i, _), data in zip(remote, got):
            out[i] = data
        for i, (shard, start, end, _) in enumerate(runs):
            if self.shards[shard].local is not None:
                out[i] = os.pread(self._fd(shard), end - start, start)
        return out

    def _fd(self, shard: int) -> int:
        local = self.shards[shard].local
        assert local is not None, "a shard read from its file is local"
        return self._files.fd(local)

    def _values(self, split: str, indices: np.ndarray) -> FieldBatch:
        records = self._records(split, indices)
        out: FieldBatch = {}
        for pick in self.selection.picks:
            values = [r[pick.column][1] if pick.column in r else None for r in records]
            if pick.field.dtype == "bytes":
                values = [v[0] if v else None for v in values]
            out[pick.field.name] = fill(pick, values, lambda i: f"{self.uri}: {split}[{int(indices[i])}]")
        self.check_labels(out, split)
        return out

    def info(self) -> SourceInfo:
        info = super().info()
        info.update({"format": "tfrecord", "path": str(self.root), "files": len(self.shards)})
        info["features"] = {name: s["kind"] for name, s in sorted(self.features.items())}
        info.update(self.location.info())
        if self.val_fraction is not None:
            info["val_fraction"] = self.val_fraction
            info["val_carved"] = "the tail of train, in file order"
        return info

    def close(self) -> None:
        self._files.close()
        self.location.close()


def _merged(summaries: list[dict[str, dict]]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    seen = 0
    for summary in summaries:
        for name, s in summary.items():
            if name not in out:
                out[name] = dict(s, min=0 if seen else s["min"])
                continue
            t = out[name]
            if t["kind"] != s["kind"]:
                raise DatasetError(f"feature {name!r} is a {s['kind']} list in one file, a {t['kind']} list in another")
            t["min"], t["max"], t["bytes"] = (
                min(t["min"], s["min"]),
                max(t["max"], s["max"]),
                max(t["bytes"], s["bytes"]),
            )
            if s["hi"] >= s["lo"]:
                t["lo"], t["hi"] = (
                    (s["lo"], s["hi"]) if t["hi"] < t["lo"] else (min(t["lo"], s["lo"]), max(t["hi"], s["hi"]))
                )
        for name in out.keys() - summary.keys():
            out[name]["min"] = 0  # missing from every record of this file
        seen += 1
    return out


def open_location(loc: Location) -> TFRecordSource:
    """The TFRecord files at ``loc`` (local files, HTTP, an object store), popping the parameters this
    layout knows (see the module doc). Raises :class:`DatasetError`."""
    params = {k: loc.params.pop(k) for k in PARAMS if k in loc.params}
    fraction = val_fraction(loc.uri, params.get("val_fraction", "0.1"))
    paths = sorted((p for p in loc.root.iterdir() if is_tfrecord(p.name) and p.is_file()), key=lambda p: p.name)
    if not paths:
        raise DatasetError(f"{loc.uri}: no TFRecord files in {loc.root}; expected {EXPECTED}")
    splits = [split_of(p.name) for p in paths]
    if not any(splits):
        splits = ["train"] * len(paths)
    shards: dict[str, list[Shard]] = {}
    for path, split in zip(paths, splits):
        if split is None:
            log.warning("%s: %s names no split (train, val, test); left out", loc.uri, path.name)
            continue
        shards.setdefault(split, []).append(_shard(loc, path))
    if "train" not in shards:
        raise DatasetError(f"{loc.uri}: no TFRecord file names train among {', '.join(p.name for p in paths[:5])}")
    return TFRecordSource(loc, shards, params, fraction)


#: This layout's line in the registry (:mod:`..layouts`).
FORMAT = Format("tfrecord", lambda loc: detect(loc.root), open_location, EXPECTED, "source")

"""WebDataset shards as an encoded-sample store: splits from shard names, samples by index, reads coalesced.

Shards named ``train-*.tar``, ``val-*.tar`` (or ``valid``/``validation``), ``test-*.tar`` make the
splits; when no shard name starts with a split, every shard is train. Shards are taken in name order
and their samples in tar order. Where no shard is val, val is carved from train per class as for
ImageFolder trees (the samples whose key hashes lowest). Labels come from ``.cls`` members; class
names from ``classes.txt`` beside the shards (one per line), else ``0``, ``1``, ….

A batch's members are read shard by shard in offset order, neighbours (gaps under
:data:`COALESCE_GAP`) in one read. Local shards and ``classes.txt`` are confined (:mod:`.confine`): one
that is a symlink to somewhere outside the dataset's directory is refused at open, and checked again as
opened for reading.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

from libbus.errors import DatasetError

from .confine import Confinement
from .imagefolder import Encoded
from .imageops import IMAGE_EXTS
from .location import Format, Location
from .tarshards import ShardIndex, build_index, load_cached, load_or_build, save

__all__ = [
    "COALESCE_GAP",
    "EXPECTED",
    "FORMAT",
    "ShardStore",
    "detect",
    "open_local_shards",
    "open_object_shards",
    "open_remote_shards",
    "open_store",
    "split_of",
]

log = logging.getLogger(__name__)

EXPECTED = "WebDataset: *.tar shards (train-*.tar, val-*.tar, test-*.tar)"
#: Members closer than this are read together (one pread) rather than apart.
COALESCE_GAP = 64 << 10
IMAGE_MEMBERS = tuple(e[1:] for e in IMAGE_EXTS)
SPLIT_PREFIXES = {"train": ("train",), "val": ("validation", "valid", "val"), "test": ("test",)}


def detect(root: Path) -> bool:
    return any(p.suffix == ".tar" and p.is_file() for p in root.iterdir())


def split_of(name: str) -> str | None:
    lower = name.lower()
    for split, prefixes in SPLIT_PREFIXES.items():
        if any(lower.startswith(p) and not lower[len(p) : len(p) + 1].isalpha() for p in prefixes):
            return split
    return None


class ShardStore:
    """The samples of a set of shards, by split: ``(shard number, sample number)`` in index order.

    ``pread(shard, offset, n)`` reads shard bytes (a local file or an HTTP range).
    """

    def __init__(self, uri: str, names: list[str], indexes: list[ShardIndex], pread, class_names, val_fraction):
        self.uri, self.names, self.indexes, self.pread = uri, names, indexes, pread
        splits = [split_of(n) for n in names]
        if not any(splits):
            splits = ["train"] * len(names)
        self.rows: dict[str, list[tuple[int, int]]] = {s: [] for s in ("train", "val", "test")}
        for shard, split in enumerate(splits):
            if split is None:
                log.warning("%s: shard %s names no split (train-, val-, test-); left out", uri, names[shard])
                continue
            self.rows[split] += [(shard, i) for i in range(len(indexes[shard].keys))]
        if not self.rows["val"] and val_fraction > 0:
            self._carve(val_fraction)
        labels = [lab for ix in indexes for lab in ix.labels if lab is not None]
        self.class_names = list(class_names) if class_names else [str(i) for i in range(max(labels, default=-1) + 1)]
        if labels and max(labels) >= len(self.class_names):
            raise DatasetError(f"{uri}: a .cls holds {max(labels)} but classes.txt names {len(self.class_names)}")

    def _carve(self, fraction: float) -> None:
        by_class: dict[int | None, list[tuple[int, int]]] = {}
        for shard, i in self.rows["train"]:
            by_class.setdefault(self.indexes[shard].labels[i], []).append((shard, i))
        val = set()
        for members in by_class.values():
            ranked = sorted(members, key=lambda r: hashlib.blake2b(self._key(r).encode(), digest_size=8).digest())
            val.update(ranked[: int(round(len(members) * fraction))])
        self.rows["val"] = [r for r in self.rows["train"] if r in val]
        self.rows["train"] = [r for r in self.rows["train"] if r not in val]

    def _key(self, row: tuple[int, int]) -> str:
        return f"{self.names[row[0]]}:{self.indexes[row[0]].keys[row[1]]}"

    def num_samples(self, split: str) -> int:
        return len(self.rows[split])

    def fetch(self, split: str, indices) -> list[Encoded]:
        """Each sample's image bytes (None when it has none), class id (-1 without a ``.cls``) and text."""
        rows = [self.rows[split][int(i)] for i in indices]
        wanted: dict[int, list[tuple[int, int, int, str]]] = {}  # shard → (offset, size, row, ext)
        for r, (shard, i) in enumerate(rows):
            members = self.indexes[shard].members[i]
            image = next((e for e in IMAGE_MEMBERS if e in members), None)
            for ext in (image, "txt"):
                if ext is not None and ext in members:
                    off, size = members[ext]
                    wanted.setdefault(shard, []).append((off, size, r, ext))
        found: list[dict[str, bytes]] = [{} for _ in rows]
        runs = [run for shard, parts in wanted.items() for run in _coalesced(shard, sorted(parts))]
        for (shard, start, end, run), data in zip(runs, self.read_many([(s, a, b - a) for s, a, b, _ in runs])):
            if len(data) != end - start:
                raise DatasetError(f"{self.uri}: shard {self.names[shard]} changed or was cut short while read")
            for off, size, r, ext in run:
                found[r][ext] = data[off - start : off - start + size]
        out = []
        for r, (shard, i) in enumerate(rows):
            index, got = self.indexes[shard], found[r]
            image = next((got[e] for e in IMAGE_MEMBERS if e in got), None)
            text = got["txt"].decode("utf-8", "replace") if "txt" in got else None
            label = index.labels[i]
            out.append(Encoded(image, -1 if label is None else label, self._key((shard, i)), text))
        return out

    def read_many(self, runs: list[tuple[int, int, int]]) -> list[bytes]:
        """The bytes of each ``(shard, offset, length)`` of a batch (one after another here)."""
        return [self.pread(shard, off, n) for shard, off, n in runs]

    def close(self) -> None:
        pass


class LocalShards(ShardStore):
    """Shards in a local directory, read with ``pread`` on descriptors opened once."""

    def __init__(
        self, uri: str, paths: list[Path], indexes: list[ShardIndex], class_names, val_fraction: float, confinement
    ):
        self.paths, self.confinement = paths, confinement
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        super().__init__(uri, [p.name for p in paths], indexes, self._pread, class_names, val_fraction)

    def _pread(self, shard: int, offset: int, n: int) -> bytes:
        with self._lock:
            fd = self._fds.get(shard)
            if fd is None:
                fd = self._fds[shard] = self.confinement.open(self.paths[shard])
        return os.pread(fd, n, offset)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


#: A wanted member: (offset in the shard, size, row in the batch, extension).
Part = tuple[int, int, int, str]


def _coalesced(shard: int, parts: list[Part]) -> list[tuple[int, int, int, list[Part]]]:
    """``(shard, start, end, members)`` runs of a shard's wanted members (sorted by offset): neighbours
    closer than :data:`COALESCE_GAP` share one read."""
    out: list[tuple[int, int, int, list[Part]]] = []
    for part in parts:
        if out and part[0] - out[-1][2] <= COALESCE_GAP:
            out[-1][3].append(part)
            out[-1] = (shard, out[-1][1], max(out[-1][2], part[0] + part[1]), out[-1][3])
        else:
            out.append((shard, part[0], part[0] + part[1], [part]))
    return out


def class_names_file(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [line.strip() for line in text.splitlines() if line.strip()]


def open_local_shards(
    uri: str, root: Path, cache: Path, val_fraction: float, *, strict: bool, confinement: Confinement | None = None
) -> LocalShards:
    """Index (or load the cached indexes of) every ``*.tar`` in ``root``, each checked by ``confinement``.

    ``strict``: a truncated shard is refused (naming it and what was cut); otherwise its whole samples
    are served and the cut is logged. Raises :class:`DatasetError`.
    """
    paths = sorted(p for p in root.iterdir() if p.suffix == ".tar" and p.is_file())
    if not paths:
        raise DatasetError(f"{uri}: no .tar shards in {root}; expected {EXPECTED}")
    confinement = confinement or Confinement(root)
    indexes = []
    for path in paths:
        confinement.check(path)
        try:
            index = load_or_build(path, cache)
        except OSError as err:
            raise DatasetError(f"{uri}: cannot read shard {path}: {err.strerror or err}") from None
        indexes.append(_checked(uri, str(path), index, strict))
    names_file = root / "classes.txt"
    if names_file.is_file():
        confinement.check(names_file)
    names = class_names_file(names_file.read_text() if names_file.is_file() else None)
    return LocalShards(uri, paths, indexes, names, val_fraction, confinement)


def _checked(uri: str, name: str, index: ShardIndex, strict: bool) -> ShardIndex:
    if index.truncated:
        if strict:
            raise DatasetError(
                f"{uri}: shard {name} is truncated: {index.truncated} (bad=skip serves its "
                f"{len(index.keys)} whole samples)"
            )
        log.warning(
            "%s: shard %s is truncated (%s): serving its %d whole samples", uri, name, index.truncated, len(index.keys)
        )
    return index


def open_remote_shards(uri: str, urls: list[str], client, cache: Path, val_fraction: float, *, strict: bool):
    """Shards behind HTTP(S) (``client``: a :class:`~.httprange.RangeClient`): each index from ``cache``
    when the shard's size and ETag (or Last-Modified) match, else built with range reads of the headers
    and cached. Raises :class:`DatasetError` (an :class:`~.httprange.HttpError` names URL and status)."""
    indexes = []
    for url in urls:
        size, stamp = client.version(url)
        cached = cache / (hashlib.blake2b(url.encode(), digest_size=12).hexdigest() + ".index.json")
        index = load_cached(cached, size, stamp)
        if index is None:
            index = build_index(url, lambda off, n, u=url: _get(client, u, off, n), size, stamp, buffer=1 << 20)
            save(index, cached)
        indexes.append(_checked(uri, url, index, strict))
    names = [u.rsplit("/", 1)[-1] for u in urls]
    return RemoteShards(uri, names, indexes, client, urls, val_fraction)


class RemoteShards(ShardStore):
    """Shards behind HTTP(S), read by range through the dataset's client (released at :meth:`close`)."""

    def __init__(self, uri: str, names: list[str], indexes: list[ShardIndex], client, urls: list[str], val_fraction):
        self.client = client
        super().__init__(
            uri, names, indexes, lambda shard, off, n: _get(client, urls[shard], off, n), None, val_fraction
        )

    def close(self) -> None:
        self.client.close()


def _get(client, url: str, offset: int, n: int) -> bytes:
    buf = bytearray(n)
    client.read_into(url, offset, [memoryview(buf)])
    return bytes(buf)


class ObjectShards(ShardStore):
    """Shards in an object store: a batch's coalesced runs fetched together through the dataset's
    :class:`~.objects.ObjectClient` (bounded, retried, one deadline, If-Match on the ETag seen at open)."""

    def __init__(self, uri: str, paths: list, indexes: list[ShardIndex], class_names, val_fraction: float):
        self.client, self.metas = paths[0].tree.client, [p.meta for p in paths]
        pread = lambda shard, off, n: bytes(self.client.fetch(self.metas[shard], off, n))  # noqa: E731
        super().__init__(uri, [p.name for p in paths], indexes, pread, class_names, val_fraction)

    def read_many(self, runs: list[tuple[int, int, int]]) -> list[bytes]:
        with self.client.batch():
            return self.client.read_ranges([(self.metas[shard], off, n) for shard, off, n in runs])

    def close(self) -> None:
        self.client.close()


def open_object_shards(uri: str, root, cache: Path, val_fraction: float, *, strict: bool) -> ObjectShards:
    """Every ``*.tar`` object under ``root`` (an :class:`~.objects.ObjectPath`): each index from
    ``cache`` (a local directory) when the object's size and ETag match, else built with ranged reads
    of its headers and cached there. Raises :class:`DatasetError` (an ``ObjectError`` names the object)."""
    paths = sorted(p for p in root.iterdir() if p.suffix == ".tar" and p.is_file())
    if not paths:
        raise DatasetError(f"{uri}: no .tar shards in {root}; expected {EXPECTED}")
    client, indexes = root.tree.client, []
    for path in paths:
        meta = path.meta
        cached = cache / (hashlib.blake2b(str(path).encode(), digest_size=12).hexdigest() + ".index.json")
        index = load_cached(cached, meta.size, meta.etag)
        if index is None:
            pread = lambda off, n, m=meta: bytes(client.fetch(m, off, n))  # noqa: E731
            index = build_index(str(path), pread, meta.size, meta.etag, buffer=1 << 20)
            save(index, cached)
        indexes.append(_checked(uri, str(path), index, strict))
    names_file = root / "classes.txt"
    names = class_names_file(names_file.read_text() if names_file.is_file() else None)
    return ObjectShards(uri, paths, indexes, names, val_fraction)


def open_store(loc: Location, val_fraction: float) -> ShardStore:
    """The shards at ``loc``: each location's reader (local ``pread``, HTTP ranges, object ranges
    fetched together under one deadline), their indexes cached in ``loc.cache_dir()``."""
    strict = loc.params.get("bad") != "skip"
    if loc.kind == "file":
        return open_local_shards(
            loc.uri, loc.root, loc.cache_dir(), val_fraction, strict=strict, confinement=loc.confinement
        )
    if loc.kind == "http":
        urls = [p.url for p in sorted(loc.root.iterdir()) if p.suffix == ".tar"]
        return open_remote_shards(loc.uri, urls, loc.client, loc.cache_dir(), val_fraction, strict=strict)
    return open_object_shards(loc.uri, loc.root, loc.cache_dir(), val_fraction, strict=strict)


#: This layout's line in the registry (:mod:`..layouts`).
FORMAT = Format("webdataset", lambda loc: detect(loc.root), open_store, EXPECTED, "samples")

"""WebDataset shards as an encoded-sample store: splits from shard names, samples by index, reads coalesced.

Shards named ``train-*.tar``, ``val-*.tar`` (or ``valid``/``validation``), ``test-*.tar`` make the
splits; when no shard name starts with a split, every shard is train. Shards are taken in name order
and their samples in tar order. Where no shard is val, val is carved from train per class as for
ImageFolder trees (the samples whose key hashes lowest). Labels come from ``.cls`` members; class
names from ``classes.txt`` beside the shards (one per line), else ``0``, ``1``, ….

A batch's members are read shard by shard in offset order, neighbours (gaps under
:data:`COALESCE_GAP`) in one read. Local shards and ``classes.txt`` are confined (:mod:`~services.provider.sources.storage.confine`): one
that is a symlink to somewhere outside the dataset's directory is refused at open, and checked again as
opened for reading.
"""

from __future__ import annotations

import logging
from pathlib import Path

from libbus.errors import DatasetError

from ..base import relative_name
from . import val_carve
from .imagefolder import Encoded
from .imageops import IMAGE_EXTS
from .location import Format, Location
from .tarshards import ShardIndex, build_index, load_cached, save

__all__ = [
    "COALESCE_GAP",
    "EXPECTED",
    "FORMAT",
    "ShardStore",
    "detect",
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
    """The samples of a set of shards, by split: ``(shard number, sample number)`` in index order, their
    bytes read through the shards' location (a batch's runs together: :meth:`~.location.Location.read_ranges`).
    """

    def __init__(self, uri: str, location: Location, paths: list, indexes: list[ShardIndex], class_names, val_fraction):
        self.uri, self.location, self.paths, self.indexes = uri, location, paths, indexes
        #: Shard names (the last part of each path: ``train-0000.tar``): splits come from them.
        self.names = names = [str(p.name).rsplit("/", 1)[-1] for p in paths]
        splits = [split_of(n) for n in names]
        if not any(splits):
            splits = ["train"] * len(names)
        self.rows: dict[str, list[tuple[int, int]]] = {s: [] for s in ("train", "val", "test")}
        for shard, split in enumerate(splits):
            if split is None:
                log.warning("%s: shard %s names no split (train-, val-, test-); left out", uri, names[shard])
                continue
            self.rows[split] += [(shard, i) for i in range(len(indexes[shard].keys))]
        #: Where val came from, for DatasetInfo (``val_fraction``, ``val_carved``): None when the shards hold it.
        self.val_fraction: float | None = None
        self.val_carved = "per class, the samples whose key hashes lowest"
        if not self.rows["val"] and val_fraction > 0:
            self._carve(val_fraction)
            self.val_fraction = val_fraction
        labels = [lab for ix in indexes for lab in ix.labels if lab is not None]
        self.class_names = list(class_names) if class_names else [str(i) for i in range(max(labels, default=-1) + 1)]
        if labels and max(labels) >= len(self.class_names):
            raise DatasetError(f"{uri}: a .cls holds {max(labels)} but classes.txt names {len(self.class_names)}")

    def _carve(self, fraction: float) -> None:
        self.rows["train"], self.rows["val"] = val_carve.lowest_hashes_per_class(
            self.rows["train"], fraction, label=lambda r: self.indexes[r[0]].labels[r[1]], name=self._key
        )

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
            image_ext = next((e for e in IMAGE_MEMBERS if e in members), None)
            for ext in (image_ext, "txt"):
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

    def locate(self, split: str, indices) -> list[str]:
        """``SHARD:KEY.EXT@OFFSET+SIZE`` per sample: the shard (relative to the dataset's root), the tar
        member of its image (else of its text, else its first member) and that member's bytes in the shard."""
        out = []
        for i in indices:
            shard, n = self.rows[split][int(i)]
            members = self.indexes[shard].members[n]
            ext = next((e for e in (*IMAGE_MEMBERS, "txt") if e in members), next(iter(members), None))
            where = relative_name(str(self.paths[shard]), self.location.root)
            if ext is None:
                out.append(f"{where}:{self.indexes[shard].keys[n]}")
            else:
                off, size = members[ext]
                out.append(f"{where}:{self.indexes[shard].keys[n]}.{ext}@{off}+{size}")
        return out

    def read_many(self, runs: list[tuple[int, int, int]]) -> list[bytes]:
        """The bytes of each ``(shard, offset, length)`` of a batch."""
        return self.location.read_ranges([(self.paths[shard], off, n) for shard, off, n in runs])

    def close(self) -> None:
        self.location.close()


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


def open_store(loc: Location, val_fraction: float) -> ShardStore:
    """Every ``*.tar`` at ``loc`` (a local directory, files behind HTTP, an object-store prefix), each
    index from ``loc``'s cache when the shard's size and version (mtime, ETag) match, else built by
    walking its headers and cached there. ``bad=skip``: a truncated shard serves its whole samples (else
    it is refused, naming it and what was cut). Raises :class:`DatasetError`."""
    strict = loc.params.get("bad") != "skip"
    paths = sorted(p for p in loc.root.iterdir() if p.suffix == ".tar" and p.is_file())
    if not paths:
        raise DatasetError(f"{loc.uri}: no .tar shards in {loc.root}; expected {EXPECTED}")
    indexes = [_checked(loc.uri, str(path), _index(loc, path), strict) for path in paths]
    names_file = loc.root / "classes.txt"
    names = class_names_file(loc.read(names_file).decode() if names_file.is_file() else None)
    return ShardStore(loc.uri, loc, paths, indexes, names, val_fraction)


def _index(loc: Location, path) -> ShardIndex:
    size, stamp = loc.stamp(path)
    cached = loc.index_path(path, ".index.json")
    index = load_cached(cached, size, stamp)
    if index is None:
        try:
            index = build_index(str(path), lambda off, n: loc.pread(path, off, n), size, stamp, loc.read_ahead)
        except OSError as err:
            raise DatasetError(f"{loc.uri}: cannot read shard {path}: {err.strerror or err}") from None
        save(index, cached)
    return index


#: This layout's line in the registry (:mod:`..layouts`).
FORMAT = Format("webdataset", lambda loc: detect(loc.root), open_store, EXPECTED, "samples")

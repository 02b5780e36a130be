"""MNIST-style IDX files: ``{train,t10k}-{images,labels}-idx<N>-ubyte[.gz]`` (Fashion-MNIST, and
EMNIST's ``emnist-<set>-train-…`` prefixes, name theirs the same way).

An IDX file is ``0 0 <type> <ndim>``, ``ndim`` big-endian uint32 dimensions, then the values in
big-endian order. Any type and dimensions are read; samples are served in native order. Images of
shape ``(N, H, W)`` are served as ``(1, H, W)``, the channel-first shape image models take. A
``.gz`` file is decompressed once into the cache directory (see :mod:`~services.provider.sources.storage.decompress`).
"""

from __future__ import annotations

import gzip
import math
import re
import struct
from functools import partial
from pathlib import Path

import numpy as np

from libbus.errors import DatasetError

from ..storage.decompress import cached
from ..storage.reader import Segment, read_at
from .dataset import Context, Layout, Table
from .location import Format

__all__ = ["FORMAT", "detect", "open_idx", "read_header"]

#: IDX type code → dtype as stored (big-endian).
DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
NAME = re.compile(r"^(?:.*-)?(train|t10k|test|val)-(images|labels)[.-]idx\d+-ubyte(\.gz)?$")
SPLIT_OF = {"train": "train", "t10k": "test", "test": "test", "val": "val"}
EXPECTED = "train-images-idx3-ubyte[.gz] with train-labels-idx1-ubyte[.gz] (MNIST IDX)"


def _find(root: Path) -> dict[tuple[str, str], Path]:
    found: dict[tuple[str, str], Path] = {}
    for path in sorted(root.iterdir()):
        m = NAME.match(path.name)
        if not m or not path.is_file():
            continue
        key = (SPLIT_OF[m.group(1)], m.group(2))
        if key in found and (found[key].suffix == ".gz") == (path.suffix == ".gz"):
            raise DatasetError(f"{root}: both {found[key].name} and {path.name} hold {key[0]} {key[1]}; keep one")
        if key not in found or found[key].suffix == ".gz":  # the uncompressed file wins
            found[key] = path
    return found


def detect(root: Path) -> bool:
    """Whether ``root`` holds IDX train images."""
    return ("train", "images") in _find(root)


def read_header(seg: Segment, noun: str = "items") -> tuple[np.dtype, tuple[int, ...], Segment]:
    """An IDX file's stored dtype, dimensions and the segment of its values, sizes checked."""
    head = read_at(seg, 4)
    if len(head) < 4 or head[:2] != b"\0\0" or head[3] == 0:
        raise DatasetError(
            f"{seg.name}: not an IDX file: expected 00 00 <type> <ndim> at its start, "
            f"found {head.hex(' ') or 'nothing'}"
        )
    if head[2] not in DTYPES:
        raise DatasetError(
            f"{seg.name}: unknown IDX type code 0x{head[2]:02X}; expected one of "
            f"{', '.join(f'0x{c:02X}' for c in DTYPES)}"
        )
    dtype, ndim = DTYPES[head[2]], head[3]
    raw = read_at(seg, 4 * ndim, 4)
    if len(raw) < 4 * ndim:
        raise DatasetError(
            f"{seg.name}: truncated header: {ndim} dimensions need {4 + 4 * ndim} bytes, the file has {seg.length}"
        )
    dims = struct.unpack(f">{ndim}I", raw)
    start = 4 + 4 * ndim
    want = start + math.prod(dims) * dtype.itemsize
    if seg.length != want:
        shape = "x".join(map(str, dims[1:])) or "scalars"
        what = "truncated" if seg.length < want else "longer than its header says"
        raise DatasetError(
            f"{seg.name}: header says {dims[0]} {noun} of {shape} {dtype.name} ({want} bytes) "
            f"but the file has {seg.length} bytes ({what})"
        )
    return dtype, dims, Segment(seg.name, seg.fd, seg.offset + start, want - start, seg.remote)


def _open(ctx: Context, path: Path) -> Segment:
    if path.suffix != ".gz":
        return ctx.segment(path)
    copy = cached(path, ctx.cache_dir, path.name[:-3], partial(gzip.open, path, "rb"))
    return ctx.segment(copy, name=f"{path} (decompressed to {copy})")


def open_idx(ctx: Context) -> Layout:
    """The IDX splits in ``ctx.root``. Raises :class:`DatasetError` for a missing, truncated or
    inconsistent file."""
    found = _find(ctx.root)
    tables, kinds = {}, set()
    for split in ("train", "val", "test"):
        if (split, "images") not in found:
            if (split, "labels") in found:
                raise DatasetError(
                    f"{found[split, 'labels']}: labels without images; expected "
                    f"{found[split, 'labels'].name.replace('labels', 'images')} beside it"
                )
            continue
        if (split, "labels") not in found:
            raise DatasetError(
                f"{found[split, 'images']}: images without labels; expected "
                f"{found[split, 'images'].name.replace('images', 'labels')} beside it"
            )
        xdt, xdims, xseg = read_header(_open(ctx, found[split, "images"]), "images")
        ydt, ydims, yseg = read_header(_open(ctx, found[split, "labels"]), "labels")
        if xdims[0] != ydims[0]:
            raise DatasetError(
                f"{found[split, 'images']} has {xdims[0]} images but {found[split, 'labels']} has {ydims[0]} labels"
            )
        sample = tuple(xdims[1:]) if len(xdims) != 3 else (1, *xdims[1:])
        kinds.add((xdt, sample, ydt, tuple(ydims[1:])))
        if len(kinds) > 1:
            raise DatasetError(
                f"{found[split, 'images']}: its samples or labels differ in type or shape from the train split's"
            )
        xbytes = math.prod(sample) * xdt.itemsize
        ybytes = math.prod(ydims[1:]) * ydt.itemsize
        tables[split] = Table(
            xdims[0],
            [Table.single(xseg, xdims[0], xbytes, "x"), Table.single(yseg, ydims[0], ybytes, "y")],
            label_name=yseg.name,
        )
    return Layout.of_splits(
        "idx", tables, kinds, ctx.settings, f"{ctx.root}: no IDX image/label pairs; expected {EXPECTED}"
    )


#: This layout's line in the registry (:mod:`..layouts`).
FORMAT = Format("idx", lambda loc: detect(loc.root), open_idx, EXPECTED, where=("file", "object"), compressed=(".gz",))

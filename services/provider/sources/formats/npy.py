"""NumPy arrays: ``.npy`` pairs per split (``train_x.npy`` + ``train_y.npy``, ``val_…``, ``test_…``;
``x_train.npy`` names work too) or one ``.npz`` holding them (``train_x``/``x_train``, or ``x``/``y``
for train; Keras' ``mnist.npz`` reads as is). Samples are the rows of ``x``, labels the rows of ``y``.

The ``.npy`` header is parsed and the rows are read by offset. An ``.npz`` is a zip: members stored
uncompressed (``np.savez``) are read in place; compressed ones (``np.savez_compressed``) are
extracted once into the cache directory.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import IO

import numpy as np

from libbus.errors import DatasetError

from ..storage.decompress import cached
from ..storage.reader import Segment, read_at
from .dataset import Context, Layout, Table
from .location import Format

__all__ = ["FORMAT", "detect", "npy_header", "npz_members", "open_npy"]

EXPECTED = "train_x.npy with train_y.npy (or an .npz holding them)"
ZIP_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature … file name length, extra field length


def _names(split: str, column: str) -> list[str]:
    return [f"{split}_{column}", f"{column}_{split}"] + ([column] if split == "train" else [])


def detect(root: Path) -> bool:
    """Whether ``root`` holds train ``x`` as ``.npy`` or any ``.npz``."""
    return any((root / f"{n}.npy").is_file() for n in _names("train", "x")) or any(root.glob("*.npz"))


def npy_header(seg: Segment) -> tuple[np.dtype, tuple[int, ...], Segment]:
    """A ``.npy`` array's dtype, shape and the segment of its data, sizes checked."""
    head = read_at(seg, 12)
    try:
        version = np.lib.format.read_magic(io.BytesIO(head))
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"format version {version} (expected 1.0 or 2.0)")
        size_len = 2 if version == (1, 0) else 4
        header_len = 8 + size_len + int.from_bytes(head[8 : 8 + size_len], "little")
        f = io.BytesIO(read_at(seg, header_len))
        np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(f)
    except ValueError as err:
        raise DatasetError(f"{seg.name}: not a readable .npy array: {err}") from err
    if fortran and len(shape) > 1:
        raise DatasetError(f"{seg.name}: stored in Fortran order; save np.ascontiguousarray(a) instead")
    if any(d < 0 for d in shape):
        raise DatasetError(f"{seg.name}: header gives a negative dimension in shape {shape}")
    if dtype.kind not in "biuf" or not shape:
        raise DatasetError(
            f"{seg.name}: holds {'a scalar' if not shape else dtype.name + ' values'}; "
            "expected an array of numbers with one row per sample"
        )
    want = header_len + math.prod(shape) * dtype.itemsize
    if seg.length != want:
        what = "truncated" if seg.length < want else "longer than its header says"
        raise DatasetError(
            f"{seg.name}: header says shape {shape} of {dtype} ({want} bytes) but the file "
            f"has {seg.length} bytes ({what})"
        )
    return dtype, tuple(shape), Segment(seg.name, seg.fd, seg.offset + header_len, want - header_len, seg.remote)


@contextmanager
def _member(path: Path, info: zipfile.ZipInfo) -> Iterator[IO[bytes]]:
    """The member ``info`` of the archive ``path``, opened for reading."""
    with zipfile.ZipFile(path) as zf, zf.open(info) as f:
        yield f


def npz_members(ctx: Context, path: Path) -> dict[str, Segment]:
    """Each ``.npy`` member of an ``.npz`` as a segment: in place if stored, else a cached copy."""
    try:
        with zipfile.ZipFile(path) as zf:
            infos = [i for i in zf.infolist() if i.filename.endswith(".npy")]
    except (zipfile.BadZipFile, OSError) as err:
        raise DatasetError(f"{path}: not a readable .npz (zip) archive: {err}") from err
    whole = ctx.segment(path)
    members = {}
    for info in infos:
        name = info.filename[:-4]
        if info.compress_type == zipfile.ZIP_STORED:
            local = os.pread(whole.fd, ZIP_LOCAL_HEADER.size, info.header_offset)
            if len(local) < ZIP_LOCAL_HEADER.size or local[:4] != b"PK\x03\x04":
                raise DatasetError(
                    f"{path}: member {info.filename} has no local header at byte "
                    f"{info.header_offset}; the archive is damaged"
                )
            _, name_len, extra_len = ZIP_LOCAL_HEADER.unpack(local)
            start = info.header_offset + ZIP_LOCAL_HEADER.size + name_len + extra_len
            if start + info.file_size > whole.length:
                raise DatasetError(f"{path}: member {info.filename} runs past the end of the archive; truncated?")
            members[name] = Segment(f"{path}[{info.filename}]", whole.fd, start, info.file_size)
        else:
            copy = cached(path, ctx.cache_dir, f"{path.stem}.{info.filename}", partial(_member, path, info))
            members[name] = ctx.segment(copy, name=f"{path}[{info.filename}] (extracted to {copy})")
    return members


def open_npy(ctx: Context) -> Layout:
    """The ``.npy``/``.npz`` splits in ``ctx.root``; raises :class:`DatasetError` for a missing,
    truncated or mismatched array."""
    npz = sorted(ctx.root.glob("*.npz"))
    if len(npz) > 1:
        raise DatasetError(
            f"{ctx.root}: several .npz files ({', '.join(p.name for p in npz)}); keep one per dataset directory"
        )
    members: Mapping[str, Segment | Path]  # an .npz's members as segments, else the .npy files
    if npz and not any((ctx.root / f"{n}.npy").is_file() for n in _names("train", "x")):
        members = npz_members(ctx, npz[0])
        what = f"{npz[0]} member "
    else:
        members = {p.stem: p for p in ctx.root.glob("*.npy")}
        what = ""

    def find(split: str, column: str):
        return next(((n, members[n]) for n in _names(split, column) if n in members), (None, None))

    tables, kinds = {}, set()
    for split in ("train", "val", "test"):
        (xn, x), (yn, y) = find(split, "x"), find(split, "y")
        if x is None and y is None:
            continue
        if x is None or y is None:
            have, lack = (xn, f"{split}_y") if y is None else (yn, f"{split}_x")
            raise DatasetError(f"{ctx.root}: {what}{have}.npy has no partner; expected {what}{lack}.npy")
        xdt, xshape, xseg = npy_header(x if isinstance(x, Segment) else ctx.segment(x))
        ydt, yshape, yseg = npy_header(y if isinstance(y, Segment) else ctx.segment(y))
        if xshape[0] != yshape[0]:
            raise DatasetError(
                f"{what}{xn}.npy has {xshape[0]} samples but {what}{yn}.npy has {yshape[0]} (in {ctx.root})"
            )
        kinds.add((xdt, xshape[1:], ydt, yshape[1:]))
        if len(kinds) > 1:
            raise DatasetError(f"{xseg.name}: the {split} arrays differ in dtype or row shape from the other splits'")
        n = xshape[0]
        tables[split] = Table(
            n,
            [
                Table.single(xseg, n, math.prod(xshape[1:]) * xdt.itemsize, "x"),
                Table.single(yseg, n, math.prod(yshape[1:]) * ydt.itemsize, "y"),
            ],
            label_name=yseg.name,
        )
    return Layout.of_splits("npy", tables, kinds, ctx.settings, f"{ctx.root}: no train arrays; expected {EXPECTED}")


#: This layout's line in the registry (:mod:`..layouts`).
FORMAT = Format("npy", lambda loc: detect(loc.root), open_npy, EXPECTED, compressed=(".npz",))

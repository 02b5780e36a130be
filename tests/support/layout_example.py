"""A layout written the way a new one is (docs/architecture.md, "Where to add things"): one module that
reads its files through ``ctx.segment`` and ends in its ``FORMAT`` line. tests/provider/sources/test_sources_contract.py
adds that line to the registry and reads it at every location, with nothing else changed.

The layout: ``SPLIT.rows`` files (``train.rows``, ``test.rows``), each a little-endian uint32 row width
``W`` followed by rows of ``W`` float32 values and one uint8 class id.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from libbus.errors import DatasetError
from services.provider.sources.formats.dataset import Context, Layout, Table
from services.provider.sources.formats.location import Format
from services.provider.sources.storage.reader import ByteSpace, Records, Segment, read_at

__all__ = ["FORMAT", "write_rows"]

EXPECTED = "train.rows (a uint32 row width W, then rows of W float32 and a uint8 class id)"


def _table(ctx: Context, path) -> tuple[Table, int]:
    seg = ctx.segment(path)
    (width,) = struct.unpack("<I", read_at(seg, 4))
    record = 4 * width + 1
    if (seg.length - 4) % record:
        raise DatasetError(f"{seg.name}: not a whole number of {record}-byte rows")
    count = (seg.length - 4) // record
    rows = Segment(seg.name, seg.fd, seg.offset + 4, seg.length - 4, seg.remote)
    records = Records(ByteSpace([rows]), 0, record, count, [(0, 4 * width), (4 * width, 1)])
    return Table(count, [(records, ["x", "y"])], label_name=seg.name), width


def open_rows(ctx: Context) -> Layout:
    tables, width = {}, 0
    for split in ("train", "val", "test"):
        if (ctx.root / f"{split}.rows").is_file():
            tables[split], width = _table(ctx, ctx.root / f"{split}.rows")
    return Layout("rows", tables, (width,), np.dtype("<f4"), (), np.dtype("u1"), ctx.settings.get("num_classes"))


FORMAT = Format("rows", lambda loc: (loc.root / "train.rows").is_file(), open_rows, EXPECTED)


def write_rows(d: Path, rng: np.random.Generator) -> dict:
    """train and test ``.rows`` files in ``d``; what each split must serve (val carved from train's tail)."""
    d.mkdir(parents=True)
    out = {}
    for split, n in (("train", 30), ("test", 6)):
        x = rng.standard_normal((n, 5)).astype("<f4")
        y = rng.integers(0, 3, n).astype(np.uint8)
        y[0] = 2
        body = b"".join(row.tobytes() + bytes([label]) for row, label in zip(x, y))
        (d / f"{split}.rows").write_bytes(struct.pack("<I", 5) + body)
        out[split] = (x, y.astype(np.int64))
    x, y = out["train"]
    out["train"], out["val"] = (x[:27], y[:27]), (x[27:], y[27:])
    return out

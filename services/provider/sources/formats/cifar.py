"""CIFAR-10 binary batches: ``data_batch_1.bin`` … ``data_batch_5.bin`` (train) and
``test_batch.bin``, each a run of 3073-byte records (a label byte, then 1024 red, 1024 green and
1024 blue pixel bytes). The batches of a split are read as one file laid end to end; a record's
label and pixels come in one read. Class names come from ``batches.meta.txt`` when present.
The directory may be the one the archive unpacks to, or hold it as ``cifar-10-batches-bin/``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from libbus.errors import DatasetError

from ..storage.reader import ByteSpace, Records
from .dataset import Context, Layout, Table
from .location import Format

__all__ = ["FORMAT", "data_dir", "detect", "open_cifar"]

SAMPLE = (3, 32, 32)
PIXELS = 3072
RECORD = 1 + PIXELS
TRAIN = re.compile(r"^data_batch_(\d+)\.bin$")
EXPECTED = "data_batch_1.bin … data_batch_5.bin and test_batch.bin (CIFAR-10 binary)"


def data_dir(root: Path) -> Path:
    """``root``, or the ``cifar-10-batches-bin`` folder inside it that the archive unpacks to."""
    inner = root / "cifar-10-batches-bin"
    return inner if not any(root.glob("data_batch_*.bin")) and inner.is_dir() else root


def detect(root: Path) -> bool:
    """Whether ``root`` holds CIFAR-10 train batches."""
    return any(TRAIN.match(p.name) for p in data_dir(root).glob("data_batch_*.bin"))


def _table(ctx: Context, paths: list[Path]) -> Table:
    segments = [ctx.segment(p) for p in paths]
    for seg in segments:
        if seg.length % RECORD:
            raise DatasetError(
                f"{seg.name}: {seg.length} bytes is not a whole number of {RECORD}-byte "
                f"records (1 label byte + {PIXELS} pixel bytes); truncated? "
                f"({seg.length // RECORD} whole records, {seg.length % RECORD} bytes over)"
            )
    count = sum(s.length for s in segments) // RECORD
    records = Records(ByteSpace(segments), 0, RECORD, count, [(0, 1), (1, PIXELS)])
    return Table(count, [(records, ["y", "x"])], label_name=", ".join(s.name for s in segments))


def open_cifar(ctx: Context) -> Layout:
    """The CIFAR-10 splits in ``ctx.root``; raises :class:`DatasetError` for a truncated batch."""
    root = data_dir(ctx.root)
    batches = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := TRAIN.match(p.name)))
    tables = {"train": _table(ctx, [p for _, p in batches])}
    if (root / "test_batch.bin").is_file():
        tables["test"] = _table(ctx, [root / "test_batch.bin"])
    names = ctx.settings.get("class_names")
    meta = root / "batches.meta.txt"
    if not names and meta.is_file():
        names = [line.strip() for line in meta.read_text().splitlines() if line.strip()]
    return Layout(
        "cifar10",
        tables,
        SAMPLE,
        np.dtype("u1"),
        (),
        np.dtype("u1"),
        ctx.settings.get("num_classes") or (len(names) if names else 10),
        names or [],
    )


#: This layout's line in the registry (:mod:`..layouts`).
FORMAT = Format("cifar10", lambda loc: detect(loc.root), open_cifar, EXPECTED, where=("file", "object"))

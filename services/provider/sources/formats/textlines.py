"""Text files: ``DIR/train.txt`` (``val.txt``, ``test.txt``), one document per line, UTF-8.

The raw text a tokenizer reads on the provider (a pipeline's ``tokenize`` and ``pack`` stages). Line
starts are found once, at open, with one vectorised scan of the memory-mapped file; a sample is a
line (empty lines are skipped), read with one positional read. Where ``val.txt`` is missing, val is
carved from train: the lines whose number hashes lowest, ``val_fraction`` of them. A split file that is
really (symlinks resolved, as opened) outside the dataset's directory is refused (:mod:`~services.provider.sources.storage.confine`).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from libbus.errors import DatasetError

from ..base import relative_name
from ..storage.confine import Confinement
from . import val_carve
from .imagefolder import Encoded
from .location import Format, Location

__all__ = ["EXPECTED", "FORMAT", "TextLines", "detect", "open_store"]

EXPECTED = "text: train.txt (val.txt, test.txt), one document per line"


def detect(root: Path) -> bool:
    return (root / "train.txt").is_file()


def _lines(fd: int) -> np.ndarray:
    """``(n, 3)``: start and end byte offsets and the line number (from 1, empty lines counted) of the
    non-empty lines of the open file ``fd``."""
    size = os.fstat(fd).st_size
    if size == 0:
        return np.empty((0, 3), np.int64)
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m:
        ends = np.flatnonzero(np.frombuffer(m, np.uint8) == 10).astype(np.int64)
    if not len(ends) or ends[-1] != size - 1:
        ends = np.append(ends, size)  # a last line without a newline
    starts = np.concatenate([[0], ends[:-1] + 1])
    keep = ends > starts
    return np.stack([starts[keep], ends[keep], np.flatnonzero(keep) + 1], 1)


class TextLines:
    """The lines of the split files, served as :class:`~.imagefolder.Encoded` samples with ``text`` set."""

    class_names: list[str] = []

    def __init__(self, uri: str, root: Path, val_fraction: float, confinement: Confinement | None = None):
        self.uri, self.root = uri, root
        self.paths: dict[str, Path | None] = {}
        self.rows: dict[str, np.ndarray] = {}
        self._fds: dict[str, int] = {}
        try:
            self._open(root, confinement or Confinement(root), val_fraction)
        except BaseException:
            self.close()
            raise

    def _open(self, root: Path, confinement: Confinement, val_fraction: float) -> None:
        uri = self.uri
        for split in ("train", "val", "test"):
            path = root / f"{split}.txt"
            if path.is_file():
                self.paths[split], self._fds[split] = path, confinement.open(path)
                self.rows[split] = _lines(self._fds[split])
            else:
                self.paths[split], self.rows[split] = None, np.empty((0, 3), np.int64)
        if not len(self.rows["train"]):
            raise DatasetError(f"{uri}: {root / 'train.txt'} has no text; expected {EXPECTED}")
        #: Where val came from, for DatasetInfo (``val_fraction``, ``val_carved``): None when a file holds it.
        self.val_fraction: float | None = None
        self.val_carved = "the lines whose number hashes lowest"
        if self.paths["val"] is None and val_fraction > 0:
            self.val_fraction = val_fraction
            rows = self.rows["train"]
            val = val_carve.lowest_hashed_lines(len(rows), val_fraction)
            self.rows["train"], self.rows["val"] = rows[~val], rows[val]
            self.paths["val"] = self.paths["train"]
            self._fds["val"] = self._fds["train"]

    def num_samples(self, split: str) -> int:
        return len(self.rows[split])

    def fetch(self, split: str, indices) -> list[Encoded]:
        out = []
        fd, path = self._fds[split], self.paths[split]
        for i in indices:
            start, end, _ = (int(v) for v in self.rows[split][int(i)])
            data = os.pread(fd, end - start, start)
            if len(data) != end - start:
                raise DatasetError(f"{self.uri}: {path} changed while served (line at byte {start} cut short)")
            out.append(Encoded(None, -1, f"{path}:{start}", data.decode("utf-8", "replace").rstrip("\r")))
        return out

    def locate(self, split: str, indices) -> list[str]:
        """``FILE line N @OFFSET+LENGTH`` per sample: the split's file (relative to the dataset's root),
        the line's number (from 1, empty lines counted, as an editor shows it) and its bytes (without
        the newline)."""
        path = self.paths[split]
        if path is None:
            return [""] * len(indices)
        name = relative_name(str(path), self.root)
        rows = self.rows[split][np.asarray(indices, np.int64)]
        return [f"{name} line {n} @{a}+{b - a}" for a, b, n in rows.tolist()]

    def close(self) -> None:
        for fd in set(self._fds.values()):
            os.close(fd)
        self._fds = {}


def open_store(loc: Location, val_fraction: float) -> TextLines:
    """The text files in the local directory ``loc``."""
    if not detect(loc.root):
        raise DatasetError(f"{loc.name}: no text files in {loc.root}; expected {EXPECTED}")
    return TextLines(loc.uri, loc.root, val_fraction, loc.confinement)


#: This layout's line in the registry (:mod:`..layouts`).
FORMAT = Format("text", lambda loc: detect(loc.root), open_store, EXPECTED, "samples", ("file",))

"""ImageFolder trees: ``DIR/train/CLASS/*.jpg|jpeg|png|webp`` (and ``val/``, ``test/``), as torchvision's
``ImageFolder`` reads them.

Class names are the folder names under ``train/``, sorted (class id = position); files are listed
recursively under each class folder and ordered by (class, path), so the same tree always gives the
same indices. The tree may be a local directory or an object-store prefix (an
:class:`~services.provider.sources.storage.objects.ObjectPath`, ``s3://BUCKET/PREFIX``): the same tree gives the same samples, and a
batch's images are then fetched together through the store's client. Where ``val/`` is missing, val
is carved from train per class: the files whose path hashes lowest, ``val_fraction`` of each class — deterministic, stratified, and stable when files are added.

Confined (:mod:`~services.provider.sources.storage.confine`): a split or class folder, or an image, that is a symlink to somewhere outside
the dataset's directory is refused at open, and each image is checked again as it is opened for a batch.
Symlinked folders deeper in a class folder are not followed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from libbus.errors import DatasetError

from ..base import relative_name
from ..storage.confine import Confinement
from . import val_carve
from .imageops import IMAGE_EXTS
from .location import Format, Location

__all__ = ["EXPECTED", "Encoded", "FORMAT", "ImageFolder", "detect", "open_store"]

EXPECTED = "ImageFolder: train/CLASS/*.jpg|jpeg|png|webp (val/, test/ optional)"


@dataclass
class Encoded:
    """One sample as stored: its encoded image bytes (or None), label, where it is (for errors), and
    any text that came with it (a WebDataset ``.txt`` member)."""

    data: bytes | None
    label: int
    where: str
    text: str | None = None


def _images(folder: Path, confinement: Confinement | None = None) -> list[Path]:
    """The images under ``folder`` (not through symlinked folders); a symlinked image is checked."""
    if not isinstance(folder, Path):  # an object-store folder: the keys below it, filtered as below
        return sorted(p for p in folder.files_below() if _visible_image(p.relative_to(folder).parts))
    found, todo = [], [folder]
    while todo:
        with os.scandir(todo.pop()) as entries:
            for e in entries:
                if e.name.startswith("."):
                    continue
                if e.is_dir(follow_symlinks=False):
                    todo.append(Path(e.path))
                elif e.name.lower().endswith(IMAGE_EXTS):
                    if e.is_symlink() and confinement is not None:
                        confinement.check(Path(e.path))
                    found.append(Path(e.path))
    return sorted(found)


def _visible_image(parts: tuple[str, ...]) -> bool:
    return not any(p.startswith(".") for p in parts) and parts[-1].lower().endswith(IMAGE_EXTS)


def _class_dirs(split_dir: Path) -> list[Path]:
    return sorted(p for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def detect(root: Path) -> bool:
    """Whether ``root/train`` holds class folders with at least one image."""
    train = root / "train"
    if not train.is_dir():
        return False
    return any(_first_image(d) for d in _class_dirs(train))


def _first_image(folder: Path) -> bool:
    if not isinstance(folder, Path):
        return bool(_images(folder))
    for _, _, filenames in os.walk(folder):
        if any(f.lower().endswith(IMAGE_EXTS) for f in filenames):
            return True
    return False


class ImageFolder:
    """The files of an ImageFolder tree, by split: ``(path, class id)`` in index order."""

    def __init__(self, uri: str, location: Location, val_fraction: float = 0.1):
        self.uri, self.location, self.root = uri, location, location.root
        root = self.root
        self.confinement = location.confinement or Confinement(root)
        train = root / "train"
        self.class_names = [d.name for d in _class_dirs(train)]
        classes = {name: i for i, name in enumerate(self.class_names)}
        self.files: dict[str, list[tuple[Path, int]]] = {}
        for split in ("train", "val", "test"):
            folder = root / split
            if not folder.is_dir():
                self.files[split] = []
                continue
            rows = []
            self.confinement.check(folder)
            for d in _class_dirs(folder):
                self.confinement.check(d)
                if d.name not in classes:
                    raise DatasetError(
                        f"{uri}: {d} is a class folder that train/ does not have; train's classes are "
                        f"{', '.join(self.class_names)}"
                    )
                rows += [(p, classes[d.name]) for p in _images(d, self.confinement)]
            self.files[split] = rows
        if not self.files["train"]:
            raise DatasetError(f"{uri}: no images under {train}; expected {EXPECTED}")
        #: Where val came from, for DatasetInfo (``val_fraction``, ``val_carved``): None when the files hold it.
        self.val_fraction: float | None = None
        self.val_carved = "per class, the files whose path hashes lowest"
        if not (root / "val").is_dir():
            self.files["train"], self.files["val"] = self._carve(self.files["train"], val_fraction)
            self.val_fraction = val_fraction

    def _carve(self, rows: list[tuple[Path, int]], fraction: float) -> tuple[list, list]:
        return val_carve.lowest_hashes_per_class(
            rows, fraction, label=lambda r: r[1], name=lambda r: str(r[0].relative_to(self.root))
        )

    def num_samples(self, split: str) -> int:
        return len(self.files[split])

    def fetch(self, split: str, indices) -> list[Encoded]:
        """The encoded bytes and labels at ``indices``. Raises :class:`DatasetError` for a file that
        went missing or cannot be read."""
        rows = [self.files[split][int(i)] for i in indices]
        # the batch's images together (an object store: requests in parallel, one deadline); a local
        # file is opened through the confinement, a file that cannot be read named by the location
        data = self.location.read_files([path for path, _ in rows])
        return [Encoded(d, label, str(path)) for d, (path, label) in zip(data, rows)]

    def locate(self, split: str, indices) -> list[str]:
        """Each sample's image file, relative to the tree's root (``train/cat/0001.jpg``)."""
        return [relative_name(str(self.files[split][int(i)][0]), self.root) for i in indices]

    def close(self) -> None:
        self.location.close()


def open_store(loc: Location, val_fraction: float) -> ImageFolder:
    """The ImageFolder tree at ``loc`` (a local directory or an object-store prefix)."""
    if not detect(loc.root):
        raise DatasetError(f"{loc.name}: no ImageFolder tree in {loc.root}; expected {EXPECTED}")
    return ImageFolder(loc.uri, loc, val_fraction)


#: This layout's line in the registry (:mod:`..layouts`).
FORMAT = Format("imagefolder", lambda loc: detect(loc.root), open_store, EXPECTED, "samples", ("file", "object"))

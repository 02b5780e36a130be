"""Image layouts as named fields: ``file://DIR?fields=image,label`` (part of :mod:`.images`).

An ImageFolder tree or WebDataset shards served as a dict per batch instead of ``(x, y)``: what a
``weighted://`` mix of image datasets, or a pipeline whose stages name the field they act on,
works with alongside Parquet ``?fields=`` and other named-field sources. The fields are those
listed, in that order, of:

- ``image``: with ``size=S``, ``uint8 (3, S, S)`` exactly as ``?size=S`` serves ``x`` (resized,
  centre-cropped, ``augment=1`` for the train recipe); without ``size``, ``uint8 (?, ?, 3)``: each
  image decoded at its own size, height × width × RGB (as a Parquet ``:image`` column), its
  largest sample declared by ``max_bytes=`` (then a same-host trainer gets it through shared memory);
- ``label``: ``int64 ()``, the class id (-1 for a WebDataset sample without ``.cls``);
- ``text`` (WebDataset only): ``str``, the sample's ``.txt`` member (a caption; empty without one).

A bad image follows ``bad=`` as everywhere: ``fail`` names the file, ``skip`` fills its row of every
field from the nearest good sample of the batch.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from libbus.errors import DatasetError

from .base import Field, FieldBatch, Source
from .formats import imageops

__all__ = ["NAMES", "DecodedImages", "field_of", "parse_names", "select"]

#: The fields an image layout offers (``text``: WebDataset's ``.txt`` members).
NAMES = ("image", "label", "text")


def parse_names(uri: str, text: str, fmt: str) -> tuple[str, ...]:
    """``"image,label"`` → the names, each once, each one :data:`NAMES` offers (``fmt``'s layout)."""
    offered = NAMES if fmt == "webdataset" else NAMES[:2]
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if not names or len(set(names)) != len(names) or not set(names) <= set(offered):
        raise DatasetError(
            f"{uri}: fields must list each of {', '.join(offered)} at most once ({fmt}), e.g. "
            f"fields=image,label; got {text!r}"
        )
    return names


def select(names: tuple[str, ...], image, label: np.ndarray, texts: list | None = None) -> FieldBatch:
    """The batch of the fields ``names`` lists."""
    every = {"image": image, "label": label, "text": texts}
    return {name: every[name] for name in names}


def field_of(name: str, image: Field) -> Field:
    """Field ``name`` of an image layout, ``image`` the image field."""
    return {"image": image, "label": Field("label", "int64", ()), "text": Field("text", "str", ())}[name]


class DecodedImages(Source):
    """Every image decoded at its own size: fields ``image uint8 (?, ?, 3)`` and/or ``label int64 ()``."""

    kind = "fields"

    def __init__(
        self, uri: str, store, fmt: str, names: tuple[str, ...], *, bad: str, workers: int, max_bytes: int, counters
    ):
        self.uri, self.store, self.format, self.names = uri, store, fmt, names
        self.bad, self.workers, self.max_bytes = bad, workers, max_bytes
        self.sample_shape, self.dtype = (0,), np.dtype(np.uint8)  # no x/y (see Source.fields)
        self.class_names = list(store.class_names)
        self.num_classes = len(self.class_names)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="decode")
        self.counters = counters

    @property
    def fields(self) -> list[Field]:
        image = Field("image", "uint8", (None, None, 3), self.max_bytes)
        return [field_of(name, image) for name in self.names]

    def num_samples(self, split: str) -> int:
        return self.store.num_samples(split)

    def info(self) -> dict:
        return {**super().info(), "format": self.format, "workers": self.workers}

    def read(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise DatasetError(f"{self.uri}: a multi-field dataset is read with read_fields, not as x/y")

    def read_fields(self, split: str, indices: np.ndarray, epoch: int = 0) -> FieldBatch:
        started = time.perf_counter()
        samples = self.store.fetch(split, indices)
        errors: dict[int, str] = {}

        def one(row: int):
            sample = samples[row]
            try:
                if sample.data is None:
                    raise imageops.BadImage(f"{sample.where}: no image member (.jpg, .jpeg, .png, .webp)")
                return np.asarray(imageops.decode(sample.data, sample.where), np.uint8)
            except imageops.BadImage as err:
                errors[row] = str(err)
                return None

        images = list(self.pool.map(one, range(len(samples))))
        labels = np.asarray([s.label for s in samples], np.int64)
        texts = [s.text or "" for s in samples]
        failed = bool(errors) and self.bad == "fail"
        self.counters.add(len(samples), len(errors), time.perf_counter() - started, failed)
        if errors:
            first = errors[min(errors)]
            if failed:
                raise DatasetError(f"{self.uri}: bad image: {first} (bad=skip serves the batch without it)")
            good = np.array([r for r in range(len(images)) if r not in errors])
            if not len(good):
                raise DatasetError(f"{self.uri}: every sample of the batch ({len(images)}) is a bad image")
            for row in sorted(errors):
                near = int(good[np.argmin(np.abs(good - row))])
                images[row], labels[row], texts[row] = images[near], labels[near], texts[near]
        return select(self.names, images, labels, texts)

    def metrics(self) -> dict:
        """The provider's per-dataset counters, as an image source's (one ``decode`` stage)."""
        return {"requests": {}, "stages": [self.counters.stage()]}

    decode_metrics = metrics

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()

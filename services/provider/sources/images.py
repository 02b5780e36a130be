"""Image datasets as users have them: ImageFolder trees and WebDataset shards, decoded on the provider.

``file://DIR?size=S`` on either layout serves every image decoded, shorter side resized to ``S`` and
centre-cropped to ``S × S``: ``(3, S, S)`` uint8 samples (grey and palette images expanded, alpha
dropped) with int64 class ids. ``&augment=1`` serves train through torchvision's ImageNet train
recipe instead (random-resized-crop to ``S``, then a left-right flip with probability 0.5), its
numbers drawn per ``(seed, epoch, split, index)``; val and test keep the resize and centre crop.

The work runs on a pool of ``workers`` threads (default: the cores this process may use): Pillow
releases the GIL while it decodes and resamples, so a batch keeps that many cores busy
(docs/performance.md measures it). Each sample's whole chain runs in one task, written straight into
its row of the destination (a reply buffer or a trainer's ring slot).

A bad image (truncated, corrupt, not an image) follows ``bad=fail`` (the default: the batch fails
with an error naming the file or shard and key) or ``bad=skip`` (its row is filled with the nearest
good sample of the same batch and the provider's ``bad_images`` counter goes up); never garbage.

Without ``size``, ``&encoded=1`` opens the same files as encoded bytes, for a pipeline whose
``decode`` stage does the rest (``pipeline://``, docs/datasets.md §7).

Named fields instead of x/y: ``?fields=image,label`` (``text`` too for WebDataset) serves a dict per
batch, for a ``weighted://`` mix of image datasets or a pipeline whose stages name the field they act
on: ``image`` ``uint8 (3, S, S)`` exactly as ``?size=S`` serves ``x``, or without ``size`` each image
decoded at its own size, ``uint8 (?, ?, 3)``, its largest sample declared by ``max_bytes=`` (then a
same-host trainer gets it through shared memory); ``label`` ``int64 ()`` (-1 for a WebDataset sample
without ``.cls``); ``text`` ``str``, the sample's ``.txt`` member. ``bad=`` applies to every field.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Protocol
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np

from libbus.errors import DatasetError

from .base import SPLITS, Field, FieldBatch, OpenRequest, Source, SourceInfo, stable_seed
from .formats import imageops
from .formats.imageops import BAD_POLICIES, default_workers
from .pipeline_metrics import PipelineMetrics, StageMetrics
from .splitmix import uniforms

__all__ = [
    "BAD_POLICIES",
    "DecodedImages",
    "EncodedImages",
    "ImageSource",
    "batch_uniforms",
    "default_workers",
    "open_images",
]

log = logging.getLogger(__name__)

#: How a provider runs its decoding: threads of its own process, or worker processes.
POOLS = ("thread", "process")
#: torchvision's RandomResizedCrop defaults.
RRC_SCALE, RRC_RATIO = (0.08, 1.0), (3.0 / 4.0, 4.0 / 3.0)


def store_locate(store, split: str, indices: np.ndarray) -> list[str]:
    """Where ``store`` (an ImageFolder tree, WebDataset shards, text lines) keeps each sample: its
    ``locate``, or ``""`` each for a store that does not say."""
    locate = getattr(store, "locate", None)
    return locate(split, indices) if locate is not None else [""] * len(indices)


def carve_info(store: Carving) -> dict:
    """DatasetInfo's ``val_fraction`` and ``val_carved`` when ``store`` carved val out of train (its files
    hold no val split), so the provider's start-up line and ``busctl datasets`` say so; else nothing."""
    if store.val_fraction is None:
        return {}
    return {"val_fraction": store.val_fraction, "val_carved": store.val_carved}


class Carving(Protocol):
    """What an encoded-sample store (ImageFolder, WebDataset shards, text lines) says of its val split."""

    val_fraction: float | None
    val_carved: str


def batch_uniforms(seed: int, epoch: int, split: str, indices: np.ndarray, draws: int) -> np.ndarray:
    """``(len(indices), draws)`` uniforms in [0, 1), each a function of (seed, epoch, split, index, draw)
    alone: SplitMix64 at a counter, the whole batch at once (a generator per sample costs ~65 µs)."""
    key = np.uint64(stable_seed("images", seed, epoch, SPLITS.index(split)))
    counters = indices.astype(np.uint64)[:, None] * np.uint64(draws) + np.arange(draws, dtype=np.uint64)
    return uniforms(key, counters)


def fill_bad_rows(x: np.ndarray, y: np.ndarray, bad: list[int], where: str, texts: list | None = None) -> None:
    """``bad=skip``: copy into each bad row the nearest good row of the batch (ties: the earlier one),
    its text too (``fields=…,text``). Raises :class:`DatasetError` when the whole batch is bad."""
    good = np.setdiff1d(np.arange(len(x)), bad)
    if not len(good):
        raise DatasetError(f"{where}: every sample of the batch ({len(x)}) is a bad image; nothing to serve")
    for row in bad:
        near = good[np.argmin(np.abs(good - row))]
        x[row] = x[near]
        y[row] = y[near]
        if texts is not None:
            texts[row] = texts[near]


class ImageCounters:
    """What the provider's metrics show for an image dataset: samples decoded, bad images, time."""

    def __init__(self, name: str):
        self.name = name
        self.items = self.bad = self.failed = 0
        self.busy_s = 0.0
        self.lock = threading.Lock()

    def add(self, items: int, bad: int, busy_s: float, failed: bool) -> None:
        with self.lock:
            self.items += items
            self.bad += bad
            self.busy_s += busy_s
            self.failed += failed

    def stage(self) -> StageMetrics:
        """A pipeline stage's counters: ``errors`` counts failed batches, ``bad_images`` bad images."""
        return {
            "name": self.name,
            "type": "decode",
            "items_in": self.items,
            "items_out": self.items - self.bad,
            "errors": self.failed,
            "bad_images": self.bad,
            "busy_s": round(self.busy_s, 6),
        }


class ImageSource(Source):
    """Encoded images from ``store`` (an ImageFolder or WebDataset layout), served as ``(3, S, S)`` uint8."""

    def __init__(
        self,
        uri: str,
        store,
        size: int,
        *,
        augment: bool,
        bad: str,
        workers: int,
        seed: int,
        fmt: str,
        worker_source: tuple | None = None,
        names: tuple[str, ...] = (),
    ):
        self.uri, self.store, self.size = uri, store, size
        #: ``fields=``: served as these named fields (below) instead of x/y.
        self.names = names
        if names:
            self.kind = "fields"
        self.augment, self.bad, self.seed, self.format = augment, bad, seed, fmt
        self.sample_shape = (3, size, size)
        self.dtype = np.dtype(np.uint8)
        self.class_names = list(store.class_names)
        self.num_classes = len(self.class_names)
        self.workers = workers
        self.pool = ThreadPoolExecutor(1 if worker_source else workers, thread_name_prefix="decode")
        #: ``pool=process``: ``workers`` processes, each with its own one-thread copy of this source.
        self.processes: ProcessPoolExecutor | None = None
        if worker_source is not None:
            opener, worker_uri = worker_source
            context = multiprocessing.get_context("spawn")  # the provider has threads: no fork
            self.processes = ProcessPoolExecutor(
                workers, mp_context=context, initializer=_init_worker, initargs=(opener, worker_uri)
            )
        self.counters = ImageCounters("images")

    def num_samples(self, split: str) -> int:
        return self.store.num_samples(split)

    def locate(self, split: str, indices: np.ndarray) -> list[str]:
        return store_locate(self.store, split, indices)

    def info(self) -> SourceInfo:
        return {
            **super().info(),
            **carve_info(self.store),
            "format": self.format,
            "augment": self.augment,
            "workers": self.workers,
        }

    def read_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        self.serve_into(split, indices, x, y, epoch=0)

    @property
    def fields(self) -> list[Field]:
        if not self.names:
            return super().fields
        return [field_of(name, Field("image", "uint8", self.sample_shape)) for name in self.names]

    def read_fields(self, split: str, indices: np.ndarray, epoch: int = 0) -> FieldBatch:
        x = np.empty((len(indices), *self.sample_shape), self.dtype)
        y = np.empty(len(indices), np.int64)
        samples = texts = None
        if "text" in self.names:  # fetched once here (worker processes fetch their own to decode)
            samples = self.store.fetch(split, indices)
            texts = [s.text or "" for s in samples]
        self._serve(split, indices, epoch, x, y, None if self.processes else samples, texts)
        return select(self.names, x, y, texts) if self.names else {"x": x, "y": y}

    def _one(self, sample, split: str, u: np.ndarray | None, out: np.ndarray) -> None:
        if sample.data is None:
            raise imageops.BadImage(f"{sample.where}: no image member (.jpg, .jpeg, .png, .webp)")
        img = imageops.decode(sample.data, sample.where)
        s = self.size
        if u is not None:
            img = imageops.random_resized_crop(img, u, s, s, RRC_SCALE, RRC_RATIO)
            if u[40] < 0.5:
                img = imageops.flip(img)
        else:
            img = imageops.center_crop(imageops.resize_shorter(img, s), s, s)
        out[...] = np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)

    def decode_into(
        self, split: str, indices: np.ndarray, epoch: int, x: np.ndarray, y: np.ndarray, samples: list | None = None
    ) -> dict[int, str]:
        """Decode ``indices`` (``samples``, when already fetched) into ``x``/``y`` on this process's
        threads; the bad rows, with why."""
        samples = self.store.fetch(split, indices) if samples is None else samples
        errors: dict[int, str] = {}
        u = batch_uniforms(self.seed, epoch, split, indices, 41) if self.augment and split == "train" else None

        def work(row: int) -> None:
            try:
                self._one(samples[row], split, None if u is None else u[row], x[row])
            except imageops.BadImage as err:
                errors[row] = str(err)

        list(self.pool.map(work, range(len(samples))))
        y[...] = np.asarray([s.label for s in samples], np.int64).reshape(y.shape)
        return errors

    def _decode_processes(
        self, processes: ProcessPoolExecutor, split: str, indices: np.ndarray, epoch: int, x, y
    ) -> dict[int, str]:
        """Cut the batch into ``workers`` runs, one per worker process; gather their rows."""
        parts = [p for p in np.array_split(np.arange(len(indices)), self.workers) if len(p)]
        futures = [processes.submit(_decode_part, split, indices[p], epoch) for p in parts]
        errors: dict[int, str] = {}
        for rows, fut in zip(parts, futures):
            px, py, perr = fut.result()
            x[rows] = px
            y[rows] = py.reshape(y[rows].shape)
            errors.update({int(rows[r]): why for r, why in perr.items()})
        return errors

    def serve_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray, *, epoch: int = 0) -> None:
        self._serve(split, indices, epoch, x, y)

    def _serve(self, split: str, indices, epoch: int, x, y, samples: list | None = None, texts: list | None = None):
        started = time.perf_counter()
        if self.processes is not None:
            errors = self._decode_processes(self.processes, split, indices, epoch, x, y)
        else:
            errors = self.decode_into(split, indices, epoch, x, y, samples)
        failed = bool(errors) and self.bad == "fail"
        self.counters.add(len(indices), len(errors), time.perf_counter() - started, failed)
        if errors:
            first = errors[min(errors)]
            if self.bad == "fail":
                raise DatasetError(f"{self.uri}: bad image: {first} (bad=skip serves the batch without it)")
            log.warning("%s: %d bad image(s) replaced in a batch, the first: %s", self.uri, len(errors), first)
            fill_bad_rows(x, y, sorted(errors), self.uri, texts)

    def metrics(self) -> PipelineMetrics:
        """The provider's per-dataset counters, in the shape of a pipeline's (one ``decode`` stage)."""
        return {"requests": {}, "stages": [self.counters.stage()]}

    decode_metrics = metrics

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.processes is not None:
            self.processes.shutdown(wait=True, cancel_futures=True)
        self.store.close()


#: In a ``pool=process`` worker: its own copy of the source (one decoding thread).
_WORKER: dict = {}


def _init_worker(opener, uri: str) -> None:
    _WORKER["source"] = opener(uri)


def _decode_part(split: str, indices: np.ndarray, epoch: int) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
    source = _WORKER["source"]
    x = np.empty((len(indices), *source.sample_shape), source.dtype)
    y = np.empty(len(indices), np.int64)
    return x, y, source.decode_into(split, indices, epoch, x, y)


def _worker_uri(uri: str) -> str:
    """The URI a ``pool=process`` worker opens: the same dataset, decoded on one thread."""
    parts = urlsplit(uri)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in ("pool", "workers")]
    return urlunsplit(parts._replace(query=urlencode([*query, ("pool", "thread"), ("workers", "1")])))


class EncodedImages(Source):
    """The same files as stored: samples are :class:`~.formats.imagefolder.Encoded` objects (image bytes,
    text), for a pipeline's ``decode`` or ``tokenize`` stage. Not servable as they are (no fixed shape)."""

    kind = "encoded"

    def __init__(self, uri: str, store, fmt: str):
        self.uri, self.store, self.format = uri, store, fmt
        self.sample_shape = ()
        self.dtype = np.dtype(object)
        self.class_names = list(store.class_names)
        self.num_classes = len(self.class_names)

    def num_samples(self, split: str) -> int:
        return self.store.num_samples(split)

    def locate(self, split: str, indices: np.ndarray) -> list[str]:
        return store_locate(self.store, split, indices)

    def read(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        samples = self.store.fetch(split, indices)
        x = np.empty(len(samples), object)
        x[:] = samples
        return x, np.asarray([s.label for s in samples], np.int64)

    def read_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        raise DatasetError(
            f"{self.uri}: encoded images have no fixed shape; serve them with ?size=S or through a "
            "pipeline's decode stage"
        )

    def info(self) -> SourceInfo:
        return {**super().info(), **carve_info(self.store), "format": self.format}

    def close(self) -> None:
        self.store.close()


# -- named fields: ?fields=image,label,text ------------------------------------------------------

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

    def locate(self, split: str, indices: np.ndarray) -> list[str]:
        return store_locate(self.store, split, indices)

    def info(self) -> SourceInfo:
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

    def metrics(self) -> PipelineMetrics:
        """The provider's per-dataset counters, as an image source's (one ``decode`` stage)."""
        return {"requests": {}, "stages": [self.counters.stage()]}

    decode_metrics = metrics

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()


def _flag(req: OpenRequest, key: str) -> bool:
    value = req.params.pop(key, "0").lower()
    if value not in ("0", "1", "true", "false", "yes", "no"):
        raise DatasetError(f"{req.uri}: {key} must be 0 or 1, got {value!r}")
    return value in ("1", "true", "yes")


def open_images(req: OpenRequest, store, fmt: str) -> Source:
    """The source for an image layout ``store``, from the URI's ``size``, ``augment``, ``bad``,
    ``workers``, ``seed`` and ``encoded`` parameters. Raises :class:`DatasetError` for bad ones."""
    try:
        encoded = _flag(req, "encoded")
        if fmt != "text":
            imageops.require_pillow(req.uri)
        size = req.int_param("size", None)
        augment = _flag(req, "augment")
        bad = req.params.pop("bad", "fail")
        if bad not in BAD_POLICIES:
            raise DatasetError(f"{req.uri}: bad must be one of {', '.join(BAD_POLICIES)}, got {bad!r}")
        pool = req.params.pop("pool", "thread")
        if pool not in POOLS:
            raise DatasetError(f"{req.uri}: pool must be one of {', '.join(POOLS)}, got {pool!r}")
        workers = req.int_param("workers", None)
        workers = default_workers() if workers is None else workers
        seed = req.int_param("seed", 0)
        if fmt == "text" and not encoded:
            raise DatasetError(
                f'{req.uri}: text is tokenized in a pipeline: source = {{ uri = "file://DIR?encoded=1" }}, '
                "then tokenize and pack stages (docs/datasets.md §7.1)"
            )
        names = parse_names(req.uri, req.params.pop("fields"), fmt) if "fields" in req.params else ()
        max_bytes = req.int_param("max_bytes", 0)
        if encoded:
            if size is not None or names:
                raise DatasetError(f"{req.uri}: give size=S or fields= (decoded) or encoded=1 (bytes), not both")
            return EncodedImages(req.uri, store, fmt)
        if fmt == "text" and names:
            raise DatasetError(f"{req.uri}: fields= serves images; text is tokenized in a pipeline (encoded=1)")
        if max_bytes is None or max_bytes < 0 or (max_bytes and (size is not None or not names)):
            raise DatasetError(
                f"{req.uri}: max_bytes declares the largest decoded image of fields= without size=, got {max_bytes}"
            )
        if not 1 <= workers <= 256:
            raise DatasetError(f"{req.uri}: workers must be between 1 and 256, got {workers}")
        if names and size is None:
            if pool != "thread" or augment:
                raise DatasetError(f"{req.uri}: fields= without size= decodes on threads, without augment")
            counters = ImageCounters("images")
            return DecodedImages(
                req.uri, store, fmt, names, bad=bad, workers=workers, max_bytes=max_bytes, counters=counters
            )
        if size is None:
            raise DatasetError(
                f"{req.uri}: {fmt} images come in every size: add ?size=S to serve them as (3, S, S) uint8 "
                "(resized and centre-cropped), or use a pipeline with encoded=1"
            )
        if not 1 <= size <= 4096:
            raise DatasetError(f"{req.uri}: size must be between 1 and 4096 pixels, got {size}")
        if seed is None or seed < 0:
            raise DatasetError(f"{req.uri}: seed must be a non-negative integer")
        worker_source = (req.open, _worker_uri(req.uri)) if pool == "process" else None
        return ImageSource(
            req.uri,
            store,
            size,
            augment=augment,
            bad=bad,
            workers=workers,
            seed=seed,
            fmt=fmt,
            worker_source=worker_source,
            names=names,
        )
    except BaseException:
        store.close()
        raise

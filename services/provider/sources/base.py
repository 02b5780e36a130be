"""The contract every dataset source keeps, and what an opener is given.

Every source answers the same two questions: what it is (:meth:`Source.info`, the DatasetInfo
fields) and what samples ``indices`` of ``split`` hold (:meth:`Source.read`). Sources are
deterministic: the same request always returns the same bytes.

This is the ground floor of :mod:`services.provider.sources`: ``base`` → ``formats/`` (file layouts) →
one module per kind (``mock``, ``files``, ``http``, ``parquet``, ``weighted``, ``pipeline/``) →
``registry`` (the only module that lists schemes). A kind imports only this module and ``formats``;
a kind that opens other sources (a weighted mix's members, a pipeline's source stage) does so through
:attr:`OpenRequest.open`, never by importing the registry.
"""

from __future__ import annotations

import enum
import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import overload
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

import numpy as np

from libbus.errors import DatasetError
from libbus.wire.dataset_info import SourceInfo, SplitInfo
from libbus.wire.fields import Field, FieldBatch, is_xy

__all__ = [
    "MAX_LOCATION_CHARS",
    "PRIVATE_SPLIT",
    "SPLITS",
    "Field",
    "FieldBatch",
    "OpenRequest",
    "ReadPolicy",
    "Source",
    "SourceInfo",
    "joined_locations",
    "local_path",
    "relative_name",
    "stable_seed",
]

SPLITS = ("train", "val", "test")
#: The split that never leaves the provider: only its local evaluator reads it.
PRIVATE_SPLIT = "test"
#: Characters a location made of several (a packed sample's lines) may take: the first place is always
#: whole, then as many as fit, then how many more there were. A step's locations stay one small reply.
MAX_LOCATION_CHARS = 240


class ReadPolicy(enum.Enum):
    """Where the provider may read a source's batches (:mod:`services.provider.fillers` picks the thread)."""

    #: On the serving loop's thread, one batch at a time: reads share state (the default).
    LOOP = "loop"
    #: Reads may run on two threads at once (they share no state): a ring slot is filled on the
    #: provider's fill thread, where it has one (four cores or more), while the loop serves on.
    CONCURRENT = "concurrent"
    #: Reads mostly wait on threads of the source's own (a pipeline's stages): several batches at
    #: once, off the loop, whatever the cores and the destination.
    OVERLAP = "overlap"


class Source(ABC):
    """A dataset: metadata plus indexed reads of each split."""

    uri: str
    sample_shape: tuple[int, ...]
    dtype: np.dtype
    label_dtype: np.dtype = np.dtype(np.int64)
    #: Shape of one sample's label: ``()`` for a class id; ``(0,)`` for sources without labels.
    label_shape: tuple[int, ...] = ()
    num_classes: int = 0
    class_names: list[str] = []
    kind: str = "image"
    #: Where the provider may read this source's batches.
    read_policy: ReadPolicy = ReadPolicy.LOOP
    #: Whether its reads wait on the network (``http(s)://``, an object store): read off the serving
    #: loop, on the dataset's own threads, several batches at once (:mod:`services.provider.fillers`).
    remote: bool = False
    #: Whether its reads are memory-speed gathers (local files, from RAM or the page cache): cheaper on the
    #: serving loop's thread than handed to another on a machine of few cores (:mod:`services.provider.fillers`).
    gather: bool = False

    @abstractmethod
    def num_samples(self, split: str) -> int:
        """How many samples ``split`` has."""

    # A source implements at least one of read / read_into; each has a default built on the other.
    # Generated sources implement ``read``; file-backed ones ``read_into``, so that a batch can be
    # read from disk straight into its destination (a shared-memory ring slot) with no temporary.
    def read(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Samples and labels at ``indices`` (already checked to be in range), C-contiguous."""
        x = np.empty((len(indices), *self.sample_shape), self.dtype)
        y = np.empty((len(indices), *self.label_shape), self.label_dtype)
        self.read_into(split, indices, x, y)
        return x, y

    def read_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        """Write the samples and labels at ``indices`` into ``x`` and ``y``.

        ``x`` has shape ``(len(indices), *sample_shape)`` and ``dtype``; ``y`` has shape
        ``(len(indices), *label_shape)`` and ``label_dtype``; both C-contiguous, possibly views of
        shared memory.
        """
        xs, ys = self.read(split, indices)
        x[...] = xs
        y[...] = ys

    def serve_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray, *, epoch: int = 0) -> None:
        """What the provider calls for a BatchRequest of ``epoch``: :meth:`read_into`, for sources
        whose bytes do not depend on the epoch (a pipeline's random stages do)."""
        self.read_into(split, indices, x, y)

    @property
    def fields(self) -> list[Field]:
        """The sample's named fields. A source of one array and one label (every source built on
        ``sample_shape``/``dtype``/``label_shape``) has two: ``x`` and ``y``. A multi-field source
        overrides this and :meth:`read_fields`."""
        return [
            Field("x", self.dtype.name, tuple(self.sample_shape)),
            Field("y", self.label_dtype.name, tuple(self.label_shape)),
        ]

    @property
    def xy(self) -> bool:
        """Served as two fixed arrays ``x``, ``y`` (through :meth:`serve_into`, straight into a slot)."""
        return is_xy(self.fields)

    def read_fields(self, split: str, indices: np.ndarray, epoch: int = 0) -> FieldBatch:
        """Every field of the samples at ``indices`` of ``epoch``: name → a batch array (fixed
        fields), a list of per-sample arrays (variable ones), or a list of bytes / str. The default
        serves ``x`` and ``y`` through :meth:`serve_into`."""
        x = np.empty((len(indices), *self.sample_shape), self.dtype)
        y = np.empty((len(indices), *self.label_shape), self.label_dtype)
        self.serve_into(split, indices, x, y, epoch=epoch)
        return {"x": x, "y": y}

    def read_ahead(self, split: str, indices: np.ndarray, owner: object) -> int:
        """Fetch ahead what samples ``indices`` of ``split`` will need (a loader's
        :class:`~libbus.wire.messages.ReadAhead`), replacing ``owner``'s last plan; empty ``indices``
        cancel it. Returns how many blocks were planned; a source with nothing to fetch ahead: 0."""
        return 0

    def locate(self, split: str, indices: np.ndarray) -> list[str]:
        """Where each sample of ``indices`` (already checked to be in range) lives, one short string
        each: a path relative to the dataset's root with a byte offset and length, a shard member, a
        row (``train.npy@128+784``, ``shard-000001.tar:000345.jpg@5632+1201``, ``data/a.parquet row 812``).
        Never an absolute path of the provider's host. This default: ``""`` each (the source does not know)."""
        return [""] * len(indices)

    def close(self) -> None:
        """Release what the source holds (threads, files); the provider calls it when it stops."""

    @property
    def x_nbytes(self) -> int:
        """Bytes of one sample."""
        return math.prod(self.sample_shape) * self.dtype.itemsize

    @property
    def y_nbytes(self) -> int:
        """Bytes of one sample's label."""
        return math.prod(self.label_shape) * self.label_dtype.itemsize

    @property
    def sample_nbytes(self) -> int:
        """Bytes of one sample (the declared maxima of variable fields)."""
        if self.xy:
            return self.x_nbytes + self.y_nbytes
        return sum(f.sample_nbytes for f in self.fields)

    def info(self) -> SourceInfo:
        """The DatasetInfo ``info``: ``fields`` is the truth; an x/y dataset also keeps the keys
        older readers know (``sample_shape``, ``dtype``, ``label_shape``, ``label_dtype``)."""
        splits: dict[str, SplitInfo] = {}
        for split in SPLITS:
            private = split == PRIVATE_SPLIT
            splits[split] = {"num_samples": self.num_samples(split), "available": not private, "shuffle": not private}
        fields = self.fields
        out: SourceInfo = {"uri": self.uri, "splits": splits}
        if self.remote:  # a loader leaving inflight to itself grows its window (libbus.loader.window_size)
            out["remote"] = True
        if is_xy(fields):
            out.update(
                {
                    "sample_shape": list(self.sample_shape),
                    "label_shape": list(self.label_shape),
                    "dtype": self.dtype.name,
                    "label_dtype": self.label_dtype.name,
                }
            )
        out.update({"num_classes": self.num_classes, "class_names": list(self.class_names), "kind": self.kind})
        out["fields"] = [f.to_info() for f in fields]
        return out


def stable_seed(*parts) -> int:
    """A 64-bit seed that depends only on ``parts`` (not on the process's hash salt)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def local_path(parts: SplitResult) -> Path:
    """The directory a ``scheme://DIR`` URI names: ``scheme:///abs/dir`` is absolute,
    ``scheme://rel/dir`` (a "host" that is not localhost) relative to the working directory."""
    return Path(unquote(parts.path if parts.netloc in ("", "localhost") else parts.netloc + parts.path) or ".")


@dataclass
class OpenRequest:
    """What every opener takes: the URI, its parts and query, and how to open a nested URI.

    An opener pops from :attr:`params` the parameters it understands; the registry reports whatever
    is left as unknown.
    """

    uri: str
    parts: SplitResult
    #: The query's parameters, last value wins.
    params: dict[str, str]
    #: Opens another URI (a weighted mix's member, a pipeline's source stage) with the same registry.
    open: Callable[[str], Source]
    #: The datasets the same provider serves so far, by name (a ``weighted://`` mix may name them).
    named: Mapping[str, Source] = field(default_factory=dict)
    #: Modules a pipeline's ``user`` stages may run, from the provider's own settings (never a URI).
    user_modules: frozenset[str] = frozenset()

    @overload
    def int_param(self, key: str, default: int) -> int: ...
    @overload
    def int_param(self, key: str, default: None) -> int | None: ...
    def int_param(self, key: str, default: int | None) -> int | None:
        """Pop integer parameter ``key`` (``default`` when absent). Raises :class:`DatasetError`."""
        if key not in self.params:
            return default
        try:
            return int(self.params.pop(key))
        except ValueError as err:
            raise DatasetError(f"{self.uri}: '{key}' must be an integer") from err


def relative_name(name: str, root: object) -> str:
    """``name`` (a file's path or URL, as a :class:`~.storage.reader.Segment` or a store names it) as
    a path under the dataset's ``root``: what :meth:`Source.locate` may say without telling where the
    provider keeps the dataset. A name outside ``root`` is cut to its last part. A segment's name may
    carry a note (``"PATH (decompressed to COPY)"``): the note, which names a cache path, is dropped.
    Under a remote root (an object-store prefix, an HTTP listing) the name is the object's whole
    address (``s3://bucket/prefix/shard-0001.bin``, without userinfo, query or fragment): what a
    reader fetches by range to check it."""
    name = str(name).split(" (", 1)[0]
    base = str(root).rstrip("/") + "/"
    if not isinstance(root, PurePath) and "://" in name:
        # an object or URL (s3://bucket/key, https://host/shard.tar): named whole, as a store names it,
        # but never its userinfo, query or fragment (a credential or a signature could ride there)
        parts = urlsplit(name)
        host = parts.netloc.rsplit("@", 1)[-1]
        return urlunsplit((parts.scheme, host, parts.path, "", ""))
    if name.startswith(base):
        return name[len(base) :]
    return name.rstrip("/").rsplit("/", 1)[-1]


def joined_locations(parts: list[str], total: int | None = None, limit: int = MAX_LOCATION_CHARS) -> str:
    """Places joined with ``"; "`` (a packed sample's lines): the first always whole, then as many
    whole ones as keep the result within ``limit`` characters, then ``"; … and K more"`` for those
    left out (of ``total`` places, when ``parts`` lists only the first of them)."""
    total = len(parts) if total is None else total
    if not parts:
        return ""
    out, used = [parts[0]], len(parts[0])
    for i, part in enumerate(parts[1:], 1):
        rest = total - i - 1
        tail = len(f"; … and {rest} more") if rest else 0
        if used + 2 + len(part) + tail > limit:
            break
        out.append(part)
        used += 2 + len(part)
    left = total - len(out)
    return "; ".join(out) + (f"; … and {left} more" if left else "")

"""Where a dataset's bytes live (a :class:`Location`), apart from how they are laid out (a :class:`Format`).

The model is MosaicML Streaming's: one small interface per place bytes can live, one module per layout,
and any layout read from any place. A :class:`Location` is a root seen as a folder — a local directory
(:mod:`..files`), the files an HTTP URI names (:mod:`..http`), an object-store prefix (:mod:`..objstore`)
— offering what a layout needs of it and nothing more:

- names and sizes: :attr:`Location.root` has the part of ``pathlib.Path`` layouts use (``/``,
  ``iterdir``, ``glob``, ``is_file``, ``is_dir``, ``name``, ``suffix``, ``read_bytes`` for small files);
- positional reads: :meth:`Location.context` gives the :class:`~.dataset.Context` whose
  :meth:`~.dataset.Context.segment` opens a file for ranged, coalescing reads (``preadv`` locally, one
  request per contiguous run remotely, fetched concurrently), straight into a batch's destination;
  a layout that indexes its files reads bytes with :meth:`Location.pread` and
  :meth:`Location.read_ranges` and keys its on-disk index by :meth:`Location.stamp` at
  :meth:`Location.index_path`;
- what each batch's reads share (:meth:`Location.batch`: an object store's deadline), what DatasetInfo
  says of the place (:meth:`Location.info`), and the client to release (:meth:`Location.close`).

A :class:`Format` is one layout's line in the registry (:mod:`..layouts`, the only module that lists
layouts): how it is detected under a root, how it opens, and at which locations it reads. A layout
that reads its files through ``ctx.segment`` (every array layout here) works at every location.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libbus.errors import DatasetError

from ..base import OpenRequest, SourceInfo
from ..storage.blockmemory import ReadStats
from .dataset import Context
from .dataset_toml import TOML, DatasetSettings, parse_dataset_toml

__all__ = ["KINDS", "SERVES", "Format", "Location", "val_fraction"]

#: The kinds of location: local files, files behind HTTP, objects in a store.
KINDS = ("file", "http", "object")
#: What a format's ``open`` returns (see :class:`Format`).
SERVES = ("tables", "samples", "source")


def val_fraction(where: str, value: str = "0.1") -> float:
    """The ``val_fraction`` parameter ``value`` as a number in [0, 1): the share of train carved off as
    val where the files hold no val split. Raises :class:`DatasetError` naming ``where`` otherwise."""
    try:
        fraction = float(value)
    except ValueError:
        raise DatasetError(f"{where}: val_fraction must be a number") from None
    if not 0 <= fraction < 1:
        raise DatasetError(f"{where}: val_fraction must be in [0, 1), got {fraction}")
    return fraction


class Location:
    """A root seen as a folder, and how its files are read (see the module doc).

    Subclasses set :attr:`kind`, :attr:`label` and :attr:`memory`, and implement :meth:`context`;
    the rest has defaults that suit local files.
    """

    #: Which of :data:`KINDS`: the formats that read here say so (:attr:`Format.where`).
    kind: str = "file"
    #: How messages say where a format is read ("format 'idx' is not read over HTTP").
    label: str = "from local files"
    #: The ``memory`` mode array layouts default to here (``auto``: RAM when small; remote: ``stream``).
    memory: str = "auto"
    #: Where the files of an encoded layout may really be (local files only; ``None``: anywhere).
    confinement: Any = None

    def __init__(self, req: OpenRequest, root: Any):
        self.req, self.uri, self.root, self.params = req, req.uri, root, req.params
        self._toml: dict | None = None

    @property
    def name(self) -> str:
        """How messages name the dataset: its URI (an object store's without its query)."""
        return self.uri

    def toml(self) -> dict:
        """The root's ``dataset.toml``, parsed and checked (``{}`` when there is none); read once."""
        if self._toml is None:
            path = self.root / TOML
            self._toml = parse_dataset_toml(path.read_bytes(), str(path)) if path.is_file() else {}
        return self._toml

    def names(self) -> list[str]:
        """The names in the root (not hidden), sorted: what messages say was found."""
        return sorted(p.name for p in self.root.iterdir() if not p.name.startswith("."))

    def context(self, settings: DatasetSettings, toml: dict) -> Context:
        """The :class:`~.dataset.Context` an array layout opens its files through (positional reads)."""
        raise NotImplementedError

    def cache_dir(self) -> Path:
        """Where this dataset keeps what it derives from its files (decompressed copies, shard indexes)."""
        raise NotImplementedError

    # -- reads of whole files and ranges, for layouts that index their files (WebDataset shards) ----------

    #: Bytes worth reading at once while walking a file's headers (a remote read costs a round trip).
    read_ahead: int = 1 << 20

    def stamp(self, path) -> tuple[int, str]:
        """``path``'s size and a version that changes when it is rewritten (mtime, ETag): what an index a
        layout keeps on disk is keyed by."""
        raise NotImplementedError

    def index_path(self, path, suffix: str) -> Path:
        """Where a layout keeps what it derives from ``path`` (``suffix``: what it is, ``.index.json``)."""
        return self.cache_dir() / (hashlib.blake2b(str(path).encode(), digest_size=12).hexdigest() + suffix)

    def pread(self, path, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes of ``path`` from ``offset`` (one read)."""
        raise NotImplementedError

    def read(self, path) -> bytes:
        """A whole small file (a ``classes.txt``)."""
        return path.read_bytes()

    def read_files(self, paths: list) -> list[bytes]:
        """Whole files of one batch (an ImageFolder's images; remote: fetched together where it can)."""
        return [self.read(path) for path in paths]

    def read_ranges(self, ranges: list[tuple[Any, int, int]]) -> list[bytes]:
        """The bytes of each ``(path, offset, length)`` of one batch (remote: fetched together where the
        location can)."""
        return [self.pread(path, offset, n) for path, offset, n in ranges]

    @contextmanager
    def batch(self) -> Iterator[None]:
        """The scope of one batch's reads (an object store: one deadline for all of them)."""
        yield

    def info(self) -> SourceInfo:
        """DatasetInfo keys this place adds (an object store: ``store``)."""
        return {}

    def stats(self) -> ReadStats:
        """How its reads go now (a remote location: requests in flight and their limit, its RAM cache); ``{}``."""
        client = getattr(self, "client", None)
        return client.read_stats() if client is not None and hasattr(client, "read_stats") else {}

    def close(self) -> None:
        """Release the client (threads, connections); the source calls it when it closes."""


@dataclass(frozen=True)
class Format:
    """One layout, as the registry (:mod:`..layouts`) lists it.

    ``open`` depends on ``serves``:

    - ``"tables"``: ``open(ctx) -> Layout``, where each split's bytes are (:mod:`.dataset`); served from
      RAM or streamed by a :class:`~.dataset.FileSource`, with the shared settings of ``dataset.toml``;
    - ``"samples"``: ``open(location, val_fraction) -> store`` of encoded samples (``num_samples``,
      ``fetch``, ``class_names``, ``close``), decoded on the provider (:mod:`..images`);
    - ``"source"``: ``open(location) -> Source``, a source of its own (Parquet, read by row group).
    """

    name: str
    #: Whether the layout is under the location's root (first match in registry order wins).
    detect: Callable[[Location], bool]
    open: Callable[..., Any]
    #: What its files are called, for the message when nothing is found.
    expected: str
    serves: str = "tables"
    #: The location kinds it reads from.
    where: tuple[str, ...] = KINDS
    #: Suffixes of files it decompresses into a local cache: refused where it reads by remote ranges.
    compressed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.serves not in SERVES or not set(self.where) <= set(KINDS):
            raise ValueError(f"format {self.name!r}: serves one of {SERVES}, reads at {KINDS}")

"""``file://DIR`` dataset sources: the data a user already has, in the layout it already has.

This module is the location part: ``DIR`` as a :class:`~.formats.location.Location` (its files read with
``preadv``, confined to ``DIR``, derived files in its cache). The layout is opened by :mod:`.layouts`,
named by ``format`` (the URI's, else ``dataset.toml``'s) or detected in ``DIR`` (first match wins):

- ``idx``: MNIST IDX, ``train-images-idx3-ubyte[.gz]`` + ``train-labels-idx1-ubyte[.gz]``, ``t10k-…``;
- ``cifar10``: CIFAR-10 binary, ``data_batch_1.bin`` … ``data_batch_5.bin``, ``test_batch.bin``;
- ``npy``: ``train_x.npy`` + ``train_y.npy`` (``val_…``, ``test_…``), or an ``.npz`` holding them;
- ``tokens``: ``.bin``/``.ds``/``.npy`` shards of 2- or 4-byte tokens, sequences of ``seq_len + 1``;
- ``raw``: little-endian arrays that a ``dataset.toml`` describes;
- ``parquet``: Parquet files as dataset hubs lay them out (:mod:`.formats.parquet`, its own parameters);
- ``imagefolder``: ``train/CLASS/*.jpg|png|webp`` trees, and ``webdataset``: ``*.tar`` shards, both
  decoded on the provider (:mod:`.images`: ``size``, ``augment``, ``bad``, ``workers``, ``encoded``);
- ``text``: ``train.txt`` (``val.txt``, ``test.txt``), a document per line, for a pipeline's
  ``tokenize`` and ``pack`` stages (``encoded=1``).

URI parameters (each but ``memory`` and ``cache`` may also be set in ``DIR/dataset.toml``; the URI
wins): ``format``; ``memory=auto|ram|stream`` (auto: RAM when the data is under a quarter of
MemAvailable and 2 GiB, else streamed with positional reads); ``cache=DIR`` for decompressed copies
(default ``DIR/.batchbus-cache``); ``val_fraction`` (default 0.1: the tail of train becomes val where
the files have no val split); ``seq_len``, ``token_bytes``, ``vocab_size`` for tokens; ``classes``
(``num_classes`` in the TOML) to skip counting class ids. ``dataset.toml`` may also set
``class_names``. A split the files lack has 0 samples (test) or is carved from train (val).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from libbus.errors import DatasetError

from .base import OpenRequest, Source, local_path
from .formats.dataset import Context
from .formats.dataset_toml import DatasetSettings
from .formats.location import Location
from .layouts import open_layout
from .storage.confine import Confinement

__all__ = ["FileLocation", "open_file_source"]


class FileLocation(Location):
    """A local directory: files read with positional reads, confined to the directory (and what the
    operator allows with ``?allow_paths=``; hard-linked files only with ``?allow_hardlinks=1``),
    derived files in ``?cache=DIR`` (default ``DIR/.batchbus-cache``)."""

    kind, label, memory = "file", "from local files", "auto"

    def __init__(self, req: OpenRequest):
        root = local_path(req.parts)
        # The operator's explicit allowance for files outside the directory (a dataset.toml cannot give it).
        self.extra = [Path(p.strip()) for p in req.params.pop("allow_paths", "").split(",") if p.strip()]
        if not root.is_dir():
            raise DatasetError(f"{req.uri}: {root} {'is not a directory' if root.exists() else 'does not exist'}")
        super().__init__(req, root)
        # Files with several links only where the operator says so on the URI (storage/confine.py).
        hardlinks = req.params.pop("allow_hardlinks", "0").strip().lower() in ("1", "true", "yes")
        self.confinement = Confinement(root, (root, *self.extra), hardlinks)
        self._cache: Path | None = None
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def cache_dir(self) -> Path:
        if self._cache is None:
            given = self.params.pop("cache", "")
            self._cache = Path(given) if given else self.root / ".batchbus-cache"
        return self._cache

    def context(self, settings: DatasetSettings, toml: dict) -> Context:
        cache = self.cache_dir()
        ctx = Context(self.uri, self.root, cache, settings, toml, (self.root, cache, *self.extra), self)
        ctx.confinement.hardlinks = self.confinement.hardlinks
        return ctx

    read_ahead = 1 << 16

    def stamp(self, path: Path) -> tuple[int, str]:
        self.confinement.check(path)  # refused at open, not at the first read
        st = path.stat()
        return st.st_size, str(st.st_mtime_ns)

    def index_path(self, path: Path, suffix: str) -> Path:
        return self.cache_dir() / (path.name + suffix)

    def pread(self, path: Path, offset: int, n: int) -> bytes:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = self.confinement.open(path)
        return os.pread(fd, n, offset)

    def read(self, path: Path) -> bytes:
        fd = self.confinement.open(path)  # checked as opened: a swapped symlink is refused here too
        try:
            with os.fdopen(fd, "rb") as f:
                return f.read()
        except OSError as err:
            raise DatasetError(f"{self.uri}: cannot read {path}: {err.strerror or err}") from None

    def close(self) -> None:
        """Close the files :meth:`pread` opened (each once, kept open for the dataset's reads)."""
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)


def open_file_source(req: OpenRequest) -> Source:
    """Open the dataset in the directory a ``file://`` URI names, popping the ``params`` it knows.

    Raises :class:`DatasetError` for a missing directory, an unknown layout, a bad parameter, or a
    missing, truncated or inconsistent file (naming the file, the fault and what was expected).
    """
    return open_layout(FileLocation(req))

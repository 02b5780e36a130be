"""File formats behind ``file://`` sources, one module each (idx, cifar, npy, tokens, raw), over a
shared core: :mod:`.reader` (positional, coalescing reads), :mod:`.cache` (decompress once) and
:mod:`.dataset` (the :class:`~.dataset.FileSource` that serves a format's layout); :mod:`.httprange` reads the same
bytes by HTTP range, :mod:`.objects` from object stores (through the disk cache :mod:`.blockcache`), and
:mod:`.dataset_toml` parses ``dataset.toml`` for all of them."""

from .dataset import FileSource, Layout, Table

__all__ = ["FileSource", "Layout", "Table"]

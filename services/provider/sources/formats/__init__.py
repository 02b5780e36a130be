"""How dataset files are laid out, one module per layout (idx, cifar, npy, tokens, raw; imagefolder,
webdataset + tarshards, textlines), each ending in its registry line (``FORMAT``, listed by
:mod:`..layouts`), over a shared core: :mod:`.location` (where bytes live: the interface a directory, an
HTTP listing or an object-store prefix offers, and the :class:`~.location.Format` record), :mod:`.reader`
(positional, coalescing reads), :mod:`.cache` (decompress once), :mod:`.confine` (files stay in their
directory) and :mod:`.dataset` (the :class:`~.dataset.FileSource` that serves an array layout's tables);
:mod:`.dataset_toml` parses ``dataset.toml`` for all of them. The remote reads behind the locations:
:mod:`.httprange` (HTTP ranges), :mod:`.objects` (object stores, through the disk cache :mod:`.blockcache`)."""

from .dataset import FileSource, Layout, Table

__all__ = ["FileSource", "Layout", "Table"]

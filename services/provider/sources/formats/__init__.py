"""How dataset files are laid out: one module per layout (idx, cifar, npy, tokens, raw; imagefolder,
webdataset + tarshards, textlines, tfrecord, mds, litdata, hfdisk, parquet), each ending in its registry
line (``FORMAT``, listed by :mod:`..layouts`). Their shared core: :mod:`.location` (the interface a
directory, an HTTP listing or an object-store prefix offers a layout, and the :class:`~.location.Format`
record), :mod:`.dataset` (the :class:`~.dataset.FileSource` that serves an array layout's tables) and
:mod:`.dataset_toml` (``dataset.toml``). Where the bytes live and how they are fetched (positional and
ranged reads, caches, confinement) is :mod:`services.provider.sources.storage`'s; a layout imports it,
never the other way round (``tests/project/test_layers.py``)."""

from .dataset import FileSource, Layout, Table

__all__ = ["FileSource", "Layout", "Table"]

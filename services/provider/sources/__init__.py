"""Dataset sources a provider serves, built from URIs, in layers:

- :mod:`.base`: the :class:`Source` contract, the splits, the :class:`OpenRequest` every opener takes;
- :mod:`.formats`: how bytes are laid out (IDX, CIFAR, npy, token shards, raw + ``dataset.toml``, ImageFolder,
  WebDataset, text lines: one module each) over positional, coalescing reads, and the
  :class:`~.formats.location.Location` interface that says where they live;
- :mod:`.formats.parquet` and :mod:`.images`: the Parquet layout (a source of its own) and encoded samples decoded
  on the provider;
- :mod:`.layouts`: the only module that lists layouts, and the one routine that opens one at any location;
- one module per kind: :mod:`.mock` (``mock://``, ``dummy://``), and the locations :mod:`.files` (``file://``),
  :mod:`.http` (``http(s)://``), :mod:`.objstore` (``s3://``, ``gs://``, ``az://``); :mod:`.weighted`
  (``weighted://``), :mod:`.pipeline` (``pipeline://``: a source followed by transform stages), and
  ``parquet://``;
- :mod:`.registry`: the only module that lists schemes, and :func:`open_source`.
"""

from .base import PRIVATE_SPLIT, SPLITS, OpenRequest, Source
from .registry import OPENERS, open_source, parse_dataset_arg

__all__ = ["OPENERS", "PRIVATE_SPLIT", "SPLITS", "OpenRequest", "Source", "open_source", "parse_dataset_arg"]

"""Dataset sources a provider serves, built from URIs, in layers:

- :mod:`.base`: the :class:`Source` contract, the splits, the :class:`OpenRequest` every opener takes;
- :mod:`.formats`: file layouts (IDX, CIFAR, npy, token shards, raw + ``dataset.toml``) over positional,
  coalescing reads of local files or HTTP ranges;
- one module per kind: :mod:`.mock` (``mock://``, ``dummy://``), :mod:`.files` (``file://``),
  :mod:`.http` (``http(s)://``), :mod:`.parquet` (``parquet://``), :mod:`.weighted` (``weighted://``),
  :mod:`.pipeline` (``pipeline://``: a source followed by transform stages);
- :mod:`.registry`: the only module that lists schemes, and :func:`open_source`.
"""

from .base import PRIVATE_SPLIT, SPLITS, OpenRequest, Source
from .registry import OPENERS, open_source, parse_dataset_arg

__all__ = ["OPENERS", "PRIVATE_SPLIT", "SPLITS", "OpenRequest", "Source", "open_source", "parse_dataset_arg"]

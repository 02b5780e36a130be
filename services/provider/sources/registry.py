"""The only module that lists dataset URI schemes: scheme → the kind's opener.

Adding a source kind means one module under :mod:`services.provider.sources` (importing only
:mod:`.base` and :mod:`.formats`) and one line in :data:`OPENERS`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from urllib.parse import parse_qs, urlsplit

from libbus.errors import DatasetError

from . import files, hfhub, http, mock, objstore, pipeline, weighted
from .base import OpenRequest, Source
from .formats import parquet

__all__ = ["OPENERS", "open_source", "parse_dataset_arg"]

#: scheme → opener(OpenRequest) → Source. An opener pops the parameters it understands; whatever is
#: left is reported as unknown.
OPENERS: dict[str, Callable[[OpenRequest], Source]] = {
    "mock": mock.open_mock,
    "dummy": mock.open_dummy,
    "file": files.open_file_source,
    "http": http.open_http_source,
    "https": http.open_http_source,
    "parquet": parquet.open_parquet,
    "weighted": weighted.open_weighted,
    "pipeline": pipeline.open_pipeline,
    **{scheme: objstore.open_object_source for scheme in objstore.SCHEMES},
    "hf": hfhub.open_hf_source,
}


def open_source(uri: str, named: Mapping[str, Source] | None = None, user_modules: Collection[str] = ()) -> Source:
    """Build the source a URI names. Raises :class:`DatasetError` saying what is wrong with it.

    ``named``: the datasets the same provider serves so far, which a ``weighted://`` mix may name.
    ``user_modules``: the modules pipeline ``user`` stages may run (the provider's ``user_modules``).
    """
    parts = urlsplit(uri)
    raw = parse_qs(parts.query, keep_blank_values=True)
    params = {k: v[-1] for k, v in raw.items()}
    opener = OPENERS.get(parts.scheme)
    if opener is None:
        raise DatasetError(
            f"unsupported dataset URI {uri!r}: known schemes are {', '.join(s + '://' for s in OPENERS)}"
        )
    # nested URIs (a mix's members, a pipeline's source) are opened without the provider's names; a
    # partial, not a closure, so that it pickles (an image source's `pool=process` workers open with it)
    allowed = frozenset(user_modules)
    nested = functools.partial(open_source, user_modules=allowed)
    source = opener(OpenRequest(uri, parts, params, open=nested, named=named or {}, user_modules=allowed))
    if params:
        raise DatasetError(f"{uri}: unknown parameter(s) {', '.join(sorted(params))}")
    return source


def parse_dataset_arg(arg: str) -> tuple[str, str]:
    """``NAME=URI`` → (name, uri), as given to ``busctl start provider --dataset``."""
    name, sep, uri = arg.partition("=")
    name = name.strip()
    if not sep or not name or not uri:
        raise DatasetError(f"--dataset {arg!r}: expected NAME=URI, e.g. mnist=mock://mnist")
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise DatasetError(f"--dataset {arg!r}: name may hold letters, digits, '-', '_', '.'")
    return name, uri.strip()

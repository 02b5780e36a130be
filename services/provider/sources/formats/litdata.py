"""Lightning litData's ``optimize()`` output, served as written: ``index.json`` and its chunks, read as named
fields in the samples' own order (or ``(x, y)``).

Where: ``DIR/index.json`` (``config`` and ``chunks``), all train (val: the tail of train, ``val_fraction``,
default 0.1), or ``DIR/train``, ``DIR/val``, ``DIR/test`` each holding one (``optimize()`` run once per
split). A chunk has MDS's layout (``uint32 n | uint32 offsets[n + 1] | samples``; :mod:`.mds` reads both),
and a sample is the ``uint32`` size of each leaf, then each leaf's bytes. The leaves' names come from
``data_spec`` (the PyTree ``optimize()``'s function returned): a flat dict's keys, in its order; a tuple's
or list's positions, ``0``, ``1``, …; a single value is ``0``.

Leaf encodings (``data_format``) → fields: ``int`` → ``int64 ()``, ``float`` → ``float64 ()``, ``bool`` →
``bool ()``; ``str``, ``text``, ``json`` → ``str``; ``bytes``, ``jpeg``, ``image`` → ``bytes`` (images stay
encoded: a pipeline's image stages decode them on the provider); ``numpy``, ``tensor`` → their dtype with
the first sample's rank, every dimension variable; ``no_header_numpy:N``, ``no_header_tensor:N`` → ``(?,)``;
``pil`` → ``uint8 (?, ?, ?)``. Anything else (``pickle``, never unpickled; ``video``, ``audio``, ``file``,
…) is refused at open naming the leaf, unless ``?fields=`` leaves it out; so are compressed or encrypted
chunks and loaders other than ``PyTreeLoader`` (token datasets: ``TokensLoader``), naming what to write
instead. ``?fields=``, ``?label=``, ``?shape=``: :mod:`.fieldpick`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from libbus.errors import DatasetError

from ..base import Field
from .location import Format, Location, val_fraction
from .mds import Columns, MDSSource, Shard, index_paths, pil, read_index, read_offsets

__all__ = ["EXPECTED", "FORMAT", "detect", "leaf_names", "open_location"]

EXPECTED = "litData optimize() output: index.json (config, chunks) and its chunk-*.bin files"
PARAMS = ("fields", "label", "shape", "classes", "val_fraction")
#: litData's dtype tables (litdata/constants.py: "DON'T CHANGE ORDER"), as numpy dtype names; None: no
#: batchbus dtype (complex, bfloat16, object).
NUMPY: list[str | None] = [
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
]
NUMPY += [None, None, "bool", None, None, None, None]  # complex64/128, bool, object, bytes, str, void
TORCH: list[str | None] = [
    "float32",
    "float32",
    "float64",
    "float64",
    None,
    None,
    None,
    None,
    "float16",
    "float16",
    None,
    "uint8",
]
TORCH += ["int8", "int16", "int16", "int32", "int32", "int64", "int64", "bool", "uint16"]
_SCALARS = {"int": "int64", "float": "float64", "bool": "bool"}
_WHY = {"pickle": "is pickled (data_format 'pickle'), and batchbus never unpickles what it serves"}


def _is_litdata(loc: Location, path) -> bool:
    try:
        index = read_index(loc, path)
    except DatasetError:
        return False
    return isinstance(index.get("chunks"), list) and isinstance(index.get("config"), dict)


def detect(loc: Location) -> bool:
    return any(_is_litdata(loc, loc.root / f"{p}index.json") for p in index_paths(loc.root).values())


def leaf_names(spec_text: str, where: str) -> list[str]:
    """The names of the leaves of litData's ``data_spec`` (see the module doc)."""
    try:
        spec = json.loads(spec_text)
        tree = spec[1] if isinstance(spec, list) and len(spec) == 2 else spec
        kind, children = tree.get("type"), tree.get("children_spec") or []
        if kind is None:
            return ["0"]
        if any(c.get("type") is not None for c in children):
            raise DatasetError(f"{where}: samples of nested containers; batchbus reads a flat dict, tuple or list")
        if kind in ("builtins.dict", "collections.OrderedDict"):
            keys = json.loads(tree["context"])
            return [str(k) for k in keys]
        if kind in ("builtins.tuple", "builtins.list"):
            return [str(i) for i in range(len(children))]
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
        raise DatasetError(f"{where}: data_spec is not a PyTree spec batchbus reads: {err}") from None
    raise DatasetError(f"{where}: samples of type {kind}; batchbus reads a flat dict, tuple or list")


def _indexed(table: list, code: str, what: str) -> str | None:
    try:
        return table[int(code)]
    except (ValueError, IndexError):
        raise DatasetError(f"unknown {what} dtype code {code!r}") from None


def _array(data: bytes, name: str, torch: bool) -> np.ndarray:
    """A ``numpy`` (little-endian uint32 header) or ``tensor`` (big-endian) leaf with its header."""
    if torch:
        code, rank = struct.unpack_from(">II", data, 0)
        shape, pos, dtype = struct.unpack_from(f">{rank}I", data, 8), 8 + 4 * rank, TORCH[code]
    else:
        code, rank = struct.unpack_from("<II", data, 0)
        shape, pos, dtype = struct.unpack_from(f"<{rank}I", data, 8), 8 + 4 * rank, NUMPY[code]
    if dtype is None:
        raise DatasetError(f"leaf {name!r}: an array of a dtype batchbus does not serve (code {code})")
    return np.frombuffer(data, np.dtype(dtype).newbyteorder("<"), offset=pos).reshape(shape)


class LitColumns(Columns):
    """litData's leaf encodings (see the module doc)."""

    format = "litdata"
    what = "leaf"

    def field(self, name: str, encoding: str, first: bytes | None) -> Field | str:
        base, _, arg = encoding.partition(":")
        if base in _SCALARS:
            return Field(name, _SCALARS[base], ())
        if base in ("str", "text", "json"):
            return Field(name, "str", ())
        if base in ("bytes", "jpeg", "image"):
            return Field(name, "bytes", ())
        if base == "pil":
            return Field(name, "uint8", (None, None, None))
        if base in ("no_header_numpy", "no_header_tensor"):
            dtype = _indexed(NUMPY if base == "no_header_numpy" else TORCH, arg, base)
            return Field(name, dtype, (None,)) if dtype else f"is an array of a dtype batchbus does not serve ({arg})"
        if base in ("numpy", "tensor"):
            if first is None:
                return "is an array, and the dataset has no sample to learn its dtype and rank from"
            a = _array(first, name, base == "tensor")
            return Field(name, a.dtype.name, (None,) * a.ndim)
        return _WHY.get(base, f"has data_format {encoding!r}, which batchbus does not map to a field")

    def decoder(self, encoding: str, field: Field, name: str) -> Callable[[bytes], Any]:
        base, _, arg = encoding.partition(":")
        if field.dtype == "bytes":
            return bytes
        if field.dtype == "str":
            return lambda b: bytes(b).decode("utf-8")
        if base in _SCALARS:
            dt = np.dtype(_SCALARS[base]).newbyteorder("<")
            return lambda b: np.frombuffer(b, dt, 1)[0] if base != "bool" else b[0] != 0
        if base == "pil":
            return lambda b: pil(b, name)
        if base.startswith("no_header"):
            dt = np.dtype(field.dtype).newbyteorder("<")
            return lambda b: np.frombuffer(b, dt)

        def array(b: bytes) -> np.ndarray:
            a = _array(b, name, base == "tensor")
            if a.dtype.name != field.dtype or a.ndim != len(field.shape):
                raise DatasetError(
                    f"leaf {name!r}: a sample is {a.dtype.name} of {a.ndim} dimensions; the first was "
                    f"{field.describe()}"
                )
            return a

        return array


def _chunks(loc: Location, prefix: str, index: dict, where: str) -> list[Shard]:
    config = index["config"]
    if config.get("compression"):
        raise DatasetError(
            f"{where}: chunks compressed with {config['compression']!r} are not read yet; run optimize() "
            "with compression=None (litData's default)"
        )
    if config.get("encryption"):
        raise DatasetError(f"{where}: encrypted chunks are not read; run optimize() without encryption")
    if config.get("item_loader", "PyTreeLoader") != "PyTreeLoader":
        raise DatasetError(
            f"{where}: item_loader {config.get('item_loader')!r}: batchbus reads PyTreeLoader chunks (token "
            "datasets: serve token shards, docs/datasets.md §2)"
        )
    formats = config.get("data_format")
    if not isinstance(formats, list):
        raise DatasetError(f"{where}: config has no data_format list")
    names = leaf_names(config.get("data_spec", ""), where)
    if len(names) != len(formats):
        raise DatasetError(f"{where}: data_spec names {len(names)} leaves, data_format {len(formats)}")
    shards = []
    for i, chunk in enumerate(index["chunks"]):
        path = loc.root / f"{prefix}{chunk.get('filename')}"
        if not path.is_file():
            raise DatasetError(f"{where}: chunk {i} ({chunk.get('filename')!r}) is missing")
        offsets = read_offsets(loc, path, None, int(chunk.get("chunk_size", -1)), "index.json")
        shards.append(Shard(str(path), path, None, names, [str(f) for f in formats], [None] * len(names), offsets))
    return shards


def open_location(loc: Location) -> MDSSource:
    """The litData dataset at ``loc`` (local files, HTTP, an object store), popping the parameters this
    layout knows (see the module doc). Raises :class:`DatasetError`."""
    params = {k: loc.params.pop(k) for k in PARAMS if k in loc.params}
    fraction = val_fraction(loc.uri, params.get("val_fraction", "0.1"))
    indexes = index_paths(loc.root)
    if "train" not in indexes:
        raise DatasetError(f"{loc.uri}: no litData index.json in {loc.root} or {loc.root}/train; expected {EXPECTED}")
    shards = {}
    for split, prefix in indexes.items():
        path = loc.root / f"{prefix}index.json"
        index = read_index(loc, path)
        if not isinstance(index.get("chunks"), list) or not isinstance(index.get("config"), dict):
            raise DatasetError(f"{path}: not a litData index (no 'config' and 'chunks')")
        shards[split] = _chunks(loc, prefix, index, str(path))
    if not shards["train"]:
        raise DatasetError(f"{loc.root / (indexes['train'] + 'index.json')}: lists no chunks")
    return MDSSource(loc, shards, params, fraction, LitColumns())


#: This layout's line in the registry (:mod:`..layouts`).
FORMAT = Format("litdata", detect, open_location, EXPECTED, "source")

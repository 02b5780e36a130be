"""Hugging Face datasets saved with ``save_to_disk``, served as written: the Arrow files, memory-mapped.

Layout: a ``DatasetDict`` (``DIR/dataset_dict.json`` naming its splits, one folder each) or one ``Dataset``
(``DIR/state.json``: all train). A split's folder holds ``state.json`` (its ``_data_files``, in order),
``dataset_info.json`` (its features) and the Arrow files (IPC stream format, as ``datasets`` writes them).
Split names: ``train``; ``validation``/``valid``/``val``/``dev`` for val; ``test``; without val, val is
the tail of train (``val_fraction``, default 0.1). The files are memory-mapped at open (pyarrow reads a
stream's batches without copying them), so memory holds only what batches touch; local files only (an
Arrow stream has no index to read by range).

Columns → fields, in the dataset's column order: an ``Image`` or ``Audio`` feature (``{bytes, path}``) and
binary → ``bytes`` (the encoded file as stored: a pipeline's image stages decode it on the provider; a row
holding only a path is refused when read); a string → ``str``; a number or bool → its dtype ``()``; a list
of numbers of fixed length (``Sequence(length=n)``) → ``(n,)``, nested → ``(n, m)``; of any length → ``(?,)``
(``(?, ?)`` nested). Anything else is refused at open naming the column, unless ``?fields=`` leaves it out.
``?fields=``, ``?label=``, ``?shape=``: :mod:`.fieldpick`; a ``ClassLabel`` label's class names come from the
features, its ``num_classes`` from them (else ``?classes=``, else its largest value + 1).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from libbus.errors import DatasetError

from ..base import SPLITS, Field, FieldBatch, SourceInfo
from . import val_carve
from .fieldpick import Pick, PickedSource, classes, fill, select
from .location import Format, Location, val_fraction

__all__ = ["EXPECTED", "FORMAT", "HFDiskSource", "arrow_field", "detect", "open_location"]

EXPECTED = "Hugging Face save_to_disk: dataset_dict.json and split folders, or state.json and Arrow files"
PARAMS = ("fields", "label", "shape", "classes", "val_fraction")
SPLIT_NAMES = {"train": "train", "validation": "val", "valid": "val", "val": "val", "dev": "val", "test": "test"}


def _pyarrow():
    try:
        import pyarrow as pa  # optional: imported when used
    except ImportError as err:
        raise DatasetError("Hugging Face Arrow datasets need pyarrow: pip install 'batchbus[parquet]'") from err
    return pa


def detect(root) -> bool:
    return (root / "dataset_dict.json").is_file() or (
        (root / "state.json").is_file() and (root / "dataset_info.json").is_file()
    )


def _json(path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as err:
        raise DatasetError(f"{path}: not readable JSON: {err}") from None


def _numeric(t) -> bool:
    pa = _pyarrow()
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def arrow_field(name: str, t) -> Field | str:
    """The field a column of Arrow type ``t`` is served as, or why it cannot be (a str)."""
    pa = _pyarrow()
    if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
        return Field(name, "bytes", ())
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return Field(name, "bytes", ())
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return Field(name, "str", ())
    if _numeric(t):
        return Field(name, np.dtype(t.to_pandas_dtype()).name, ())
    shape: list[int | None] = []
    inner = t
    while pa.types.is_fixed_size_list(inner) or pa.types.is_list(inner) or pa.types.is_large_list(inner):
        shape.append(inner.list_size if pa.types.is_fixed_size_list(inner) else None)
        inner = inner.value_type
    if shape and _numeric(inner):
        return Field(name, np.dtype(inner.to_pandas_dtype()).name, tuple(shape))
    return f"is {t}, which batchbus does not map to a field"


def _max_bytes(tables: dict[str, Any], name: str, field: Field) -> int:
    """The most bytes one row of a variable field holds (0 where not found cheaply: nested lists), from
    the columns' offsets: with it, a same-host trainer gets batches through shared memory."""
    if not field.variable or len(field.shape) > 1:
        return 0
    import pyarrow.compute as pc

    pa, top = _pyarrow(), 0
    for t in tables.values():
        column = t.column(name)
        if pa.types.is_struct(column.type):
            column = pc.struct_field(column, "bytes")
        if field.opaque:
            got = pc.max(pc.binary_length(column)).as_py()
        else:
            got = pc.max(pc.list_value_length(column)).as_py()
            got = None if got is None else got * field.np_dtype.itemsize
        top = max(top, got or 0)
    return top


class HFDiskSource(PickedSource):
    """The rows of a ``save_to_disk`` dataset as named fields in column order, or ``(x, y)``."""

    def __init__(self, loc: Location, tables: dict[str, Any], info: dict, params: dict[str, str], val_fraction: float):
        self.uri, self.location, self.root = loc.uri, loc, loc.root
        pa = _pyarrow()
        self.val_fraction: float | None = None
        if "val" not in tables:
            train = tables["train"]
            keep = val_carve.tail(self.uri, train.num_rows, val_fraction, "rows")
            tables["train"], tables["val"] = train.slice(0, keep), train.slice(keep)
            self.val_fraction = val_fraction
        self.tables: dict[str, Any] = {s: tables.get(s) for s in SPLITS}
        schema = tables["train"].schema
        for split, t in tables.items():
            if t.schema.names != schema.names:
                raise DatasetError(f"{self.uri}: split {split} has columns {t.schema.names}, train {schema.names}")
        columns: dict[str, Field] = {}
        refused: dict[str, str] = {}
        for name in schema.names:
            got = arrow_field(name, schema.field(name).type)
            if isinstance(got, str):
                refused[name] = got
            else:
                columns[name] = Field(got.name, got.dtype, got.shape, _max_bytes(tables, name, got))
        self.selection = select(self.uri, columns, refused, params, "column")
        self.label, self.num_classes = self.selection.label, 0
        if self.selection.xy:
            x = self.selection.picks[0].field
            self.sample_shape, self.dtype, self.kind = x.fixed_shape, x.np_dtype, "image"
        else:
            self.sample_shape, self.dtype, self.kind = (0,), np.dtype(np.uint8), "fields"
        if self.label is not None:
            names = ((info.get("features") or {}).get(self.label) or {}).get("names")
            if isinstance(names, list) and not params.get("classes"):
                self.num_classes, self.class_names = len(names), [str(n) for n in names]
            else:
                import pyarrow.compute as pc

                lo, hi = 0, -1
                for t in tables.values():
                    if t.num_rows:
                        mm = pc.min_max(t.column(self.label)).as_py()
                        lo, hi = (mm["min"], mm["max"]) if hi < lo else (min(lo, mm["min"]), max(hi, mm["max"]))
                self.num_classes = classes(self.uri, self.label, lo, hi, params.get("classes"))
                self.class_names = [str(i) for i in range(self.num_classes)]
        self._pa = pa

    @property
    def fields(self) -> list[Field]:
        return self.selection.fields

    def num_samples(self, split: str) -> int:
        t = self.tables[split]
        return 0 if t is None else t.num_rows

    def _column(self, pick: Pick, column, where) -> list | np.ndarray:
        pa, f = self._pa, pick.field
        if not len(column):  # no rows asked: an empty batch of the field
            return fill(pick, [], where)
        if pa.types.is_struct(column.type):
            values = column.field("bytes").to_pylist()
            if any(v is None for v in values):
                raise DatasetError(f"{where(values.index(None))}: {pick.column!r} holds only a path, not the bytes")
            return values
        if f.dtype in ("bytes", "str") or f.variable or pa.types.is_list(column.type):
            return fill(pick, column.to_pylist(), where)
        if not f.shape or not pa.types.is_fixed_size_list(column.type):
            return fill(pick, list(column.to_numpy(zero_copy_only=False)), where)
        flat = column
        while pa.types.is_fixed_size_list(flat.type):
            flat = flat.flatten()
        values = flat.to_numpy(zero_copy_only=False)
        return fill(pick, list(values.reshape(len(column), -1)), where)

    def _take(self, chunked, idx: np.ndarray):
        """Rows ``idx`` of a column, in that order, as one array. ``ChunkedArray.take`` concatenates
        every chunk first (a copy of the whole column per batch: a save_to_disk file holds a chunk per
        1,000 rows); this takes the rows chunk by chunk and copies only those."""
        pa = self._pa
        if chunked.num_chunks == 1:
            return chunked.chunk(0).take(pa.array(idx))
        lengths = np.fromiter((len(c) for c in chunked.chunks), np.int64, chunked.num_chunks)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        if not len(idx):
            return pa.array([], type=chunked.type)
        which = np.searchsorted(starts, idx, side="right") - 1
        order = np.argsort(which, kind="stable")  # rows grouped by chunk, request order kept within one
        grouped_which, grouped_idx = which[order], idx[order]
        chunks, first = np.unique(grouped_which, return_index=True)
        ends = np.append(first[1:], len(idx))
        pieces = [
            chunked.chunk(int(c)).take(pa.array(grouped_idx[a:b] - starts[c]))
            for c, a, b in zip(chunks, first, ends, strict=True)
        ]
        return pa.concat_arrays(pieces).take(pa.array(np.argsort(order)))  # back to request order

    def _values(self, split: str, indices: np.ndarray) -> FieldBatch:
        idx = np.asarray(indices, np.int64).reshape(-1)
        n = self.num_samples(split)
        if len(idx) and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"index {int(idx.min() if idx.min() < 0 else idx.max())} is outside {split} (0..{n - 1})")
        table = self.tables[split]
        out: FieldBatch = {}
        for pick in self.selection.picks:
            column = self._take(table.column(pick.column), idx)

            def where(i: int, split=split) -> str:
                return f"{self.uri}: {split}[{int(idx[i])}]"

            out[pick.field.name] = self._column(pick, column, where)
        self.check_labels(out, split)
        return out

    def info(self) -> SourceInfo:
        info = super().info()
        info.update({"format": "hf-disk", "path": str(self.root), "columns": self.tables["train"].schema.names})
        if self.val_fraction is not None:
            info["val_fraction"] = self.val_fraction
            info["val_carved"] = "the tail of train, in file order"
        return info

    def close(self) -> None:
        self.tables = {s: None for s in SPLITS}  # the memory maps go with the tables
        self.location.close()


def _split_table(loc: Location, folder) -> tuple[Any, dict]:
    pa = _pyarrow()
    state = _json(folder / "state.json")
    files = [f.get("filename") for f in state.get("_data_files", []) if isinstance(f, dict)]
    if not files or not all(isinstance(f, str) for f in files):
        raise DatasetError(f"{folder / 'state.json'}: lists no Arrow files (_data_files)")
    info = _json(folder / "dataset_info.json") if (folder / "dataset_info.json").is_file() else {}
    tables = []
    for name in files:
        path = folder / name
        if loc.confinement is not None:
            loc.confinement.check(path)  # a symlink out of the dataset's directory is refused
        try:
            with pa.memory_map(str(path)) as source:
                tables.append(pa.ipc.open_stream(source).read_all())
        except (OSError, pa.ArrowInvalid) as err:
            raise DatasetError(f"{path}: not a readable Arrow stream: {err}") from None
    try:
        return pa.concat_tables(tables), info
    except pa.ArrowInvalid as err:
        raise DatasetError(f"{folder}: its Arrow files do not share one schema: {err}") from None


def open_location(loc: Location) -> HFDiskSource:
    """The ``save_to_disk`` dataset in the local directory ``loc`` (see the module doc)."""
    params = {k: loc.params.pop(k) for k in PARAMS if k in loc.params}
    fraction = val_fraction(loc.uri, params.get("val_fraction", "0.1"))
    root = loc.root
    if (root / "dataset_dict.json").is_file():
        names = _json(root / "dataset_dict.json").get("splits", [])
        folders = {SPLIT_NAMES[n]: root / n for n in names if n in SPLIT_NAMES}
        if unknown := [n for n in names if n not in SPLIT_NAMES]:
            raise DatasetError(f"{loc.uri}: split(s) {', '.join(unknown)} are not train, validation or test")
    else:
        folders = {"train": root}
    if "train" not in folders:
        raise DatasetError(f"{loc.uri}: no train split in {root}; expected {EXPECTED}")
    tables: dict[str, Any] = {}
    info: dict = {}
    for split, folder in folders.items():
        tables[split], split_info = _split_table(loc, folder)
        info = info or split_info
    return HFDiskSource(loc, tables, info, params, fraction)


#: This layout's line in the registry (:mod:`..layouts`).
FORMAT = Format("hf-disk", lambda loc: detect(loc.root), open_location, EXPECTED, "source", ("file",))

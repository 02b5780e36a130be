"""Parquet datasets, laid out as dataset hubs export them: ``parquet://DIR`` (or ``file://DIR``
holding such files).

Files of a split (``*`` any suffix, e.g. ``-00000-of-00004``), looked for in ``DIR`` and ``DIR/data``,
or in ``DIR/SUBSET`` and ``DIR/SUBSET/data`` when ``?subset=`` names a subset folder (a single
subset folder is used without being named): ``train*.parquet`` or ``train/*.parquet``;
``validation``, ``valid``, ``val`` or ``dev`` for val; ``test``. Without val files, val is carved
from the tail of train (``val_fraction``, default 0.1), as for ``file://``.

Columns: ``?column=`` the feature (default: ``image``, ``img``, ``pixel_values``, ``x``,
``features``, ``input_ids`` or ``tokens``, whichever exists, else the only column left), and
``?label=`` the label (default: ``label``, ``labels``, ``target``, ``y`` or ``class``, if any;
``label=`` empty for none). The feature may be

- an image: bytes (PNG, JPEG, ... as Pillow reads them), or the ``{bytes, path}`` struct of an image
  feature; decoded per sample with Pillow, served ``uint8`` as ``(1, H, W)`` (grey) or ``(3, H, W)``;
  every image must have the first one's size;
- a list (or fixed-size list, nested lists) of numbers with one shape in every row;
- several numeric columns, ``column=a,b,c``, served side by side as a vector.

Named fields instead of x/y: ``?fields=image:image,caption,label`` serves those columns as fields
of the same names — images of any size as bytes or decoded ``uint8 (?, ?, 3)``, text as strings,
numbers and lists of numbers — and ``?max_bytes=`` declares a variable field's largest sample
(below). ``?encoded=1`` serves a string column (``column=``, default ``text``) as
text samples for a pipeline's ``tokenize`` stage, like ``train.txt`` lines (docs/datasets.md §9.4).

Integer labels are class ids (served int64); ``num_classes`` comes from ``?classes=``, the
class names a hub stores in the file's metadata, or the largest label. Reads go by row group: a
batch reads each row group it touches once, keeping the most recently used ones (encoded, not
decoded) up to ``cache_mb`` (default 256); memory stays bounded whatever the dataset's size.
Shuffling whole row groups (``shuffle = "block"`` with ``block_size`` near the row-group size)
reads far less than a full shuffle.

Named fields (``?fields=COL[:HOW],...``): each listed column becomes a field of the same name, ``HOW``
saying what: a binary column or a hub's image struct ``{bytes, path}`` is ``bytes`` (the default: the
encoded file) or ``image`` (decoded to ``uint8 (?, ?, 3)``, any size per row) or ``grey``
(``(?, ?, 1)``); a string column is ``str``; a column of numbers a fixed field of shape ``()``, of lists
of numbers ``(?,)``. ``max_bytes=`` declares the most bytes one sample of a variable field holds
(decoded bytes for an image): with it, a same-host trainer gets batches through shared memory.
"""

from __future__ import annotations

import io
import json
import threading
from collections import OrderedDict
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from libbus.errors import DatasetError

from ..base import SPLITS, Field, FieldBatch, OpenRequest, Source, SourceInfo, local_path, relative_name
from . import val_carve
from .imagefolder import Encoded
from .location import Format, Location

if TYPE_CHECKING:  # optional at run time: imported when used (_pyarrow)
    from pyarrow import Table as ArrowTable
    from pyarrow.parquet import ParquetFile

__all__ = ["FORMAT", "ParquetSource", "detect", "open_parquet", "open_parquet_dir"]

SPLIT_NAMES = {"train": ("train",), "val": ("validation", "valid", "val", "dev"), "test": ("test",)}
FEATURE_NAMES = ("image", "img", "pixel_values", "x", "features", "input_ids", "tokens")
LABEL_NAMES = ("label", "labels", "target", "y", "class")
EXPECTED = "Parquet files: train*.parquet or train/*.parquet (in DIR, DIR/data or a subset folder)"
PARAMS = ("column", "label", "subset", "val_fraction", "classes", "cache_mb", "fields", "max_bytes", "encoded")


def _pyarrow():
    try:
        import pyarrow as pa  # optional: imported when used
        import pyarrow.parquet as pq
    except ImportError as err:
        raise DatasetError("Parquet datasets need pyarrow: pip install 'batchbus[parquet]'") from err
    return pa, pq


def _split_files(folder: Path, split: str) -> list[Path]:
    for name in SPLIT_NAMES[split]:
        found = sorted(folder.glob(f"{name}-*.parquet")) + sorted(folder.glob(f"{name}.parquet"))
        found += sorted((folder / name).glob("*.parquet")) if (folder / name).is_dir() else []
        if found:
            return found
    return []


def _folders(root: Path) -> list[Path]:
    return [root, root / "data"]


def detect(root: Path) -> bool:
    """Whether ``root`` (or a subset folder in it) holds Parquet train files."""
    return any(_split_files(f, "train") for r in [root, *_subsets(root)] for f in _folders(r))


def _subsets(root: Path) -> list[Path]:
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir()
        and p.name not in ("data", *SPLIT_NAMES["train"])
        and not p.name.startswith(".")
        and any(_split_files(f, "train") for f in _folders(p))
    )


def find_files(uri: str, root: Path, subset: str | None) -> dict[str, list[Path]]:
    """The Parquet files of each split under ``root`` (see the module doc)."""
    if subset:
        base = root / subset
        if not base.is_dir():
            raise DatasetError(
                f"{uri}: no subset folder {subset!r} in {root}; found "
                f"{', '.join(p.name for p in _subsets(root)) or 'none'}"
            )
    else:
        base = root
        if not any(_split_files(f, "train") for f in _folders(root)):
            subsets = _subsets(root)
            if len(subsets) > 1:
                raise DatasetError(
                    f"{uri}: {len(subsets)} subsets ({', '.join(p.name for p in subsets)}); "
                    "choose one with ?subset=NAME"
                )
            base = subsets[0] if subsets else root
    out = {}
    for split in SPLITS:
        for folder in _folders(base):
            if files := _split_files(folder, split):
                out[split] = files
                break
    if "train" not in out:
        raise DatasetError(
            f"{uri}: no Parquet train files in {base} or {base / 'data'}; expected "
            "train-*.parquet, train.parquet or train/*.parquet"
        )
    return out


class _Kind:
    """How a feature column becomes samples: ``image``, ``list`` or ``columns``."""

    def __init__(self, name: str, columns: list[str], shape: tuple[int, ...], dtype: np.dtype, mode: str | None = None):
        self.name, self.columns, self.shape, self.dtype, self.mode = name, columns, shape, dtype, mode


def _decode_image(blob, where: str, mode: str | None = None) -> np.ndarray:
    try:
        from PIL import Image, UnidentifiedImageError  # optional: image columns only
    except ImportError as err:
        raise DatasetError("image columns need Pillow: pip install 'batchbus[parquet]'") from err
    if isinstance(blob, dict):
        blob = blob.get("bytes")
    if not blob:
        raise DatasetError(f"{where}: the image has no bytes (only a path?); store the image bytes in the file")
    try:
        with Image.open(io.BytesIO(blob)) as opened:
            img = opened.convert(mode or ("L" if opened.mode in ("1", "L", "P", "I;16") else "RGB"))
            a = np.asarray(img, np.uint8)
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise DatasetError(f"{where}: not a readable image: {err}") from err
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


def _kind(uri: str, path: Path, table, columns: list[str]) -> _Kind:
    """What the feature column(s) hold, from the first row of ``table``."""
    pa, _ = _pyarrow()
    types = [table.schema.field(c).type for c in columns]
    if len(columns) > 1:
        if not all(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) for t in types):
            raise DatasetError(
                f"{uri}: several feature columns must all be numbers; {', '.join(columns)} are "
                f"{', '.join(map(str, types))}"
            )
        dtype = np.result_type(*[t.to_pandas_dtype() for t in types])
        return _Kind("columns", columns, (len(columns),), np.dtype(dtype))
    t, col = types[0], columns[0]
    is_image_struct = pa.types.is_struct(t) and t.get_field_index("bytes") >= 0
    if is_image_struct or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        first = _decode_image(table.column(col)[0].as_py(), f"{path} column {col!r} row 0")
        return _Kind("image", columns, first.shape, np.dtype(np.uint8), "L" if first.shape[0] == 1 else "RGB")
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return _Kind("columns", columns, (1,), np.dtype(t.to_pandas_dtype()))
    inner = t
    while pa.types.is_list(inner) or pa.types.is_large_list(inner) or pa.types.is_fixed_size_list(inner):
        inner = inner.value_type
    if inner is not t:
        if not (pa.types.is_integer(inner) or pa.types.is_floating(inner) or pa.types.is_boolean(inner)):
            raise DatasetError(f"{path}: column {col!r} holds lists of {inner}, not numbers")
        dtype = np.dtype(inner.to_pandas_dtype())
        return _Kind("list", columns, np.asarray(table.column(col)[0].as_py(), dtype).shape, dtype)
    text = " (text: encoded=1 feeds a pipeline's tokenize stage)" if pa.types.is_string(t) else ""
    raise DatasetError(f"{path}: column {col!r} is {t}; expected image bytes, a list of numbers, or numbers{text}")


class ParquetSource(Source):
    """Samples from Parquet files, read by row group through a small LRU (see the module doc)."""

    def __init__(
        self,
        uri: str,
        root: Path,
        files: dict[str, list[Path]],
        column: str | None,
        label: str | None,
        val_fraction: float,
        classes: int | None,
        cache_mb: float,
        fields: str | None = None,
        max_bytes: int = 0,
        encoded: bool = False,
        location=None,
    ):
        _, pq = _pyarrow()
        self.uri, self.root = uri, root
        #: Where the files are (:class:`~.formats.location.Location`): each batch's reads run under its
        #: ``batch()`` (an object store's deadline); ``None``: local files.
        self.location = location
        self.remote = location is not None and location.kind != "file"
        self._lock, self._read_lock = threading.Lock(), threading.Lock()
        self._cache: OrderedDict[tuple[int, int], ArrowTable] = OrderedDict()
        self.cache_bytes = int(cache_mb * (1 << 20))
        self.files: list[tuple[Path, ParquetFile]] = []
        groups: dict[str, list[tuple[int, int, int]]] = {}  # split → (file number, row group, rows)
        for split, paths in files.items():
            groups[split] = []
            for path in paths:
                try:
                    # a path, or an object store's file (.objstore): a seekable file read by range
                    pf = pq.ParquetFile(path.open("rb") if hasattr(path, "tree") else path)
                except Exception as err:  # pyarrow raises several types for a bad file
                    raise DatasetError(f"{path}: not a readable Parquet file: {err}") from err
                self.files.append((path, pf))
                meta = pf.metadata
                groups[split] += [
                    (len(self.files) - 1, g, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)
                ]
        path0, pf0 = self.files[0]
        schema = pf0.schema_arrow
        #: ``fields=``: (column, how) per field; empty for an x/y dataset.
        self.field_specs = parse_fields(uri, fields) if fields else []
        self._fields = [field_of(uri, schema, c, how, max_bytes) for c, how in self.field_specs]
        self.label = None if fields or encoded else self._label_column(schema.names, label)
        if encoded and not column and "text" in schema.names:
            column = "text"
        self.columns = [c for c, _ in self.field_specs] or self._feature_columns(schema.names, column)
        for path, pf in self.files:
            if missing := [
                c for c in [*self.columns, *([self.label] if self.label else [])] if c not in pf.schema_arrow.names
            ]:
                raise DatasetError(
                    f"{path}: has no column {missing[0]!r}; its columns: {', '.join(pf.schema_arrow.names)}"
                )
        first = next(((f, g) for f, g, n in groups["train"] if n), None)
        if first is None:
            raise DatasetError(f"{uri}: the train files ({', '.join(str(p) for p in files['train'][:3])}) hold no rows")
        if self._fields:
            self.sample_shape, self.dtype, self.num_classes = (0,), np.dtype(np.uint8), classes or 0
            self.kind = "fields"
        elif encoded:  # text for a pipeline's tokenize stage: Encoded samples, no fixed shape
            text_column(uri, schema, self.columns)
            self.sample_shape, self.dtype, self.kind = (), np.dtype(object), "encoded"
        else:
            self.kind_of = _kind(uri, path0, self._group(*first).slice(0, 1), self.columns)
            self.sample_shape, self.dtype = self.kind_of.shape, self.kind_of.dtype
        self._layouts = self._carve(groups, val_fraction)
        self._label_setup(schema, classes)

    # -- columns -----------------------------------------------------------------------------

    def _label_column(self, names: list[str], label: str | None) -> str | None:
        if label is None:
            return next((n for n in LABEL_NAMES if n in names), None)
        if label and label not in names:
            raise DatasetError(f"{self.uri}: no label column {label!r}; the columns are {', '.join(names)}")
        return label or None

    def _feature_columns(self, names: list[str], column: str | None) -> list[str]:
        if column:
            wanted = [c.strip() for c in column.split(",") if c.strip()]
            if missing := [c for c in wanted if c not in names]:
                raise DatasetError(f"{self.uri}: no column {missing[0]!r}; the columns are {', '.join(names)}")
            return wanted
        if found := next((n for n in FEATURE_NAMES if n in names), None):
            return [found]
        rest = [n for n in names if n != self.label]
        if len(rest) != 1:
            raise DatasetError(
                f"{self.uri}: cannot tell which column is the feature among {', '.join(rest)}; "
                "name it with ?column=NAME (or column=a,b,c for numeric columns side by side)"
            )
        return rest

    def _label_setup(self, schema, classes: int | None) -> None:
        pa, _ = _pyarrow()
        if self.label is None:
            self.label_shape, self.label_dtype = (0,), np.dtype(np.int64)
            return
        t = schema.field(self.label).type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
            raise DatasetError(
                f"{self.uri}: label column {self.label!r} is {t}; expected integer class ids "
                "(or numbers); choose another with ?label= or none with label="
            )
        self.label_shape = ()
        self.label_dtype = np.dtype(np.int64) if pa.types.is_integer(t) else np.dtype(t.to_pandas_dtype())
        if self.label_dtype.kind != "i":
            return
        names = _hub_class_names(schema, self.label)
        top = classes or (len(names) if names else self._max_label() + 1)
        self.num_classes = top
        self.class_names = names if names and len(names) == top else [str(i) for i in range(top)]

    def _max_label(self) -> int:
        """The largest label: from each row group's statistics where the file has them, else read."""
        top = -1
        for path, pf in self.files:
            column = pf.schema_arrow.get_field_index(self.label)
            for g in range(pf.metadata.num_row_groups):
                stats = pf.metadata.row_group(g).column(column).statistics
                if stats is not None and stats.has_min_max:
                    lo, hi = int(stats.min), int(stats.max)
                else:
                    ys = pf.read_row_group(g, columns=[self.label]).column(0).to_numpy(zero_copy_only=False)
                    lo, hi = (int(ys.min()), int(ys.max())) if len(ys) else (0, -1)
                if lo < 0:
                    raise DatasetError(f"{path}: label {lo} is negative; class labels are 0..N-1")
                top = max(top, hi)
        return top

    # -- splits and reads ------------------------------------------------------------------------

    def _carve(self, groups: dict, fraction: float) -> dict[str, tuple[list, np.ndarray, int, int]]:
        """split → (row groups, their first rows, first row of the split, rows)."""
        tables = {s: (g, np.cumsum([0] + [n for _, _, n in g])) for s, g in groups.items()}
        out = {s: (g, starts, 0, int(starts[-1])) for s, (g, starts) in tables.items()}
        if "val" not in out:
            g, starts, _, n = out["train"]
            keep = val_carve.tail(self.uri, n, fraction, "train rows")
            out["train"], out["val"] = (g, starts, 0, keep), (g, starts, keep, n - keep)
            self.val_fraction: float | None = fraction
        else:
            self.val_fraction = None
        out.setdefault("test", ([], np.zeros(1, np.int64), 0, 0))
        return out

    def num_samples(self, split: str) -> int:
        return self._layouts[split][3]

    @property
    def fields(self) -> list[Field]:
        return list(self._fields) if self._fields else super().fields

    def read_fields(self, split: str, indices: np.ndarray, epoch: int = 0) -> FieldBatch:
        with self._batch():  # named fields (?fields=): the same per-batch scope
            return read_fields(self, split, indices) if self._fields else super().read_fields(split, indices, epoch)

    def _batch(self):
        return self.location.batch() if self.location is not None else nullcontext()

    def close(self) -> None:
        if self.location is not None:
            self.location.close()

    def info(self) -> SourceInfo:
        info = super().info()
        info.update({"format": "parquet", "path": str(self.root), "columns": self.columns, "label_column": self.label})
        if self.location is not None:
            info.update(self.location.info())  # an object store's: store
        if self.val_fraction is not None:
            info["val_fraction"] = self.val_fraction
        return info

    def _group(self, file: int, group: int):
        """Row group ``group`` of file ``file`` (feature and label columns), through the LRU."""
        key = (file, group)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        path, pf = self.files[file]
        cols = [*self.columns, *([self.label] if self.label else [])]
        try:
            with self._read_lock:  # one reader per file handle: the evaluator reads on its own thread
                table = pf.read_row_group(group, columns=cols)
        except Exception as err:  # several types for a damaged file
            raise DatasetError(f"{path}: cannot read row group {group}: {err}") from err
        with self._lock:
            self._cache[key] = table
            while len(self._cache) > 1 and sum(t.nbytes for t in self._cache.values()) > self.cache_bytes:
                self._cache.popitem(last=False)
        return table

    def locate(self, split: str, indices: np.ndarray) -> list[str]:
        """``FILE row R`` per index: the Parquet file (relative to the dataset's root) and the row in it."""
        groups, starts, first, _ = self._layouts[split]
        rows = np.asarray(indices, np.int64).reshape(-1) + first
        where = np.searchsorted(starts, rows, side="right") - 1
        out = []
        for row, g in zip(rows.tolist(), where.tolist()):
            file, group, _ = groups[g]
            path, pf = self.files[file]
            before = sum(pf.metadata.row_group(k).num_rows for k in range(group))
            out.append(f"{relative_name(str(path), self.root)} row {before + row - int(starts[g])}")
        return out

    def read(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with self._batch():  # texts for a pipeline (?encoded=1): the same per-batch scope
            return read_texts(self, split, indices) if self.kind == "encoded" else super().read(split, indices)

    def read_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        """Samples ``indices`` of ``split``: each row group the batch touches is read once."""
        with self._batch():
            self._read_into(split, indices, x, y)

    def _read_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        if self.kind == "encoded":
            raise DatasetError(f"{self.uri}: encoded=1 serves text for a pipeline's tokenize stage (§9.4)")
        groups, starts, first, n = self._layouts[split]
        idx = np.asarray(indices, np.int64).reshape(-1)
        if not len(idx):
            return
        if idx.min() < 0 or idx.max() >= n:
            raise IndexError(f"index outside {split} (0..{n - 1})")
        rows = idx + first
        where = np.searchsorted(starts, rows, side="right") - 1
        for g in np.unique(where).tolist():
            dest = np.flatnonzero(where == g)
            file, group, _ = groups[g]
            table = self._group(file, group)
            local = rows[dest] - starts[g]
            self._features(table, local, x, dest, file, group)
            if self.label is not None:
                ys = table.column(self.label).take(local).to_numpy(zero_copy_only=False)
                if self.label_dtype.kind == "i" and len(ys) and (ys.min() < 0 or ys.max() >= self.num_classes):
                    bad = ys.min() if ys.min() < 0 else ys.max()
                    raise DatasetError(
                        f"{self.files[file][0]}: label {bad} is outside the {self.num_classes} "
                        f"classes 0..{self.num_classes - 1}"
                    )
                y[dest] = ys

    def _features(self, table, local: np.ndarray, x: np.ndarray, dest: np.ndarray, file: int, group: int) -> None:
        kind, path = self.kind_of, self.files[file][0]
        if kind.name == "columns":
            for j, c in enumerate(kind.columns):
                x[dest, j] = table.column(c).take(local).to_numpy(zero_copy_only=False)
            return
        if kind.name == "list" and self._lists(table, local, x, dest):
            return
        values = table.column(kind.columns[0]).take(local).to_pylist()
        for r, row, value in zip(dest.tolist(), local.tolist(), values):
            what = f"{path} row group {group} row {row}"
            sample = (
                _decode_image(value, what, kind.mode)
                if kind.name == "image"
                else np.asarray(value if value is not None else [], kind.dtype)
            )
            if sample.shape != kind.shape:
                raise DatasetError(
                    f"{what}: column {kind.columns[0]!r} has shape {sample.shape}, the dataset's "
                    f"first row {kind.shape}; every row must have one shape"
                )
            x[r] = sample

    def _lists(self, table, local: np.ndarray, x: np.ndarray, dest: np.ndarray) -> bool:
        """List rows straight from Arrow's flat values, when every row has the dataset's shape and
        no nulls; ``False`` (and nothing written) otherwise, to be read row by row."""
        import pyarrow.compute as pc  # optional: present once a Parquet source has opened

        values = table.column(self.kind_of.columns[0]).take(local).combine_chunks()
        for size in self.kind_of.shape:
            if values.null_count or not pc.all(pc.equal(pc.list_value_length(values), size)).as_py():
                return False
            values = values.flatten()
        if values.null_count or len(values) != len(local) * int(np.prod(self.kind_of.shape)):
            return False
        x[dest] = values.to_numpy(zero_copy_only=False).reshape(len(local), *self.kind_of.shape)
        return True


# -- named fields: ?fields=COL[:HOW],... and ?encoded=1 ---------------------------------------

HOWS = ("auto", "bytes", "image", "grey", "str")


def parse_fields(uri: str, text: str) -> list[tuple[str, str]]:
    """``"a:image,b,c:str"`` → ``[("a", "image"), ("b", "auto"), ("c", "str")]``."""
    out = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        column, _, how = piece.partition(":")
        how = how.strip() or "auto"
        if how not in HOWS:
            raise DatasetError(f"{uri}: fields: {piece!r}: expected COLUMN or COLUMN:{'|'.join(HOWS[1:])}")
        out.append((column.strip(), how))
    if not out or len({c for c, _ in out}) != len(out):
        raise DatasetError(f"{uri}: fields= must name each column once, e.g. fields=image:image,text,label")
    return out


def field_of(uri: str, schema, column: str, how: str, max_bytes: int) -> Field:
    """The field column ``column`` of ``schema`` becomes. Raises :class:`DatasetError`."""
    import pyarrow as pa  # present: the Parquet source imported it

    if column not in schema.names:
        raise DatasetError(f"{uri}: no column {column!r}; the columns are {', '.join(schema.names)}")
    t = schema.field(column).type
    binary = pa.types.is_binary(t) or pa.types.is_large_binary(t)
    if (pa.types.is_struct(t) and t.get_field_index("bytes") >= 0) or binary:
        if how in ("image", "grey"):
            return Field(column, "uint8", (None, None, 3 if how == "image" else 1), max_bytes)
        if how in ("auto", "bytes"):
            return Field(column, "bytes", (), max_bytes)
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        if how in ("auto", "str"):
            return Field(column, "str", (), max_bytes)
    elif how == "auto" and (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        return Field(column, np.dtype(t.to_pandas_dtype()).name, ())
    elif how == "auto" and (pa.types.is_list(t) or pa.types.is_large_list(t)):
        inner = t.value_type
        if pa.types.is_integer(inner) or pa.types.is_floating(inner):
            return Field(column, np.dtype(inner.to_pandas_dtype()).name, (None,), max_bytes)
    raise DatasetError(f"{uri}: column {column!r} is {t}; it cannot be served as {how!r}")


def _image(blob, where: str, mode: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError  # optional: image columns only

    if isinstance(blob, dict):
        blob = blob.get("bytes")
    if not blob:
        raise DatasetError(f"{where}: the image has no bytes (only a path?); store the image bytes in the file")
    try:
        with Image.open(io.BytesIO(blob)) as img:
            a = np.asarray(img.convert(mode), np.uint8)
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise DatasetError(f"{where}: not a readable image: {err}") from err
    return a[:, :, None] if a.ndim == 2 else a


def read_column(table, local: np.ndarray, field: Field, how: str, where: str) -> list | np.ndarray:
    """Rows ``local`` of one column of a row group as the field's values."""
    column = table.column(field.name).take(local)
    if not field.variable:
        return column.to_numpy(zero_copy_only=False).astype(field.np_dtype, copy=False)
    values = column.to_pylist()
    if field.dtype == "bytes":
        return [(v.get("bytes") if isinstance(v, dict) else v) or b"" for v in values]
    if field.dtype == "str":
        return [v or "" for v in values]
    if how in ("image", "grey"):
        mode = "RGB" if how == "image" else "L"
        return [_image(v, f"{where} row {r}", mode) for r, v in zip(local.tolist(), values)]
    return [np.asarray(v if v is not None else [], field.np_dtype) for v in values]


def text_column(uri: str, schema, columns: list[str]) -> None:
    """Refuse anything but one string column for ``encoded=1``. Raises :class:`DatasetError`."""
    if len(columns) != 1:
        raise DatasetError(f"{uri}: encoded=1 serves one text column; column= names {', '.join(columns)}")
    field = field_of(uri, schema, columns[0], "auto", 0)
    if field.dtype != "str":
        raise DatasetError(
            f"{uri}: encoded=1 serves text, and column {columns[0]!r} is {schema.field(columns[0]).type}; "
            "name a string column with ?column="
        )


def read_texts(source, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``encoded=1``: rows ``indices`` of ``split`` as :class:`Encoded` samples with ``text`` set (a null
    row is the empty text), and no labels."""
    column = source.columns[0]
    batch = _read(source, split, indices, [(Field(column, "str", ()), "str")])
    x = np.empty(len(batch[column]), object)
    x[:] = [Encoded(None, -1, f"{source.uri} {split}[{int(i)}]", t) for i, t in zip(indices, batch[column])]
    return x, np.empty((len(x), 0), np.int64)


def read_fields(source, split: str, indices: np.ndarray) -> FieldBatch:
    """Samples ``indices`` of ``split`` of a Parquet source in fields mode: each row group once."""
    return _read(source, split, indices, list(zip(source.fields, (how for _, how in source.field_specs))))


def _read(source, split: str, indices: np.ndarray, specs: list[tuple[Field, str]]) -> FieldBatch:
    groups, starts, first, n = source._layouts[split]
    idx = np.asarray(indices, np.int64).reshape(-1)
    if len(idx) and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(f"index outside {split} (0..{n - 1})")
    rows = idx + first
    where = np.searchsorted(starts, rows, side="right") - 1
    parts: dict[str, list] = {f.name: [None] * len(idx) for f, _ in specs}
    for g in np.unique(where).tolist():
        dest = np.flatnonzero(where == g)
        file, group, _ = groups[g]
        table = source._group(file, group)
        what = f"{source.files[file][0]} row group {group}"
        for field, how in specs:
            values = read_column(table, rows[dest] - starts[g], field, how, what)
            for r, v in zip(dest.tolist(), values):
                parts[field.name][r] = v
    out: FieldBatch = {}
    for field, _ in specs:
        out[field.name] = np.array(parts[field.name], field.np_dtype) if not field.variable else parts[field.name]
    return out


def _hub_class_names(schema, label: str) -> list[str]:
    """Class names a dataset hub stored in the file's metadata (a ClassLabel feature), if any."""
    meta = (schema.metadata or {}).get(b"huggingface")
    if not meta:
        return []
    try:
        feature = json.loads(meta)["info"]["features"][label]
    except (ValueError, KeyError, TypeError):
        return []
    names = feature.get("names") if isinstance(feature, dict) else None
    return names if isinstance(names, list) and all(isinstance(n, str) for n in names) else []


def open_parquet(req: OpenRequest) -> ParquetSource:
    """``parquet://DIR``: the Parquet dataset under ``DIR`` (:func:`open_parquet_dir`)."""
    return open_parquet_dir(req.uri, local_path(req.parts), req.params)


def open_parquet_dir(uri: str, root: Path, params: dict, location=None) -> ParquetSource:
    """The Parquet dataset under ``root`` (``location``'s root, when given), popping the ``params`` it
    knows (see the module doc).

    Raises :class:`DatasetError` naming the file, column or parameter at fault.
    """
    if not root.is_dir():
        raise DatasetError(f"{uri}: {root} {'is not a directory' if root.exists() else 'does not exist'}")
    got = {k: params.pop(k) for k in PARAMS if k in params}

    def number(key: str, kind, default, ok, want: str):
        if key not in got:
            return default
        try:
            value = kind(got[key])
        except ValueError:
            raise DatasetError(f"{uri}: {key} must be {want}, got {got[key]!r}") from None
        if not ok(value):
            raise DatasetError(f"{uri}: {key} must be {want}, got {got[key]!r}")
        return value

    fraction = number("val_fraction", float, 0.1, lambda v: 0 <= v < 1, "a number in [0, 1)")
    classes = number("classes", int, None, lambda v: v >= 1, "an integer of at least 1")
    cache_mb = number("cache_mb", float, 256.0, lambda v: v > 0, "a positive number (MiB)")
    max_bytes = number("max_bytes", int, 0, lambda v: v >= 0, "a byte count")
    encoded = bool(number("encoded", int, 0, lambda v: v in (0, 1), "0 or 1"))
    if encoded and ("fields" in got or got.get("label")):
        raise DatasetError(f"{uri}: encoded=1 serves one text column, without fields= or label=")
    files = find_files(uri, root, got.get("subset"))
    return ParquetSource(
        uri,
        root,
        files,
        got.get("column"),
        got.get("label"),
        fraction,
        classes,
        cache_mb,
        got.get("fields"),
        max_bytes,
        encoded,
        location,
    )


def open_location(loc: Location) -> ParquetSource:
    """The Parquet dataset at ``loc`` (a local directory or an object-store prefix)."""
    return open_parquet_dir(loc.uri, loc.root, loc.params, loc)


#: This layout's line in the registry (:mod:`..layouts`).
FORMAT = Format("parquet", lambda loc: detect(loc.root), open_location, EXPECTED, "source", ("file", "object"))

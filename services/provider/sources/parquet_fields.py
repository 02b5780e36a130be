"""Parquet columns as named fields: ``parquet://DIR?fields=COL[:HOW],...`` (part of :mod:`.parquet`).

Each listed column becomes a field of the same name; ``HOW`` says what it becomes:

- a binary column, or a dataset hub's image struct (``{bytes, path}``): ``bytes`` (the default:
  the encoded file, one byte string per sample), or ``image`` (decoded with Pillow to ``uint8``
  ``(?, ?, 3)``, height × width × RGB, any size per row) or ``grey`` (``(?, ?, 1)``);
- a string column: ``str`` (text, one per sample);
- a column of numbers: a fixed field of shape ``()``; a column of lists of numbers: ``(?,)``.

``max_bytes=`` declares the most bytes one sample of a variable field holds (decoded bytes for an
image): with it, a same-host trainer gets batches through shared memory; without, over the socket.

``?encoded=1`` (not a field): one string column served as text samples (:class:`Encoded`, as a
``train.txt`` line is) for a pipeline's ``tokenize`` stage.
"""

from __future__ import annotations

import io

import numpy as np

from libbus.errors import DatasetError

from .base import Field, FieldBatch
from .formats.imagefolder import Encoded

__all__ = ["HOWS", "field_of", "parse_fields", "read_column", "read_texts", "text_column"]

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

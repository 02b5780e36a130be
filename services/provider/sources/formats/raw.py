"""Raw little-endian arrays described by ``dataset.toml``, one table per split::

    format = "raw"
    class_names = ["cat", "dog"]     # optional
    [train]
    x = "train.f32"                  # samples, back to back, no header
    dtype = "float32"
    shape = [3, 64, 64]              # one sample's shape
    y = "train.labels"               # optional: no y, no labels
    label_dtype = "uint8"            # default int64
    label_shape = []                 # default: one class id per sample
    [test]
    ...

The sample count is the file's size over the sample's; it must be whole, and the label file must
hold as many labels.
"""

from __future__ import annotations

import math

import numpy as np

from libbus.errors import DatasetError

from .dataset import Context, Layout, Table
from .location import Format

__all__ = ["FORMAT", "TABLE_KEYS", "detect", "open_raw"]

TABLE_KEYS = {"x", "dtype", "shape", "y", "label_dtype", "label_shape"}
EXPECTED = 'a dataset.toml with format = "raw" and a [train] table'


def detect(toml: dict) -> bool:
    """Whether ``dataset.toml`` describes raw arrays."""
    return isinstance(toml.get("train"), dict)


def _dtype(value, where: str) -> np.dtype:
    try:
        dtype = np.dtype(value)
    except TypeError as err:
        raise DatasetError(f"{where}: {value!r} is not a NumPy dtype (e.g. float32, uint8)") from err
    if dtype.hasobject or dtype.kind not in "biuf":
        raise DatasetError(f"{where}: {dtype} is not a plain number type")
    return dtype.newbyteorder("<")


def _shape(value, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and v > 0 for v in value):
        raise DatasetError(f"{where}: expected a list of positive integers, got {value!r}")
    return tuple(value)


def open_raw(ctx: Context) -> Layout:
    """The raw tables ``dataset.toml`` describes; raises :class:`DatasetError` for a missing key, a
    file that is not whole samples, or a label file of another length."""
    toml_path = ctx.root / "dataset.toml"
    tables, kinds = {}, set()
    for split in ("train", "val", "test"):
        spec = ctx.toml.get(split)
        if spec is None:
            continue
        where = f"{toml_path} [{split}]"
        if (
            not isinstance(spec, dict)
            or not {"x", "dtype", "shape"} <= spec.keys()
            or not all(isinstance(spec.get(k, ""), str) for k in ("x", "y"))
        ):
            raise DatasetError(f"{where}: needs x (a file name), dtype and shape; y (a file name) is optional")
        if unknown := spec.keys() - TABLE_KEYS:
            raise DatasetError(
                f"{where}: unknown key(s) {', '.join(sorted(unknown))}; expected {', '.join(sorted(TABLE_KEYS))}"
            )
        xdt, shape = _dtype(spec["dtype"], f"{where} dtype"), _shape(spec["shape"], f"{where} shape")
        xseg = ctx.segment(ctx.root / spec["x"])
        xbytes = math.prod(shape) * xdt.itemsize
        if xseg.length % xbytes:
            raise DatasetError(
                f"{xseg.name}: {xseg.length} bytes is not a whole number of {xbytes}-byte "
                f"samples ({xdt} {list(shape)}); truncated? ({xseg.length % xbytes} bytes over)"
            )
        n = xseg.length // xbytes
        parts = [Table.single(xseg, n, xbytes, "x")]
        ydt, label_name = None, ""
        label_shape: tuple[int, ...] = ()
        if "y" in spec:
            ydt = _dtype(spec.get("label_dtype", "int64"), f"{where} label_dtype")
            label_shape = _shape(spec.get("label_shape", []), f"{where} label_shape")
            yseg = ctx.segment(ctx.root / spec["y"])
            ybytes = math.prod(label_shape) * ydt.itemsize
            if yseg.length != n * ybytes:
                raise DatasetError(
                    f"{xseg.name} has {n} samples but {yseg.name} has {yseg.length} bytes, "
                    f"{yseg.length / ybytes:g} labels of {ybytes} bytes; expected {n * ybytes}"
                )
            parts.append(Table.single(yseg, n, ybytes, "y"))
            label_name = yseg.name
        kinds.add((xdt, shape, ydt, label_shape))
        if len(kinds) > 1:
            raise DatasetError(f"{where}: dtype or shapes differ from the other splits'")
        tables[split] = Table(n, parts, label_name=label_name)
    return Layout.of_splits("raw", tables, kinds, ctx.settings, f"{toml_path}: no [train] table; expected {EXPECTED}")


#: This layout's line in the registry (:mod:`..layouts`).
FORMAT = Format("raw", lambda loc: detect(loc.toml()), open_raw, EXPECTED)

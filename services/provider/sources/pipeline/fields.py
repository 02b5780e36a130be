"""A pipeline whose source serves named fields (docs/datasets.md §7.6): stages name the field they act on.

With a multi-field source (``mock://fields``, Parquet ``?fields=``, an image folder with ``?fields=``,
a ``weighted://`` mix of those), a chunk carries every field by name (``Chunk.fields``) and each
transform names one with ``field = "image"`` beside ``name`` and ``input``: it sees that field as its
samples, exactly as it sees ``x`` in an x/y pipeline, and every other field passes through untouched.
A field is handed to its first stage in the form that stage works on:

- a ``bytes`` field as encoded samples (``decode`` reads them), a ``str`` field as text (``tokenize``);
- a variable ``uint8 (?, ?, 3)`` (or ``(?, ?, 1)``) image as a decoded image (``resize``, the crops);
- a variable integer ``(?,)`` list as token ids (``pack``);
- a fixed field as the batch array (``normalize``, ``flip``, ``random_crop``, ``cast``, ``to_dtype``…).

At the end each field becomes a field again: fixed samples as they are, decoded images of any size
``uint8 (?, ?, 3)``, token ids of any length ``int64 (?,)``. A stage that replaces a bad sample with
its batch's nearest good one (``decode`` with ``bad = "skip"``) replaces that sample's every field.
``one_hot`` and ``user`` stages read x/y labels and samples, so are refused here; so is a pipeline
that leaves encoded bytes or text undecoded (serve the source itself for that).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from libbus.errors import ConfigError

from ..base import Field, FieldBatch
from ..formats.imagefolder import Encoded
from .stages import Chunk, Spec, Stage

__all__ = ["FieldStage", "FieldsPlan"]

#: Stage types that act on x/y labels or whole samples, not on one named field.
XY_ONLY = {"one_hot": "acts on x/y class labels", "user": "gets x/y samples"}
ENCODED, DECODED, TOKEN_LISTS = "encoded", "decoded", "token_lists"


def _objects(values) -> np.ndarray:
    """A 1-D object array of ``values`` (numpy would make arrays of equal shapes one block)."""
    items = list(values)
    out = np.empty(len(items), object)
    out[:] = items
    return out


def _decoded(arr: np.ndarray):
    from PIL import Image  # the images extra: only a stage that resizes or crops gets here

    img = Image.fromarray(np.ascontiguousarray(arr[:, :, 0] if arr.shape[2] == 1 else arr))
    return img if img.mode == "RGB" else img.convert("RGB")  # grey expanded, as decode does


class FieldsPlan:
    """The fields of a pipeline as it is built: each one's state after the stages so far, and what the
    last stage leaves (:meth:`output`, :meth:`finish`)."""

    def __init__(self, where: str, fields: list[Field], num_classes: int):
        self.where, self.num_classes = where, num_classes
        self.source = {f.name: f for f in fields}
        #: name → the spec a stage left it in; a field no stage acted on is not here.
        self.specs: dict[str, Spec] = {}

    def input_spec(self, stage: str, type_: str, name: str) -> tuple[Spec, Callable | None]:
        """The spec stage ``stage`` sees field ``name`` as, and how a chunk's raw values become it (None:
        the values are already in the form the previous stage left)."""
        if type_ in XY_ONLY:
            raise ConfigError(
                f"stage {stage!r} ({type_}): {XY_ONLY[type_]}; a pipeline of named fields "
                f"({', '.join(self.source)}) passes fields to stages that name one"
            )
        if name not in self.source:
            raise ConfigError(f"stage {stage!r} ({type_}): no field {name!r}; the fields are {', '.join(self.source)}")
        if name in self.specs:
            return self.specs[name], None
        f = self.source[name]
        base = Spec((), np.dtype(object), (), np.dtype(np.int64), self.num_classes, ENCODED)
        if f.dtype == "bytes":
            return base, lambda where, v: _objects(Encoded(b, -1, where(r)) for r, b in enumerate(v))
        if f.dtype == "str":
            return base, lambda where, v: _objects(Encoded(None, -1, where(r), t) for r, t in enumerate(v))
        if f.variable and f.np_dtype == np.uint8 and len(f.shape) == 3 and f.shape[2] in (1, 3):
            return replace(base, kind=DECODED), lambda where, v: _objects(_decoded(a) for a in v)
        if f.variable and f.np_dtype.kind in "iu" and len(f.shape) == 1:  # ids of an unknown vocabulary: pack
            tokens = replace(base, kind=TOKEN_LISTS, num_classes=1 << 32)  # makes uint32 samples
            return tokens, lambda where, v: _objects(np.asarray(a, np.int64) for a in v)
        if f.variable:
            raise ConfigError(
                f"stage {stage!r} ({type_}): field {f.describe()} varies in a way no stage reads; stages take "
                "bytes, str, uint8 (?, ?, 3) images, integer (?,) lists or fixed fields"
            )
        kind = "tokens" if f.np_dtype.kind in "iu" and len(f.shape) == 1 else "image"
        return Spec(f.fixed_shape, f.np_dtype, (), np.dtype(np.int64), self.num_classes, kind), None

    def output(self) -> list[Field]:
        """The pipeline's fields, in the source's order. Raises :class:`ConfigError` for a field left
        as encoded bytes or text by a stage."""
        out = []
        for name, f in self.source.items():
            spec = self.specs.get(name)
            if spec is None:
                out.append(f)
            elif spec.kind == DECODED:
                out.append(Field(name, "uint8", (None, None, 3)))
            elif spec.kind == TOKEN_LISTS:
                out.append(Field(name, "int64", (None,)))
            elif spec.dtype == np.dtype(object):
                raise ConfigError(f"{self.where}: field {name!r} is left as {spec.kind} samples; decode or tokenize it")
            else:
                out.append(Field(name, spec.dtype.name, tuple(spec.sample_shape)))
        return out

    def finish(self, fields: list[Field], parts: list[FieldBatch]) -> FieldBatch:
        """One batch from its chunks' fields (in order), each field as :meth:`output` declares it."""
        out: FieldBatch = {}
        for f in fields:
            kind = self.specs[f.name].kind if f.name in self.specs else None
            values = [v for part in parts for v in part[f.name]] if f.variable else None
            if values is not None:  # a decoded field is a variable one
                out[f.name] = [np.asarray(img, np.uint8) for img in values] if kind == DECODED else values
            elif parts:
                out[f.name] = np.concatenate([np.asarray(part[f.name], f.np_dtype) for part in parts])
            else:
                out[f.name] = np.empty((0, *f.fixed_shape), f.np_dtype)
        return out


class FieldStage:
    """A stage acting on one named field of a chunk; it answers to the name, type, counters and
    control commands of the stage it wraps."""

    def __init__(self, inner: Stage, field: str, convert: Callable | None, where: str):
        self.inner, self.field, self.convert, self.where = inner, field, convert, where

    def __getattr__(self, attr: str):
        return getattr(self.inner, attr)

    def run(self, chunk: Chunk) -> float:
        """The wrapped stage on field ``field`` as ``x``; ``y`` carries row numbers, so that a stage that
        fills a row from another (a bad image skipped) moves that row's every field with it. Returns
        the seconds the wrapped stage took."""
        fields = chunk.fields
        assert fields is not None
        value = fields[self.field]
        if self.convert is not None:
            indices = chunk.indices.tolist()
            value = self.convert(lambda r: f"{self.where} {chunk.split}[{indices[r]}] field {self.field!r}", value)
        n = len(chunk.indices)
        chunk.x, chunk.y = value, np.arange(n)
        took = self.inner.run(chunk)
        rows = chunk.y
        fields[self.field] = chunk.x
        if rows.shape == (n,) and not np.array_equal(rows, np.arange(n)):
            for name, v in fields.items():
                if name != self.field:
                    fields[name] = v[rows] if isinstance(v, np.ndarray) else [v[r] for r in rows.tolist()]
        chunk.x = chunk.y = None
        return took

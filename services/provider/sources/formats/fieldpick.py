"""Which columns of a record format become which fields: ``?fields=``, ``?label=`` and ``?shape=``, one rule
for the formats written for other loaders (TFRecord features, MDS columns).

A format describes its columns as :class:`~libbus.wire.fields.Field`\\ s under their own names (in their
own order), plus those it cannot serve and why. :func:`select` then picks:

- ``?fields=a,b,c``: those columns, in that order (default: every column, in the format's order);
- ``?label=NAME``: an integer column of one value per sample, the class id, served as ``y`` (int64);
- with a label and one other column left, a fixed one of numbers, that column is ``x``: an ``(x, y)``
  dataset, the kind the built-in models train on; ``?shape=1,28,28`` reshapes ``x`` (same size). A column
  of numbers whose shape varies becomes ``x`` of the shape ``?shape=`` declares; a sample of another size
  is refused when read, naming it.

A column the format cannot serve is refused when picked (by name, or by default as every column),
naming it, why, and how to leave it out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from libbus.errors import DatasetError

from ..base import Field, FieldBatch, Source

__all__ = ["PARAMS", "Pick", "PickedSource", "Selection", "classes", "fill", "select"]

#: The URI parameters :func:`select` reads.
PARAMS = ("fields", "label", "shape")


@dataclass(frozen=True)
class Pick:
    """A served field and the column it comes from."""

    field: Field
    column: str


@dataclass
class Selection:
    """What :func:`select` chose: the served fields (``x``/``y`` for an ``(x, y)`` dataset)."""

    picks: list[Pick]
    xy: bool
    label: str | None

    @property
    def fields(self) -> list[Field]:
        return [p.field for p in self.picks]

    @property
    def columns(self) -> frozenset[str]:
        return frozenset(p.column for p in self.picks)


def select(
    uri: str, columns: dict[str, Field], refused: dict[str, str], params: dict[str, str], what: str
) -> Selection:
    """The fields ``params`` pick from ``columns`` (name → field, in the format's order; ``refused``:
    name → why it cannot be served). ``what`` is what the format calls a column (``feature``).
    Raises :class:`DatasetError` naming the column at fault."""
    known = [*columns, *refused]
    listing = ", ".join(f"{n} ({columns[n].describe().split(' ', 1)[1]})" if n in columns else n for n in known)
    label = params.get("label") or None
    wanted = [w.strip() for w in params.get("fields", "").split(",") if w.strip()]
    for name in [*wanted, *([label] if label else [])]:
        if name not in columns and name not in refused:
            raise DatasetError(f"{uri}: no {what} {name!r}; the {what}s: {listing or 'none'}")
    if len(set(wanted)) != len(wanted) or label in wanted:
        raise DatasetError(f"{uri}: fields= and label= must name each {what} once")
    chosen = wanted or [n for n in known if n != label]
    for name in [*chosen, *([label] if label else [])]:
        if name in refused:
            leave = "" if wanted else f"; serve the others with ?fields= (e.g. fields={','.join(columns)})"
            raise DatasetError(f"{uri}: {what} {name!r} {refused[name]}{leave}")
    picks = [Pick(columns[n], n) for n in chosen]
    if label is not None:
        f = columns[label]
        if f.variable or f.shape != () or f.np_dtype.kind not in "iu":
            raise DatasetError(
                f"{uri}: label {label!r} must be an integer {what} of one value per sample; it is {f.describe()}"
            )
    shape = params.get("shape")
    numeric = len(picks) == 1 and not picks[0].field.opaque
    xy = label is not None and numeric and (not picks[0].field.variable or shape is not None)
    if shape is not None and not xy:
        raise DatasetError(f"{uri}: shape= reshapes x: it needs label= and one {what} of numbers besides")
    if xy:
        f = picks[0].field
        dims = f.fixed_shape if not f.variable else ()
        if shape is not None:
            try:
                dims = tuple(int(d) for d in shape.split(","))
            except ValueError:
                raise DatasetError(f"{uri}: shape must be sizes like 1,28,28, got {shape!r}") from None
            if not f.variable and math.prod(dims) != math.prod(f.fixed_shape):
                raise DatasetError(
                    f"{uri}: shape {shape} holds {math.prod(dims)} values; {what} {picks[0].column!r} has "
                    f"{math.prod(f.fixed_shape)} per sample"
                )
        picks = [Pick(Field("x", f.dtype, dims), picks[0].column)]
    if label is not None:
        picks.append(Pick(Field("y", "int64", ()), label))
    if not picks:
        raise DatasetError(f"{uri}: no {what} to serve; the {what}s: {listing or 'none'}")
    return Selection(picks, xy, label)


def classes(uri: str, label: str, lo: int, hi: int, given: str | None) -> int:
    """``num_classes`` for a label whose values span ``lo..hi``: ``?classes=`` (``given``), else ``hi + 1``.
    Raises :class:`DatasetError` for a negative label or one beyond ``classes``."""
    if lo < 0:
        raise DatasetError(f"{uri}: label {label!r} holds {lo}; class ids are 0..N-1")
    try:
        n = int(given) if given else hi + 1
    except ValueError:
        raise DatasetError(f"{uri}: classes must be an integer, got {given!r}") from None
    if n <= hi:
        raise DatasetError(f"{uri}: label {label!r} holds {hi}, beyond classes={n}")
    return n


def fill(pick: Pick, values: list, where) -> list | np.ndarray:
    """A batch of one picked field from its per-sample values (``None``: missing): a fixed field as one
    array (``where(i)`` names sample ``i`` when one does not fit), a variable one as a list."""
    f = pick.field
    if f.dtype in ("bytes", "str"):
        return [v if v is not None else (b"" if f.dtype == "bytes" else "") for v in values]
    if f.variable:
        return [np.asarray(v, f.np_dtype) if v is not None else np.empty(0, f.np_dtype) for v in values]
    shape = f.fixed_shape
    out = np.empty((len(values), *shape), f.np_dtype)
    for i, v in enumerate(values):
        a = np.asarray(v)
        if v is None or a.size != math.prod(shape):
            raise DatasetError(
                f"{where(i)}: {pick.column!r} holds {0 if v is None else a.size} values, not {math.prod(shape)}"
            )
        out[i] = a.reshape(shape)
    return out


class PickedSource(Source):
    """The reads every layout whose fields :func:`select` picks shares (TFRecord, MDS and litData,
    Hugging Face ``save_to_disk``): the layout gives :meth:`_values` (the picked fields of some
    samples, ``x``/``y`` when the selection makes an ``(x, y)`` dataset), this does the rest."""

    uri: str
    xy: bool
    label: str | None

    def _values(self, split: str, indices: np.ndarray) -> FieldBatch:
        raise NotImplementedError

    def check_labels(self, out: FieldBatch, split: str) -> None:
        """:class:`DatasetError` when a label of ``out`` is outside ``0..num_classes - 1``."""
        y = out.get("y")
        if (
            self.label is not None
            and isinstance(y, np.ndarray)
            and len(y)
            and (y.min() < 0 or y.max() >= self.num_classes)
        ):
            raise DatasetError(f"{self.uri}: a label in {split} is outside 0..{self.num_classes - 1}")

    def read_fields(self, split: str, indices: np.ndarray, epoch: int = 0) -> FieldBatch:
        return super().read_fields(split, indices, epoch) if self.xy else self._values(split, indices)

    def read_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        """Samples ``indices`` of an ``(x, y)`` dataset into ``x`` and ``y``."""
        if not self.xy:
            raise DatasetError(f"{self.uri}: named fields {', '.join(f.name for f in self.fields)}: read_fields")
        n = len(indices)
        if x.shape != (n, *self.sample_shape) or y.shape != (n,):
            raise ValueError(f"read_into needs x {(n, *self.sample_shape)} and y {(n,)}, got {x.shape}, {y.shape}")
        got = self._values(split, indices)
        x[...], y[...] = got["x"], got["y"]

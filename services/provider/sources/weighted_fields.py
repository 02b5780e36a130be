"""The named fields of a ``weighted://`` mix (part of :mod:`.weighted`): which fields a mix serves, and
a batch gathered from the rows each source read.

A mix serves its sources' fields when they are *union-compatible*: the same names in the same order,
and for each name the same dtype and the same shape, ``None`` (variable) dimensions in the same
places. A source that disagrees, or an x/y dataset beside named-field ones, is refused when the
mix is opened, naming both sources and the field: a batch never finds out. The mix declares each
variable field's largest ``max_bytes`` (every source's samples fit it; a source that declares none
makes the mix's undeclared, and its batches then travel over the socket).
"""

from __future__ import annotations

import numpy as np

from libbus.errors import DatasetError

from .base import Field, FieldBatch, Source

__all__ = ["gather", "mix_fields"]


def _describe(fields: list[Field]) -> str:
    return ", ".join(f.describe() for f in fields)


def mix_fields(where: str, names: list[str], sources: list[Source]) -> list[Field] | None:
    """The fields every source of the mix serves, or ``None`` when all are x/y datasets (the mix
    checks those as it always has). Raises :class:`DatasetError` naming the first source (after the
    first) that disagrees with the first, and the field."""
    first, name0 = sources[0].fields, names[0]
    for name, src in zip(names[1:], sources[1:]):
        theirs = src.fields
        if src.xy != sources[0].xy:
            xy, named = (name, name0) if src.xy else (name0, name)
            raise DatasetError(
                f"{where}: {xy} is an x/y dataset but {named} has named fields "
                f"({_describe(first if named == name0 else theirs)}); every source of a mix must serve "
                "the same fields"
            )
    if sources[0].xy:
        return None
    for name, src in zip(names[1:], sources[1:]):
        theirs = src.fields
        if [f.name for f in theirs] != [f.name for f in first]:
            raise DatasetError(
                f"{where}: {name} has fields {', '.join(f.name for f in theirs)} but {name0} has "
                f"{', '.join(f.name for f in first)}; every source of a mix must serve the same fields, in order"
            )
        for mine, other in zip(first, theirs):
            if (mine.dtype, mine.shape if not mine.opaque else ()) != (
                other.dtype,
                other.shape if not other.opaque else (),
            ):
                raise DatasetError(
                    f"{where}: {name} has field {other.describe()} but {name0} has {mine.describe()}; "
                    "every source of a mix must agree on each field's dtype and shape"
                )
    out = []
    for i, f in enumerate(first):
        declared = [s.fields[i].max_bytes for s in sources]
        out.append(Field(f.name, f.dtype, f.shape, max(declared) if f.variable and all(declared) else 0))
    return out


def gather(fields: list[Field], n: int, parts: list[tuple[np.ndarray, FieldBatch]]) -> FieldBatch:
    """A batch of ``n`` samples from ``parts``: (the batch rows a source read, what it read)."""
    out: FieldBatch = {}
    for f in fields:
        if f.variable:
            values: list = [None] * n
            for rows, batch in parts:
                for r, v in zip(rows.tolist(), batch[f.name]):
                    values[r] = v
            out[f.name] = values
        else:
            arr = np.empty((n, *f.shape), f.np_dtype)  # type: ignore[type-var]
            for rows, batch in parts:
                arr[rows] = batch[f.name]
            out[f.name] = arr
    return out

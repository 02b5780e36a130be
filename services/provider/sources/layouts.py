"""The only module that lists dataset layouts, and the one routine that opens a layout at any location.

A location (:class:`~.formats.location.Location`: a local directory, the files an HTTP URI names, an
object-store prefix) is built by its scheme's module (:mod:`.files`, :mod:`.http`, :mod:`.objstore`);
:func:`open_layout` then picks the layout — ``?format=``, else ``format`` in ``dataset.toml``, else the
first in :data:`FORMATS` whose ``detect`` finds it there — and serves it:

- an array layout's tables (where each split's bytes are) by a :class:`~.formats.dataset.FileSource`,
  from RAM or streamed with positional reads, with the settings ``dataset.toml`` shares with the URI;
- a layout of encoded samples (images, text) decoded on the provider (:mod:`.images`);
- a layout that is a source of its own (Parquet) as it opens.

Adding a layout is one module (under :mod:`.formats` when it reads files through ``ctx.segment``, as
every array layout does: then it reads at every location) ending in a ``FORMAT`` line, and one line in
:data:`FORMATS`, where its place sets its detection order.
"""

from __future__ import annotations

from libbus.errors import DatasetError

from . import images
from .base import Source
from .formats import (
    cifar,
    hfdisk,
    idx,
    imagefolder,
    litdata,
    mds,
    npy,
    parquet,
    raw,
    textlines,
    tfrecord,
    tokens,
    webdataset,
)
from .formats.dataset import MEMORY_MODES, FileSource
from .formats.dataset_toml import parse_settings
from .formats.location import Format, Location, val_fraction

__all__ = ["FORMATS", "choose", "open_layout", "readable_at"]

#: Every layout, in detection order (first match wins): one line per layout module.
FORMATS: tuple[Format, ...] = (
    parquet.FORMAT,
    tfrecord.FORMAT,
    mds.FORMAT,
    litdata.FORMAT,
    hfdisk.FORMAT,
    imagefolder.FORMAT,
    webdataset.FORMAT,
    textlines.FORMAT,
    raw.FORMAT,
    idx.FORMAT,
    cifar.FORMAT,
    npy.FORMAT,
    tokens.FORMAT,
)


def readable_at(kind: str) -> list[Format]:
    """The formats read at locations of ``kind`` (``file``, ``http``, ``object``), in detection order."""
    return [f for f in FORMATS if kind in f.where]


def open_layout(loc: Location) -> Source:
    """The dataset at ``loc``, popping the URI parameters its layout knows; ``loc`` is closed when
    opening fails (and by the source when it closes).

    Raises :class:`DatasetError` for an unknown layout or one not read at this location, a compressed
    file where reads go by remote ranges, a bad parameter, or a file that is not what its layout needs.
    """
    try:
        fmt = choose(loc)
        if loc.kind != "file" and fmt.compressed and (packed := [n for n in loc.names() if n.endswith(fmt.compressed)]):
            raise DatasetError(
                f"{loc.root}/{packed[0]}: compressed files are not read {loc.label} (each batch reads byte "
                "ranges); store the arrays uncompressed (.npy, IDX without .gz)"
            )
        if fmt.serves == "source":
            return fmt.open(loc)
        if fmt.serves == "samples":
            return images.open_images(loc.req, fmt.open(loc, _val_fraction(loc)), fmt.name)
        return _open_tables(loc, fmt)
    except BaseException:
        loc.close()
        raise


def choose(loc: Location) -> Format:
    """The format ``?format=`` or ``dataset.toml`` names, else the first :data:`FORMATS` detects at ``loc``."""
    here = readable_at(loc.kind)
    name = loc.params.pop("format", None)
    if name is None and "format" in loc.toml():
        name = loc.toml()["format"]
    if name is None:
        for fmt in here:
            if fmt.detect(loc):
                return fmt
        parse_settings(loc.uri, dict(loc.params), loc.toml())  # a bad setting is the likelier fault: say it
        names = loc.names()
        found = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        raise DatasetError(
            f"no known dataset layout in {loc.root}: expected one of "
            f"{'; '.join(f.expected for f in here)}; found {found or 'nothing'}"
        )
    named = next((f for f in FORMATS if f.name == name), None)
    if named is None:
        raise DatasetError(f"{loc.uri}: unknown format {name!r}; expected one of {', '.join(f.name for f in here)}")
    if loc.kind not in named.where:
        raise DatasetError(
            f"{loc.uri}: format {name!r} is not read {loc.label}; expected one of {', '.join(f.name for f in here)}"
        )
    return named


def _val_fraction(loc: Location) -> float:
    return val_fraction(loc.name, loc.params.pop("val_fraction", "0.1"))


def _open_tables(loc: Location, fmt: Format) -> FileSource:
    toml = loc.toml()
    settings = parse_settings(loc.uri, loc.params, toml)
    memory = loc.params.pop("memory", loc.memory)
    if memory not in MEMORY_MODES:
        raise DatasetError(f"{loc.uri}: memory must be one of {', '.join(MEMORY_MODES)}, got {memory!r}")
    ctx = loc.context(settings, toml)
    try:
        layout = fmt.open(ctx)
        return FileSource(loc.uri, loc.root, layout, ctx, memory, settings.get("val_fraction", 0.1))
    except BaseException:
        ctx.close()
        raise

"""Decompress once into a cache file: a compressed IDX file or a deflated ``.npz`` member is
expanded to disk the first time a source opens it and read by position from then on, never held
in RAM. Written to a temporary name and renamed, so a crash never leaves a half file that a later
open would trust; reused while it is newer than what it came from."""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import SupportsRead

from libbus.errors import DatasetError

__all__ = ["cached"]

CHUNK = 1 << 20


def cached(
    src: Path, cache_dir: Path, name: str, open_stream: Callable[[], AbstractContextManager[SupportsRead[bytes]]]
) -> Path:
    """The path of ``cache_dir/name``, filled from ``open_stream()`` unless fresh against ``src``.

    Raises :class:`DatasetError` naming ``src`` when it cannot be decompressed, or the cache
    directory when it cannot be written.
    """
    dest = cache_dir / name
    try:
        if dest.stat().st_mtime_ns >= src.stat().st_mtime_ns:
            return dest
    except FileNotFoundError:
        pass
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=f".{name}.", suffix=".tmp")
    except OSError as err:
        raise DatasetError(
            f"{src}: cannot write its decompressed copy to {cache_dir} ({err.strerror}); "
            "name a writable directory with ?cache=DIR"
        ) from err
    try:
        with os.fdopen(fd, "wb") as out, open_stream() as stream:
            shutil.copyfileobj(stream, out, CHUNK)
        os.replace(tmp, dest)
    except (EOFError, zlib.error, zipfile.BadZipFile, OSError) as err:
        os.unlink(tmp)
        raise DatasetError(f"{src}: cannot decompress it: {err}; the file is damaged or truncated") from err
    return dest

"""``pack = { join = true, keep_mb = 0, index_cache = "DIR" }``: the documents' token counts kept on disk.

The open-time pass of a joining ``pack`` (:mod:`.text_join`) tokenizes the whole corpus at every open;
with ``index_cache`` its result (each split's token counts, 8 bytes a document) is written to
``DIR/pack-<key>.npz`` and read back at the next open instead. The key is a hash of everything the
counts depend on: every stage before ``pack`` (its type and parameters), the size and modification
time of every file under the source's directory (but the cache directory, when it is inside), and of
every file a parameter names (the tokenizer).
A file added, removed or rewritten gives another key, so a stale index is never read; only local
sources (``file://``, ``parquet://``) can be keyed so. A cache file that cannot be read or does not
match the splits' document counts is ignored (logged) and written again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from libbus.errors import ConfigError

from ..base import local_path

__all__ = ["LOCAL_SCHEMES", "cache_path", "load_counts", "save_counts"]

log = logging.getLogger(__name__)

#: Sources whose files the key can list.
LOCAL_SCHEMES = ("file", "parquet")


def _file_stamp(path: Path) -> list:
    st = path.stat()
    return [str(path), st.st_size, st.st_mtime_ns]


def _tree(root: Path, skip: Path) -> list:
    """``[relative path, size, mtime_ns]`` of every file under ``root`` (or ``root`` itself), sorted,
    but those under ``skip`` (the cache directory, which may be inside the dataset's)."""
    if root.is_file():
        return [_file_stamp(root)]
    out = []
    skip = skip.resolve()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if (Path(dirpath) / d).resolve() != skip)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            out.append([str(path.relative_to(root)), *_file_stamp(path)[1:]])
    return out


def cache_path(directory: str, uri: str, stages: list[tuple[str, dict]]) -> Path:
    """``DIR/pack-<key>.npz`` for a source ``uri`` read through ``stages`` (type, parameters).

    Raises :class:`ConfigError` for a source that is not local (its files' changes cannot be seen)."""
    parts = urlsplit(uri)
    if parts.scheme not in LOCAL_SCHEMES:
        raise ConfigError(
            f"index_cache needs a local source ({', '.join(s + '://' for s in LOCAL_SCHEMES)}): the index of "
            f"{parts.scheme}:// files could outlive a change to them; leave index_cache out"
        )
    named = [
        _file_stamp(Path(value))
        for _, config in stages
        for value in config.values()
        if isinstance(value, str) and value and Path(value).is_file()
    ]
    key = json.dumps([stages, named, _tree(local_path(parts), Path(directory))], sort_keys=True, default=str)
    return Path(directory) / f"pack-{hashlib.sha256(key.encode()).hexdigest()[:32]}.npz"


def load_counts(path: Path, documents: dict[str, int]) -> dict[str, np.ndarray] | None:
    """Each split's token counts from ``path``, or None when it is missing or does not fit ``documents``."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            counts = {split: np.asarray(data[split]) for split in documents}
    except Exception as err:  # noqa: BLE001 - any unreadable file (truncated, not npz, a key missing) is rebuilt
        log.warning("pack index cache %s unreadable (%s); building the index again", path, err)
        return None
    for split, n in documents.items():
        c = counts[split]
        if c.dtype != np.int64 or c.shape != (n,) or (n and c.min() < 0):
            log.warning("pack index cache %s does not fit split %s (%d documents); building again", path, split, n)
            return None
    return counts


def save_counts(path: Path, counts: dict[str, np.ndarray]) -> None:
    """Write ``counts`` to ``path`` atomically (a reader never sees half a file); a failure is logged.

    The temporary file is created new (``mkstemp``: never an existing file or a link someone left in a
    shared directory), and the rename replaces a link at ``path`` itself, not what it points to."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **counts)  # type: ignore[arg-type]  # numpy's stub matches **kwds against allow_pickle
        os.replace(tmp, path)
    except OSError as err:
        log.warning("pack index cache %s not written: %s", path, err)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)

"""WebDataset tar shards: a per-shard index of samples (the members sharing a key), built once and cached.

A WebDataset shard is a plain tar file whose members are grouped by key: ``n01/img42.jpg``,
``n01/img42.cls``, ``n01/img42.json`` are one sample, key ``n01/img42`` (the path up to the first dot
of the file name), members ``jpg``, ``cls``, ``json``. Reading a sample by index needs to know where
its members' bytes are: :func:`build_index` walks the tar headers once (the bytes of ``.cls``
members, a few each, are read on the way: they are the labels) and the index is cached as JSON in the
cache directory, keyed by the shard's size and modification time (or ETag, for shards behind HTTP),
and rebuilt when either changes.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from libbus.errors import DatasetError

__all__ = ["INDEX_VERSION", "ShardIndex", "build_index", "load_cached", "sample_key", "save"]

log = logging.getLogger(__name__)

INDEX_VERSION = 1
#: ``.cls`` members bigger than this are not a class id.
MAX_CLS_BYTES = 64


def sample_key(name: str) -> tuple[str, str]:
    """``dir/base.ext.more`` → (``dir/base``, ``ext.more``), WebDataset's grouping rule."""
    head, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), ext.lower()


@dataclass
class ShardIndex:
    """The samples of one shard: keys, each sample's members ``{ext: [offset, size]}`` and class id."""

    version: int
    size: int
    stamp: str  # mtime_ns for a local file, the ETag for a remote one
    keys: list[str] = field(default_factory=list)
    members: list[dict[str, list[int]]] = field(default_factory=list)
    labels: list[int | None] = field(default_factory=list)
    #: Why the tail of the shard was left out (a truncated shard), or "".
    truncated: str = ""

    def to_json(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))


class _Reader(io.RawIOBase):
    """A file-like over ``pread(offset, n)``: what tarfile needs to walk headers without reading data."""

    def __init__(self, pread, size: int):
        self.pread, self.size, self.pos = pread, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), self.size - self.pos))
        if n:
            data = self.pread(self.pos, n)
            buf[: len(data)] = data
            n = len(data)
        self.pos += n
        return n


def build_index(name: str, pread, size: int, stamp: str, buffer: int = 1 << 16) -> ShardIndex:
    """Walk the tar headers of a shard read through ``pread(offset, n) -> bytes``.

    A shard cut short (a member's bytes past the end, a header cut off) is indexed up to its last whole
    sample and ``truncated`` says what was cut; a file that is not a tar at all raises
    :class:`DatasetError` naming it.
    """
    index = ShardIndex(INDEX_VERSION, size, stamp)
    reader = io.BufferedReader(_Reader(pread, size), buffer)
    by_key: dict[str, int] = {}
    try:
        with tarfile.open(fileobj=reader, mode="r:") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                if info.offset_data + info.size > size:
                    index.truncated = f"member {info.name} needs bytes up to {info.offset_data + info.size}"
                    break
                key, ext = sample_key(info.name)
                if not ext:
                    continue
                if key not in by_key:
                    by_key[key] = len(index.keys)
                    index.keys.append(key)
                    index.members.append({})
                    index.labels.append(None)
                row = by_key[key]
                index.members[row][ext] = [info.offset_data, info.size]
                if ext == "cls":
                    index.labels[row] = _class_id(name, key, pread(info.offset_data, min(info.size, MAX_CLS_BYTES + 1)))
    except tarfile.ReadError as err:
        if not index.keys:
            raise DatasetError(f"{name} is not a tar shard ({err})") from None
        index.truncated = f"tar ends early ({err})"
    if index.truncated and index.keys:  # the last sample may be missing members: drop it
        for lst in (index.keys, index.members, index.labels):
            lst.pop()
    return index


def _class_id(shard: str, key: str, data: bytes) -> int:
    try:
        if len(data) > MAX_CLS_BYTES:
            raise ValueError("too long")
        label = int(data.decode().strip())
        if label < 0:
            raise ValueError("negative")
    except (UnicodeDecodeError, ValueError):
        raise DatasetError(f"{shard}: sample {key!r}: .cls must hold a class id (0, 1, …), got {data[:20]!r}") from None
    return label


def load_cached(cached: Path, size: int, stamp: str) -> ShardIndex | None:
    """The index cached at ``cached`` if it was built from a shard of this size and stamp."""
    try:
        data = json.loads(cached.read_text())
        if data.get("version") == INDEX_VERSION and data.get("size") == size and data.get("stamp") == stamp:
            return ShardIndex(**data)
    except (OSError, ValueError, TypeError):
        pass
    return None


def save(index: ShardIndex, cached: Path) -> None:
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        tmp.write_text(index.to_json())
        os.replace(tmp, cached)
    except OSError as err:
        log.warning("cannot cache the shard index at %s: %s", cached, err)

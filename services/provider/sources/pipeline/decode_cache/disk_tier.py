"""The decode cache's disk tier: entries as checked files in one directory, at most ``limit`` bytes, least
recently used removed first (:class:`DiskTier`).

A file is the format's magic, a BLAKE2b digest of the rest, its length, then a JSON header (the key, the
value's kind, dtype or mode and shape, the label's) and the raw bytes of the value and the label. A
file that is truncated, corrupt, of another key or not a regular file is a miss, counted and removed.
Files are named by a digest of their key (:func:`file_name`: keys hold dataset names and paths) and
opened relative to the directory with ``O_NOFOLLOW``; the directory itself must not be a symlink."""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import orjson

from libbus.errors import ConfigError

from .entries import Entry, is_final, is_image, key_text, make_room

__all__ = ["MAGIC", "DiskTier", "DiskTierStats", "file_name"]

log = logging.getLogger(__name__)

#: First bytes of every disk-tier file (format version 1).
MAGIC = b"BBDECODE1\n"
_DIGEST = 32
_SUFFIX = ".dc"


def file_name(key: tuple) -> str:
    """The disk-tier file name of ``key`` (a digest: keys hold dataset names and paths)."""
    return hashlib.blake2b(key_text(key).encode(), digest_size=20).hexdigest() + _SUFFIX


# -- disk-tier encoding --------------------------------------------------------------------------


def _encode(key: tuple, entry: Entry) -> bytes | None:
    """The file bytes for ``entry``, or None for a value the disk tier does not hold."""
    x = entry.x
    if isinstance(x, np.ndarray) and x.dtype.kind in "biuf":
        xhead: dict = {"kind": "array", "dtype": x.dtype.str, "shape": list(x.shape)}
        xbytes = x.tobytes()
    elif is_image(x):
        xhead = {"kind": "image", "mode": x.mode, "size": list(x.size)}
        xbytes = x.tobytes()
    else:
        return None
    y = np.asarray(entry.y)  # not ascontiguousarray: it makes a 0-d label 1-d
    head = orjson.dumps(
        {"key": key_text(key), "x": xhead, "y": {"dtype": y.dtype.str, "shape": list(y.shape)}, "nx": len(xbytes)}
    )
    body = len(head).to_bytes(4, "little") + head + xbytes + y.tobytes()
    digest = hashlib.blake2b(body, digest_size=_DIGEST).digest()
    return MAGIC + digest + len(body).to_bytes(8, "little") + body


class _Corrupt(Exception):
    pass


def _decode(key: tuple, data: bytes) -> Entry:
    """The entry in ``data``; raises :class:`_Corrupt` for anything but an intact file of ``key``."""
    top = len(MAGIC) + _DIGEST + 8
    if len(data) < top or not data.startswith(MAGIC):
        raise _Corrupt("bad magic or truncated header")
    digest = data[len(MAGIC) : len(MAGIC) + _DIGEST]
    size = int.from_bytes(data[top - 8 : top], "little")
    body = data[top:]
    if len(body) != size:
        raise _Corrupt(f"{len(body)} body bytes, header says {size}")
    if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
        raise _Corrupt("digest mismatch")
    try:
        hlen = int.from_bytes(body[:4], "little")
        head = orjson.loads(body[4 : 4 + hlen])
        if head["key"] != key_text(key):
            raise _Corrupt("another sample's file")
        rest = body[4 + hlen :]
        xbytes, ybytes = rest[: head["nx"]], rest[head["nx"] :]
        xh, yh = head["x"], head["y"]
        if xh["kind"] == "array":
            x: Any = np.frombuffer(xbytes, np.dtype(xh["dtype"])).reshape(tuple(xh["shape"])).copy()
        else:
            from PIL import Image

            x = Image.frombytes(xh["mode"], tuple(xh["size"]), xbytes)
        y = np.frombuffer(ybytes, np.dtype(yh["dtype"])).reshape(tuple(yh["shape"])).copy()
    except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as err:
        raise _Corrupt(f"unreadable contents: {err}") from err
    return Entry(x, y)


class DiskTierStats(TypedDict):
    """The decode cache's disk tier (its stats' ``disk``): where, its size and limit, its counters."""

    #: Its directory.
    dir: str
    limit_bytes: int
    bytes: int
    #: Files held, final outputs included.
    entries: int
    final_entries: int
    final_bytes: int
    hits: int
    writes: int
    #: Files found corrupt (dropped).
    corrupt: int
    evictions: int


class DiskTier:
    """Files of entries in one directory, at most ``limit`` bytes, least recently used removed first."""

    def __init__(self, directory: str, limit: int):
        self.path = Path(directory)
        self.limit = limit
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(self.path)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"decode cache directory {self.path} must be a directory, not a symlink")
        self.dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        # file name -> bytes, least recent first: decoded samples, and final outputs (evicted first)
        self.files: OrderedDict[str, int] = OrderedDict()
        self.finals: OrderedDict[str, int] = OrderedDict()
        self.bytes = self.final_bytes = 0
        self.hits = self.writes = self.corrupt = self.evictions = 0
        self.lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        """Remove every cache file (and leftover temporary) in the directory; leave anything else."""
        with self.lock:
            for name in os.listdir(self.dir_fd):
                if name.endswith((_SUFFIX, ".tmp")):
                    try:
                        if stat.S_ISREG(os.lstat(name, dir_fd=self.dir_fd).st_mode):
                            os.unlink(name, dir_fd=self.dir_fd)
                    except FileNotFoundError:
                        pass
            self.files.clear()
            self.finals.clear()
            self.bytes = self.final_bytes = 0

    def get(self, key: tuple) -> Entry | None:
        name = file_name(key)
        files = self.finals if is_final(key) else self.files
        with self.lock:
            if name not in files:
                return None
            files.move_to_end(name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=self.dir_fd)
        except OSError:  # gone, or a symlink put in its place (ELOOP)
            self._forget(name, files, unlink=False)
            return None
        try:
            with os.fdopen(fd, "rb") as fh:
                if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                    raise _Corrupt("not a regular file")
                data = fh.read()
            entry = _decode(key, data)
        except (OSError, _Corrupt) as err:
            log.warning("decode cache: %s/%s is unusable (%s); decoding that sample again", self.path, name, err)
            with self.lock:
                self.corrupt += 1
            self._forget(name, files, unlink=True)
            return None
        with self.lock:
            self.hits += 1
        return entry

    def put(self, key: tuple, entry: Entry) -> None:
        name = file_name(key)
        final = is_final(key)
        files = self.finals if final else self.files
        with self.lock:  # a key's bytes are a function of the key: a file of it already here is kept
            if name in files:
                files.move_to_end(name)
                return
        data = _encode(key, entry)
        if data is None or len(data) > self.limit:
            return
        with self.lock:  # room first: a final file that would evict a decoded one is not written
            fits, evicted = make_room(
                self.files, self.finals, self.bytes, self.final_bytes, self.limit, len(data), final
            )
            victims = self._evicted(evicted)
        self._unlink(victims)
        if not fits:
            return
        tmp = f"{name}.{threading.get_ident()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=self.dir_fd)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except OSError as err:
            log.warning("decode cache: cannot write %s/%s: %s", self.path, name, err)
            try:
                os.unlink(tmp, dir_fd=self.dir_fd)
            except OSError:
                pass
            return
        with self.lock:
            # another thread may have made room meanwhile: evict again until this file fits
            self._forget_locked(name, self.finals if final else self.files)
            fits, evicted = make_room(
                self.files, self.finals, self.bytes, self.final_bytes, self.limit, len(data), final
            )
            victims = self._evicted(evicted)
            if fits:
                (self.finals if final else self.files)[name] = len(data)
                self.bytes += len(data)
                self.final_bytes += len(data) if final else 0
                self.writes += 1
            else:
                victims.append(name)
        self._unlink(victims)

    def _evicted(self, evicted: list) -> list[str]:
        """Account for ``evicted`` (``make_room``'s victims, already out of their dicts); their names."""
        for _, size, final in evicted:
            self.bytes -= size
            self.final_bytes -= size if final else 0
            self.evictions += 1
        return [old for old, _, _ in evicted]

    def _unlink(self, names: list[str]) -> None:
        for old in names:
            try:
                os.unlink(old, dir_fd=self.dir_fd)
            except OSError:
                pass

    def _forget_locked(self, name: str, files: OrderedDict) -> None:
        size = files.pop(name, 0)
        self.bytes -= size
        if files is self.finals:
            self.final_bytes -= size

    def _forget(self, name: str, files: OrderedDict, *, unlink: bool) -> None:
        with self.lock:
            self._forget_locked(name, files)
        if unlink:
            self._unlink([name])

    def stats(self) -> DiskTierStats:
        with self.lock:
            return {
                "dir": str(self.path),
                "limit_bytes": self.limit,
                "bytes": self.bytes,
                "entries": len(self.files) + len(self.finals),
                "final_entries": len(self.finals),
                "final_bytes": self.final_bytes,
                "hits": self.hits,
                "writes": self.writes,
                "corrupt": self.corrupt,
                "evictions": self.evictions,
            }

    def close(self) -> None:
        self.clear()
        os.close(self.dir_fd)

"""A bounded disk cache of object blocks, shared by every provider that names the same directory.

Objects are cached in fixed-size blocks (``block_bytes`` of an object, the last one shorter), one
file each, named by a hash of (store, key, ETag, size, block size, block number): a rewritten
object has a new ETag, so its old blocks are never served, only aged out. A block is checked by its
length when opened (a block of the wrong length is deleted and fetched again).

Safe with several providers on one directory: a block is written to a temporary file and renamed
into place (readers see a whole block or none), and the bookkeeping (the ``usage`` file with the
bytes held, eviction) happens under an exclusive ``flock`` on ``DIR/.lock``. A reader holds the open
file, so a block evicted while it is read stays readable until closed.

LRU: a hit touches the block's mtime; when a put takes the total over ``limit``, the oldest blocks
(by mtime, across every provider's blocks) are deleted until the total is at most 90% of it. The
cache survives restarts: blocks and ``usage`` are plain files; a missing or damaged ``usage`` is
recomputed from the blocks.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TypedDict

from libbus.errors import DatasetError

__all__ = ["BlockCache", "BlockCacheStats", "cache_stats"]

log = logging.getLogger(__name__)

#: After an eviction the cache holds at most this fraction of its limit (fewer scans).
LOW_WATER = 0.9
#: Temporary files older than this are a crashed writer's: removed by the next eviction scan.
STALE_TMP_S = 3600

_CACHES: dict[str, BlockCache] = {}
_CACHES_LOCK = threading.Lock()


class BlockCacheStats(TypedDict):
    """A disk block cache's counters since the start, and its size (:meth:`BlockCache.stats`)."""

    hits: int
    misses: int
    evictions: int
    bytes_hit: int
    bytes_stored: int
    #: The cache's limit (``cache_limit``).
    limit_bytes: int
    #: Bytes it holds now (0 when they cannot be read).
    bytes: int


def cache_stats() -> dict[str, BlockCacheStats]:
    """Every cache this process uses, by directory: hits, misses, evictions, bytes (metrics)."""
    with _CACHES_LOCK:
        return {d: c.stats() for d, c in _CACHES.items()}


class BlockCache:
    """Blocks of objects in ``root``, at most ``limit`` bytes (see the module doc)."""

    @classmethod
    def shared(cls, root: Path, limit: int) -> BlockCache:
        """The process's one cache for ``root`` (its counters shared by the datasets using it)."""
        key = os.path.realpath(root)
        with _CACHES_LOCK:
            cache = _CACHES.get(key)
            if cache is None or cache.limit != limit:
                cache = _CACHES[key] = cls(root, limit)
            return cache

    def __init__(self, root: Path, limit: int):
        if limit <= 0:
            raise DatasetError(f"cache_limit must be positive bytes, got {limit}")
        self.root, self.limit = Path(root), limit
        try:
            (self.root / "blocks").mkdir(parents=True, exist_ok=True)
            (self.root / ".lock").touch(exist_ok=True)
        except OSError as err:
            raise DatasetError(f"cache_dir {root}: cannot create it ({err.strerror})") from err
        self._lock = threading.Lock()
        self.counts = {"hits": 0, "misses": 0, "evictions": 0, "bytes_hit": 0, "bytes_stored": 0}

    @staticmethod
    def block_name(store: str, key: str, etag: str, size: int, block_bytes: int, block: int) -> str:
        ident = "\0".join((store, key, etag, str(size), str(block_bytes)))
        return f"{hashlib.sha256(ident.encode()).hexdigest()[:40]}-{block}"

    def _path(self, name: str) -> Path:
        return self.root / "blocks" / name[:2] / name

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.counts[k] += v

    def stats(self) -> BlockCacheStats:
        with self._lock:
            c = dict(self.counts)
        return {
            "hits": c["hits"],
            "misses": c["misses"],
            "evictions": c["evictions"],
            "bytes_hit": c["bytes_hit"],
            "bytes_stored": c["bytes_stored"],
            "limit_bytes": self.limit,
            "bytes": self._read_usage() or 0,
        }

    # -- reads -------------------------------------------------------------------------------

    def open(self, name: str, length: int) -> int | None:
        """An open descriptor of block ``name`` if it is cached whole (``length`` bytes), else ``None``."""
        path = self._path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._count(misses=1)
            return None
        if os.fstat(fd).st_size != length:  # not what the object's block is: fetch it again
            os.close(fd)
            path.unlink(missing_ok=True)
            self._count(misses=1)
            return None
        try:
            os.utime(fd)  # most recently used
        except OSError:
            pass  # a read-only cache still serves
        self._count(hits=1, bytes_hit=length)
        return fd

    # -- writes ------------------------------------------------------------------------------

    def put(self, name: str, data) -> None:
        """Store block ``name``; evict the least recently used blocks if the cache is then over its limit.
        A block larger than the whole limit is not stored. A full or read-only disk is logged, not fatal."""
        n = len(data)
        if n > self.limit:
            return
        path = self._path(name)
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                with self._locked():
                    if path.exists():  # another provider stored it meanwhile
                        os.unlink(tmp)
                        return
                    os.replace(tmp, path)
                    usage = (self._read_usage() or self._scan_total()) + n
                    if usage > self.limit:
                        usage = self._evict()
                    self._write_usage(usage)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
        except OSError as err:
            log.warning("cache %s: cannot store a block (%s)", self.root, err.strerror)
            return
        self._count(bytes_stored=n)

    @contextmanager
    def _locked(self):
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _read_usage(self) -> int | None:
        try:
            return int((self.root / "usage").read_text())
        except (OSError, ValueError):
            return None

    def _write_usage(self, usage: int) -> None:
        tmp = self.root / f".usage.{os.getpid()}.{threading.get_ident()}"
        tmp.write_text(str(usage))
        os.replace(tmp, self.root / "usage")

    def _blocks(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of every block; stale temporaries removed on the way."""
        out, now = [], time.time()
        for sub in os.scandir(self.root / "blocks"):
            if not sub.is_dir():
                continue
            for e in os.scandir(sub.path):
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                if e.name.startswith("."):
                    if now - st.st_mtime > STALE_TMP_S:
                        os.unlink(e.path)
                    continue
                out.append((st.st_mtime, st.st_size, e.path))
        return out

    def _scan_total(self) -> int:
        return sum(size for _, size, _ in self._blocks())

    def _evict(self) -> int:
        """Delete the oldest blocks until at most LOW_WATER of the limit is held (under the lock)."""
        blocks = sorted(self._blocks())
        total = sum(size for _, size, _ in blocks)
        evicted = 0
        for _, size, path in blocks:
            if total <= self.limit * LOW_WATER:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            total -= size
            evicted += 1
        self._count(evictions=evicted)
        return total

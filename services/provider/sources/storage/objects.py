"""Objects in an object store, read by byte range: the one "object access" interface every
file-backed format reads through when its files live in ``s3://``, ``gs://`` or ``az://``.

An :class:`ObjectBackend` (a client library's store; :mod:`..objstore` builds one with ``obstore``)
does three things: list a prefix, give one object's size and ETag, return a byte range. Everything
a dataset needs on top of that lives here, independent of the library:

- :class:`ObjectTree` / :class:`ObjectPath`: a listed prefix seen as the part of ``pathlib.Path``
  that the format openers use (``/``, ``iterdir``, ``glob``, ``is_file``, ``is_dir``, ``open``), so
  token shards, npy pairs, raw arrays, CIFAR and IDX batches and Parquet files open unchanged; a
  new file-backed format (WebDataset tars, image folders) takes an ``ObjectPath`` the same way;
- :class:`ObjectClient`: the :class:`~.reader.RemoteClient` of those files. A batch's contiguous
  runs are read one request each (runs close together as one), ``concurrency`` at a time per dataset at
  first, more as long as more pays (:mod:`.inflight`, up to ``max_concurrency``), and at most
  ``host_concurrency`` per host across the provider, each copied into its destination (a ring
  slot) as it arrives. A throttled or failed request (429, 503 ``SlowDown``, 5xx, a dropped
  connection) is retried with exponential backoff and full jitter, within the batch's deadline;
  when the deadline or the retries run out the batch fails ``UNAVAILABLE`` naming the object;
- with ``ram_cache``, reads go by whole blocks kept in the provider's RAM (:mod:`.blockmemory`: a full
  shuffle at block speed when it holds the objects), ahead of any disk cache;
- with a :class:`~.blockcache.BlockCache`, reads go by fixed-size blocks of each object through a
  bounded disk cache shared with other providers (see that module).

Every range request carries ``If-Match`` with the ETag seen at open: an object rewritten while it is
served fails the batch ("changed since the dataset was opened") instead of mixing two versions.
"""

from __future__ import annotations

import io
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatch
from functools import partial
from pathlib import PurePosixPath
from typing import Protocol, TypedDict

from libbus.errors import DatasetError

from .blockcache import BlockCache, BlockCacheStats
from .blockmemory import BlockMemory, ReadStats
from .inflight import InflightLimit, host_slots, lower_priority
from .reader import COALESCE_BYTES, coalesce

__all__ = [
    "ObjectBackend",
    "ObjectClient",
    "ObjectError",
    "ObjectMeta",
    "ObjectPath",
    "ObjectSettings",
    "ObjectStoreRow",
    "ObjectStoreStats",
    "ObjectTree",
]

log = logging.getLogger(__name__)

#: Statuses (and S3 error codes) worth another try: the store is busy or failed, not the request.
RETRY_STATUSES = {408, 429, 500, 502, 503, 504}
RETRY_CODES = {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling"}
#: Largest object fetched whole (a dataset.toml).
MAX_SMALL_OBJECT = 16 << 20


@dataclass(frozen=True)
class ObjectMeta:
    """One object: its key in the bucket, its size and its ETag (quotes included, as served)."""

    key: str
    size: int
    etag: str = ""


class ObjectError(DatasetError):
    """A request to the store failed: names the store, the operation and the object, never a credential."""

    def __init__(self, message: str, status: int | None = None, code: str = "", retryable: bool = False):
        super().__init__(message, code="UNAVAILABLE")
        self.status, self.s3_code, self.retryable = status, code, retryable


class ObjectBackend(Protocol):
    """What a client library provides. Methods raise :class:`ObjectError`."""

    #: ``scheme://bucket``: how messages, metrics and cache keys name the store.
    name: str
    #: Where requests go (``host:port``): concurrency is bounded per host.
    host: str

    def list(self, prefix: str) -> list[ObjectMeta]:
        """Every object whose key starts with ``prefix``."""

    def head(self, key: str) -> ObjectMeta:
        """One object's size and ETag."""

    def get_range(self, key: str, start: int, end: int, etag: str) -> memoryview:
        """Bytes ``start`` to ``end`` (exclusive) of ``key``, if its ETag is still ``etag`` (when set)."""


@dataclass(frozen=True)
class ObjectSettings:
    """How an :class:`ObjectClient` treats its store (set from the URI query)."""

    concurrency: int = 16  # requests in flight per dataset at first (inflight.py: it grows with throughput)
    max_concurrency: int = 128  # ... up to this
    host_concurrency: int = 64  # requests in flight per host, all datasets of the provider together
    retries: int = 5  # further tries of a request after the first
    backoff_s: float = 0.1  # retry k waits uniform(0, min(max_backoff_s, backoff_s * 2**k)): full jitter
    max_backoff_s: float = 5.0
    deadline_s: float = 8.0  # a batch's reads, retries included, finish within this or fail (under the
    # trainer's 10 s request timeout, so the trainer hears UNAVAILABLE rather than a timeout)
    block_bytes: int = 4 << 20  # the cache's unit (without a cache: unused)
    coalesce_bytes: int = COALESCE_BYTES  # without a cache: runs of an object at most this far apart, one request
    ram_cache: int = 0  # bytes of whole blocks (block_bytes) kept in RAM (blockmemory.py); 0: none


class ObjectStoreStats(TypedDict):
    """The process's object-store requests since the start (:data:`STATS`), and its disk caches by directory
    (a provider's stats' ``object_store``)."""

    requests: int
    retries: int
    failures: int
    bytes_fetched: int
    caches: dict[str, BlockCacheStats]


class ObjectStoreRow(TypedDict, total=False):
    """What object stores add to a provider's stats: ``object_store``, when it serves a dataset in one."""

    object_store: ObjectStoreStats


#: Process-wide request counters (metrics, ``busctl queues``): requests, retries, failures, bytes.
STATS = {"requests": 0, "retries": 0, "failures": 0, "bytes_fetched": 0}
STATS_LOCK = threading.Lock()


def _count(**deltas: int) -> None:
    with STATS_LOCK:
        for k, v in deltas.items():
            STATS[k] += v


class ObjectClient:
    """Ranged reads of one store's objects for one dataset (see the module doc)."""

    def __init__(self, backend: ObjectBackend, settings: ObjectSettings, cache: BlockCache | None = None):
        self.backend, self.settings, self.cache = backend, settings, cache
        self._host = host_slots(backend.host, settings.host_concurrency)
        #: Requests of this dataset in flight: from ``concurrency`` up to ``max_concurrency`` as throughput grows.
        self.inflight = InflightLimit(settings.concurrency, settings.max_concurrency)
        self._pool = ThreadPoolExecutor(
            settings.max_concurrency, thread_name_prefix="objstore", initializer=lower_priority
        )
        #: Whole blocks of the dataset's objects in RAM (``ram_cache``; before the disk cache), or None.
        self.memory = BlockMemory(settings.ram_cache, settings.block_bytes) if settings.ram_cache else None
        self._local = threading.local()
        weakref.finalize(self, self._pool.shutdown, wait=False)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def read_stats(self) -> ReadStats:
        """Requests in flight and their limit now, and the RAM cache's counters (when it has one)."""
        out: ReadStats = {"inflight": self.inflight.inflight, "inflight_limit": self.inflight.limit}
        return {**out, **self.memory.stats()} if self.memory is not None else out

    # -- the batch's deadline ----------------------------------------------------------------

    @contextmanager
    def batch(self) -> Iterator[None]:
        """This thread's batch: the reads inside share one deadline, ``deadline_s`` from its start."""
        self._local.deadline = time.monotonic() + self.settings.deadline_s
        try:
            yield
        finally:
            self._local.deadline = None

    def _deadline(self) -> float:
        return getattr(self._local, "deadline", None) or time.monotonic() + self.settings.deadline_s

    # -- requests ----------------------------------------------------------------------------

    def fetch(self, obj: ObjectMeta, start: int, length: int, deadline: float | None = None) -> memoryview:
        """Bytes ``start`` .. ``start + length`` of ``obj``: one request, retried (see the module doc)."""
        deadline = deadline or self._deadline()
        s, where = self.settings, f"{self.backend.name}/{obj.key} (bytes {start}-{start + length - 1})"
        for attempt in range(s.retries + 1):
            try:
                data = self._get(obj, start, length, deadline, where)
                if len(data) != length:
                    raise ObjectError(f"GET {where}: got {len(data)} bytes; the object is shorter than when opened")
                _count(bytes_fetched=length)
                return data
            except ObjectError as err:
                wait_s = random.uniform(0, min(s.max_backoff_s, s.backoff_s * 2**attempt))
                left = deadline - time.monotonic()
                if not err.retryable or attempt == s.retries or left <= wait_s:
                    _count(failures=1)
                    why = (
                        ""
                        if not err.retryable
                        else f" (gave up after {attempt + 1} attempts"
                        + (f", the batch's {s.deadline_s:g} s deadline)" if left <= wait_s else ")")
                    )
                    raise ObjectError(f"{err}{why}", err.status, err.s3_code) from None
                _count(retries=1)
                log.warning("%s; retrying in %.2f s", err, wait_s)
                time.sleep(wait_s)
        raise AssertionError("unreachable")  # pragma: no cover

    def _get(self, obj: ObjectMeta, start: int, length: int, deadline: float, where: str) -> memoryview:
        """One request, within the dataset's limit and the host's."""
        s = self.settings
        if not self.inflight.acquire(max(0.0, deadline - time.monotonic()), due=deadline):
            raise ObjectError(
                f"GET {where}: no request slot free within the batch's {s.deadline_s:g} s deadline "
                f"({self.inflight.limit} of this dataset in flight)"
            )
        got, throttled = 0, False
        try:
            if not self._host.acquire(timeout=max(0.0, deadline - time.monotonic()), due=deadline):
                raise ObjectError(
                    f"GET {where}: no request slot free for {self.backend.host} within the batch's "
                    f"{s.deadline_s:g} s deadline ({s.host_concurrency} in flight from this provider)"
                )
            try:
                _count(requests=1)
                data = self.backend.get_range(obj.key, start, start + length, obj.etag)
                got = len(data)
                return data
            finally:
                self._host.release()
        except ObjectError as err:
            throttled = err.status in (429, 503) or err.s3_code in ("SlowDown", "Throttling")
            raise
        finally:
            self.inflight.release(got, throttled)

    def get_small(self, obj: ObjectMeta) -> bytes:
        """A whole small object (a ``dataset.toml``)."""
        if obj.size > MAX_SMALL_OBJECT:
            raise ObjectError(f"{self.backend.name}/{obj.key}: larger than {MAX_SMALL_OBJECT} bytes")
        return bytes(self.fetch(obj, 0, obj.size)) if obj.size else b""

    def read_ranges(self, ranges: list[tuple[ObjectMeta, int, int]]) -> list[bytes]:
        """The bytes of each ``(object, offset, length)`` (whole images, a shard's coalesced members):
        one batch of :meth:`read_runs`, so bounded, retried, cached and under one deadline."""
        out = [bytearray(n) for _, _, n in ranges]
        self.read_runs([(ObjectFile(self, m), at, [memoryview(b)]) for (m, at, _), b in zip(ranges, out) if len(b)])
        return [bytes(b) for b in out]

    # -- a batch's runs ----------------------------------------------------------------------

    def read_runs(self, runs: list[tuple[ObjectFile, int, list[memoryview]]]) -> None:
        """Fill each run's buffers from its object (:class:`~.reader.RemoteClient`). Waits for every
        request before returning or raising, so nothing writes into a buffer after a failed batch."""
        deadline = self._deadline()
        tasks: list[Callable[[], None]]
        if self.memory is not None:
            self.memory.read(
                runs,
                lambda f: (f.meta.key, f.meta.etag, f.meta.size),
                lambda f: f.meta.size,
                lambda f, start, length: self.fetch(f.meta, start, length, deadline),
                self._pool,
            )
            return
        if self.cache is None:
            pieces = coalesce(runs, self.settings.coalesce_bytes)
            tasks = [partial(self._read_run, f, o, b, deadline) for f, o, b in pieces]
        else:
            blocks = _by_block(runs, self.settings.block_bytes)
            tasks = [partial(self._serve_block, self.cache, k[0], k[1], p, deadline) for k, p in blocks.items()]
        if len(tasks) == 1:
            tasks[0]()
            return
        futures = [self._pool.submit(t) for t in tasks]
        wait(futures)
        for fut in futures:
            if (err := fut.exception()) is not None:
                raise err

    def read_ahead(self, owner: object, blocks: list[tuple[ObjectFile, int]]) -> int:
        """Fetch ``blocks`` into the RAM cache ahead of their reads, replacing ``owner``'s last plan
        (:meth:`~.blockmemory.BlockMemory.prefetch`; as many at once as the dataset's requests in flight), each
        fetch under a deadline of its own."""
        if self.memory is None:
            return 0
        return self.memory.prefetch(
            owner,
            blocks,
            lambda f: (f.meta.key, f.meta.etag, f.meta.size),
            lambda f: f.meta.size,
            lambda f, start, length: self.fetch(f.meta, start, length, time.monotonic() + self.settings.deadline_s),
            self._pool,
            max(1, self.inflight.limit),
        )

    def _read_run(self, f: ObjectFile, offset: int, buffers: list[memoryview], deadline: float) -> None:
        nbytes = sum(len(b) for b in buffers)
        if not nbytes:
            return
        data = self.fetch(f.meta, offset, nbytes, deadline)
        at = 0
        for buf in buffers:
            view = buf.cast("B") if buf.format != "B" else buf
            view[:] = data[at : at + len(view)]
            at += len(view)

    def _serve_block(
        self, cache: BlockCache, f: ObjectFile, block: int, pieces: list[tuple[int, memoryview]], deadline: float
    ) -> None:
        size = self.settings.block_bytes
        length = min(size, f.meta.size - block * size)
        name = cache.block_name(self.backend.name, f.meta.key, f.meta.etag, f.meta.size, size, block)
        fd = cache.open(name, length)
        if fd is not None:
            try:
                for at, buf in pieces:
                    _pread_exact(fd, buf, at, name)
            finally:
                os.close(fd)
            return
        data = self.fetch(f.meta, block * size, length, deadline)
        for at, buf in pieces:
            view = buf.cast("B") if buf.format != "B" else buf
            view[:] = data[at : at + len(view)]
        cache.put(name, data)


def _pread_exact(fd: int, buf: memoryview, at: int, name: str) -> None:
    view = buf.cast("B") if buf.format != "B" else buf
    while len(view):
        n = os.preadv(fd, [view], at)
        if not n:
            raise DatasetError(f"cache block {name}: shorter than it was when checked")
        view, at = view[n:], at + n


def _by_block(runs, block: int) -> dict[tuple[ObjectFile, int], list[tuple[int, memoryview]]]:
    """The runs' buffers cut at block boundaries: (file, block number) → (offset in block, piece)."""
    out: dict[tuple[ObjectFile, int], list[tuple[int, memoryview]]] = {}
    for f, offset, buffers in runs:
        pos = offset
        for buf in buffers:
            while len(buf):
                b = pos // block
                n = min(len(buf), (b + 1) * block - pos)
                out.setdefault((f, b), []).append((pos - b * block, buf[:n]))
                buf, pos = buf[n:], pos + n
    return out


@dataclass(frozen=True, eq=False)
class ObjectFile:
    """One object read through its dataset's client (a :class:`~.reader.Remote`)."""

    client: ObjectClient
    meta: ObjectMeta


class ObjectTree:
    """The objects under a prefix, listed once at open."""

    def __init__(self, client: ObjectClient, prefix: str, objects: list[ObjectMeta]):
        self.client, self.prefix = client, prefix.strip("/")
        cut = len(self.prefix) + 1 if self.prefix else 0
        self.files = {o.key[cut:]: o for o in objects if not o.key.endswith("/")}
        self.root = ObjectPath(self, "")

    def url(self, rel: str) -> str:
        return f"{self.client.backend.name}/{'/'.join(p for p in (self.prefix, rel) if p)}"


class ObjectPath:
    """A file or folder of an :class:`ObjectTree`: the part of ``pathlib.Path`` that format openers use."""

    def __init__(self, tree: ObjectTree, rel: str):
        self.tree, self.rel = tree, rel.strip("/")

    @property
    def name(self) -> str:
        return self.rel.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        dot = self.name.rfind(".")
        return self.name[dot:] if dot > 0 else ""

    @property
    def stem(self) -> str:
        return self.name[: -len(self.suffix)] if self.suffix else self.name

    @property
    def meta(self) -> ObjectMeta:
        if self.rel not in self.tree.files:
            raise DatasetError(f"{self}: no such object")
        return self.tree.files[self.rel]

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(self.tree, f"{self.rel}/{name}" if self.rel else name)

    def is_file(self) -> bool:
        return self.rel in self.tree.files

    def is_dir(self) -> bool:
        head = f"{self.rel}/" if self.rel else ""
        return any(k.startswith(head) for k in self.tree.files)

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def iterdir(self):
        head = f"{self.rel}/" if self.rel else ""
        names = {k[len(head) :].split("/", 1)[0] for k in self.tree.files if k.startswith(head)}
        return iter([self / n for n in sorted(names)])

    def glob(self, pattern: str):
        return (p for p in self.iterdir() if fnmatch(p.name, pattern))

    def files_below(self) -> list[ObjectPath]:
        """Every object under this folder, at any depth (what ``os.walk`` finds in a directory)."""
        head = f"{self.rel}/" if self.rel else ""
        return [ObjectPath(self.tree, k) for k in self.tree.files if k.startswith(head)]

    def relative_to(self, other: ObjectPath) -> PurePosixPath:
        return PurePosixPath(self.rel).relative_to(other.rel or ".")

    def open(self, mode: str = "rb") -> ObjectReader:
        """A seekable binary file over the object (what pyarrow reads Parquet through)."""
        if mode != "rb":
            raise ValueError("objects are opened read-only, 'rb'")
        return ObjectReader(ObjectFile(self.tree.client, self.meta), str(self))

    def read_bytes(self) -> bytes:
        return self.tree.client.get_small(self.meta)

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def __lt__(self, other: ObjectPath) -> bool:
        return self.rel.split("/") < other.rel.split("/")  # by parts, as pathlib sorts

    def __eq__(self, other) -> bool:
        return isinstance(other, ObjectPath) and other.tree is self.tree and other.rel == self.rel

    def __hash__(self) -> int:
        return hash(self.rel)

    def __str__(self) -> str:
        return self.tree.url(self.rel)

    __repr__ = __str__


class ObjectReader(io.RawIOBase):
    """A read-only, seekable file over one object; every read is one ranged read (or cached blocks)."""

    def __init__(self, f: ObjectFile, name: str):
        super().__init__()
        self.f, self.name, self.pos = f, name, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.f.meta.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def size(self) -> int:
        return self.f.meta.size

    def readinto(self, buf) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self.f.meta.size - self.pos))
        if n:
            self.f.client.read_runs([(self.f, self.pos, [view[:n]])])
        self.pos += n
        return n

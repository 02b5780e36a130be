"""Files behind HTTP(S), read by byte range: the :class:`~.reader.Remote` of ``http(s)://`` sources.

A :class:`RangeClient` serves one dataset. Its range reads go through obstore, off the GIL
(:mod:`.httpstore`: one ``HTTPStore`` per origin, hosts outside the dataset's origins unreachable);
``concurrency`` requests are in flight at first, more while more pays (:mod:`.inflight`: up to
``max_concurrency`` for the dataset, ``host_concurrency`` for the host), so the runs of every batch in
flight are fetched side by side without flooding the endpoint. Every request has a timeout and is retried a
bounded number of times with exponential backoff when the connection drops, times out, comes back short,
or the server answers 408, 429 or 5xx; other statuses fail at once. A request that does not deliver
exactly the bytes asked for fails the whole batch, so a batch is served whole or not at all.

``http.client`` (one keep-alive connection per host and thread, bodies read straight into the batch's
buffers) stays for what obstore cannot do as this module must: the requests made when the dataset opens
(HEAD for sizes and versions, with a one-byte GET where HEAD is refused; a manifest or ``dataset.toml``),
which follow each redirect hop by hop, at most :data:`MAX_REDIRECTS`, checking every hop against the
dataset's origins; range reads of URLs obstore would not request as written (a query string, as a
pre-signed URL has, or percent-encoding); every read of an ``https://`` dataset given its own CA file
(``ca``: it replaces the system's CAs, as OpenSSL reads it); and every read when obstore is not installed.
"""

from __future__ import annotations

import http.client
import logging
import re
import select
import ssl
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from urllib.parse import urljoin, urlsplit

from libbus.errors import DatasetError

from .blockmemory import BLOCK_BYTES, BlockMemory, ReadStats
from .httpstore import PARALLEL, ObstoreRanges, RangeFailure
from .inflight import InflightLimit, Slots, host_slots, lower_priority
from .reader import COALESCE_BYTES, coalesce

__all__ = ["HttpError", "HttpSettings", "RangeClient", "RemoteFile", "origin_of"]

log = logging.getLogger(__name__)

#: Statuses worth another try: the server is busy or failed, not the request.
RETRY_STATUSES = {408, 429, 500, 502, 503, 504}
#: Redirects followed (an object store or hub may send a request on to a CDN), at most MAX_REDIRECTS.
REDIRECTS = {301, 302, 303, 307, 308}
MAX_REDIRECTS = 5
#: Largest whole file fetched with a plain GET (a manifest, a dataset.toml).
MAX_SMALL_FILE = 16 << 20
CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")

#: Reader threads that run ``http.client``'s Python at once (its reads only: obstore's hold the GIL for a call
#: and a copy) (writing a request, parsing a reply's status
#: and headers), the provider's datasets together. A busy remote dataset has a hundred requests in flight;
#: their replies come back together, and each thread that wakes wants the GIL: the serving loop, one more
#: thread asking, got its turn after all of them (a local dataset's p99 wait beside one: 6-10× its wait
#: alone on two cores). A thread waits for its reply's first byte without a turn (in ``poll``, off the
#: GIL) and reads the body into the batch's buffers without one (``readinto``: C, the GIL released while
#: it waits), so the loop competes with at most this many readers. The GIL runs one of them at a time
#: anyway: the readers lose little.
PYTHON_TURNS = 2
_TURNS = threading.BoundedSemaphore(PYTHON_TURNS)


@dataclass(frozen=True)
class HttpSettings:
    """How a :class:`RangeClient` talks to its server (set from the URI query)."""

    timeout_s: float = 10.0  # per request: connect, and each wait for bytes
    retries: int = 3  # further tries after the first
    backoff_s: float = 0.2  # before retry k: backoff_s * 2**k
    concurrency: int = 8  # requests in flight at first (inflight.py: more while more pays) ...
    # ... up to this per dataset. High enough that the link or the store binds first: the limit climbs only while
    # throughput does, and halves at a 429 or 503. 128 capped a full shuffle of 12 KiB samples at 30 ms a
    # request at 1,600-2,000 samples/s where the store gave 2,300-3,100 with 512 (docs/performance.md)
    max_concurrency: int = 512
    host_concurrency: int = 512  # requests in flight per host, all the provider's datasets together
    coalesce_bytes: int = COALESCE_BYTES  # runs of a file at most this far apart: one request
    ram_cache: int = 0  # bytes of whole blocks kept in RAM (blockmemory.py); 0: none, runs read as asked
    block_bytes: int = BLOCK_BYTES  # the RAM cache's unit
    ca_file: str | None = None  # PEM bundle of the CAs to trust for https (default: the system's)
    #: Origins (``scheme://host:port``) requests may go to, redirects and manifest entries included;
    #: empty: any (the source sets the dataset's own origin plus the operator's ``allow_origins``).
    origins: tuple[str, ...] = ()


def origin_of(url: str) -> str:
    """``scheme://host:port`` of ``url``, the port made explicit."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.scheme}://{(parts.hostname or '').lower()}:{port}"


class HttpError(DatasetError):
    """A request failed: names the URL, the range and the HTTP status or the network error."""

    def __init__(self, message: str, retryable: bool, status: int | None = None):
        super().__init__(message, code="UNAVAILABLE")
        self.retryable, self.status = retryable, status


class RangeClient:
    """Byte-range reads of HTTP(S) URLs over keep-alive connections (see the module doc)."""

    def __init__(self, settings: HttpSettings):
        self.settings = settings
        self._local = threading.local()
        self._tls: ssl.SSLContext | None = None  # made on the first https connection
        #: Requests of this dataset in flight: from ``concurrency`` up to ``max_concurrency`` as throughput grows.
        self.inflight = InflightLimit(settings.concurrency, settings.max_concurrency)
        self._hosts: dict[str, Slots] = {}
        self._targets: dict[str, tuple[str, str] | None] = {}  # URL → where obstore reads it (None: it does not)
        self._pool = ThreadPoolExecutor(
            settings.max_concurrency, thread_name_prefix="http-range", initializer=lower_priority
        )
        #: Whole blocks of the dataset's files in RAM (``ram_cache``), or None.
        self.memory = BlockMemory(settings.ram_cache, settings.block_bytes) if settings.ram_cache else None
        #: Range reads off the GIL (:mod:`.httpstore`), or None (obstore not installed, or a CA file of the dataset's).
        # (not with a CA file: it replaces the system's CAs, as OpenSSL reads it; rustls, under obstore, would
        # add it to them and refuses a CA certificate used as the server's own, as a self-signed server's often is)
        self.ranges = None if settings.ca_file else ObstoreRanges.make(settings.timeout_s, settings.origins)
        if self.ranges is None and not settings.ca_file:
            log.warning(
                "obstore is not installed: ranges are read through http.client, holding the GIL "
                "(pip install 'batchbus[s3]')"
            )
        #: Sizes learned when the dataset opened: every range read's answer must be for a file of that size.
        self._sizes: dict[str, int] = {}
        weakref.finalize(self, self._pool.shutdown, wait=False)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def read_stats(self) -> ReadStats:
        """Requests in flight and their limit now, and the RAM cache's counters (when it has one)."""
        out: ReadStats = {"inflight": self.inflight.inflight, "inflight_limit": self.inflight.limit}
        return {**out, **self.memory.stats()} if self.memory is not None else out

    # -- requests ------------------------------------------------------------------------------

    def _connection(self, url: str) -> tuple[http.client.HTTPConnection, str]:
        if self.settings.origins and origin_of(url) not in self.settings.origins:
            # A redirect, manifest or dataset.toml must not point the provider at another host
            # (an internal address, a metadata service): only the dataset's origin, or one allowed.
            raise HttpError(
                f"{url}: outside the dataset's origin {self.settings.origins[0]}; the provider "
                "reads nothing else unless allowed (?allow_origins=scheme://host:port)",
                retryable=False,
            )
        parts = urlsplit(url)
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        key = (parts.scheme, parts.netloc)
        conn = conns.get(key)
        if conn is None:
            if parts.scheme == "https":
                conn = http.client.HTTPSConnection(
                    parts.netloc, timeout=self.settings.timeout_s, context=self._tls_context()
                )
            else:
                conn = http.client.HTTPConnection(parts.netloc, timeout=self.settings.timeout_s)
            conns[key] = conn
        return conn, parts.path + (f"?{parts.query}" if parts.query else "")

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            try:
                self._tls = ssl.create_default_context(cafile=self.settings.ca_file)
            except (OSError, ssl.SSLError) as err:
                raise HttpError(f"cannot load the CA file {self.settings.ca_file}: {err}", retryable=False) from err
        return self._tls

    def _drop(self, url: str) -> None:
        parts = urlsplit(url)
        conn = getattr(self._local, "conns", {}).pop((parts.scheme, parts.netloc), None)
        if conn is not None:
            conn.close()

    def _attempt(self, method: str, url: str, headers: dict) -> http.client.HTTPResponse:
        """One request, following up to :data:`MAX_REDIRECTS` redirects; the caller reads the
        response. Raises :class:`HttpError`."""
        first = url
        for _ in range(MAX_REDIRECTS + 1):
            conn, target = self._connection(url)
            try:
                with _TURNS:
                    conn.request(method, target, headers=headers)
                _await_reply(conn, self.settings.timeout_s)
                with _TURNS:
                    resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as err:
                self._drop(url)
                raise HttpError(
                    f"{method} {_via(first, url)}{_range_text(headers)}: {_describe(err)}",
                    retryable=not isinstance(err, ssl.SSLCertVerificationError),
                ) from err
            if resp.status < 300:
                return resp
            self._drop(url)  # an error or redirect body is not worth reading: a fresh connection next time
            location = resp.getheader("Location")
            if resp.status not in REDIRECTS or not location:
                raise HttpError(
                    f"{method} {_via(first, url)}{_range_text(headers)}: HTTP {resp.status} {resp.reason}",
                    retryable=resp.status in RETRY_STATUSES,
                    status=resp.status,
                )
            url = urljoin(url, location)
        raise HttpError(f"{method} {first}: more than {MAX_REDIRECTS} redirects", retryable=False)

    def _retrying(self, fn):
        """``fn()`` with bounded retries and backoff for retryable :class:`HttpError`."""
        s = self.settings
        for attempt in range(s.retries + 1):
            try:
                return fn()
            except HttpError as err:
                if not err.retryable or attempt == s.retries:
                    tries = f" (after {attempt + 1} attempts)" if attempt else ""
                    raise HttpError(f"{err}{tries}", retryable=False, status=err.status) from err
                log.warning("%s; retrying in %.2f s", err, s.backoff_s * 2**attempt)
                time.sleep(s.backoff_s * 2**attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def note_size(self, url: str, size: int) -> None:
        """``url`` is ``size`` bytes (a manifest said so): range reads check their answers against it."""
        self._sizes.setdefault(url, size)

    def size(self, url: str) -> int:
        """The size of the file at ``url`` in bytes (HEAD; a 1-byte GET where HEAD is refused)."""

        def head() -> int | None:
            resp = self._attempt("HEAD", url, {})
            resp.read()
            length = resp.getheader("Content-Length")
            return int(length) if length is not None and length.isdigit() else None

        try:
            size = self._retrying(head)
        except HttpError as err:
            if err.status not in (405, 501):  # HEAD not allowed: ask for one byte instead
                raise
            size = None
        size = size if size is not None else self._retrying(lambda: self._total_from_get(url))
        self._sizes[url] = size
        return size

    def version(self, url: str) -> tuple[int, str]:
        """(size, version) of the file at ``url``: the version is its ETag, else its Last-Modified,
        else ``""`` (one HEAD; what a cache of something derived from the file is keyed by)."""

        def head() -> tuple[int | None, str]:
            resp = self._attempt("HEAD", url, {})
            resp.read()
            length = resp.getheader("Content-Length")
            stamp = resp.getheader("ETag") or resp.getheader("Last-Modified") or ""
            return (int(length) if length is not None and length.isdigit() else None), stamp

        size, stamp = self._retrying(head)
        if size is None:
            return self.size(url), stamp
        self._sizes[url] = size
        return size, stamp

    def _total_from_get(self, url: str) -> int:
        headers = {"Range": "bytes=0-0"}
        resp = self._attempt("GET", url, headers)
        resp.read()
        match = CONTENT_RANGE.fullmatch(resp.getheader("Content-Range") or "")
        if resp.status != 206 or match is None or match.group(3) == "*":
            raise HttpError(
                f"GET {url}: cannot learn its size (no Content-Length on HEAD, no Content-Range on a range GET)",
                retryable=False,
            )
        return int(match.group(3))

    def get(self, url: str) -> bytes:
        """A whole small file (at most :data:`MAX_SMALL_FILE` bytes)."""

        def fetch() -> bytes:
            resp = self._attempt("GET", url, {})
            try:
                data = resp.read(MAX_SMALL_FILE + 1)
            except (OSError, http.client.HTTPException) as err:
                self._drop(url)
                raise HttpError(f"GET {url}: {_describe(err)}", retryable=True) from err
            if len(data) > MAX_SMALL_FILE:
                self._drop(url)
                raise HttpError(f"GET {url}: larger than {MAX_SMALL_FILE} bytes", retryable=False)
            return data

        return self._retrying(fetch)

    def read_into(self, url: str, offset: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` with the bytes of ``url`` from ``offset``: one Range request, retried."""
        nbytes = sum(len(b) for b in buffers)
        if nbytes:
            self._retrying(lambda: self._limited(url, offset, nbytes, buffers))

    def _limited(self, url: str, offset: int, nbytes: int, buffers: list[memoryview]) -> None:
        """:meth:`_read_once` within the dataset's limit and the host's (:mod:`.inflight`)."""
        host = self._host(origin_of(url))
        self.inflight.acquire()
        got, throttled = 0, False
        try:
            with host:
                self._read_once(url, offset, nbytes, buffers)
            got = nbytes
        except HttpError as err:
            throttled = err.status in (429, 503)
            raise
        finally:
            self.inflight.release(got, throttled)

    def _host(self, origin: str) -> Slots:
        """The provider-wide places for requests to ``origin`` (:func:`~.inflight.host_slots`)."""
        return self._hosts.get(origin) or self._hosts.setdefault(
            origin, host_slots(origin, self.settings.host_concurrency)
        )

    def _confined(self, url: str, origin: str) -> None:
        """Raise :class:`HttpError` when ``origin`` (``url``'s) is not among the dataset's."""
        if self.settings.origins and origin not in self.settings.origins:
            raise HttpError(
                f"{url}: outside the dataset's origin {self.settings.origins[0]}; the provider reads nothing "
                "else unless allowed (?allow_origins=scheme://host:port)",
                retryable=False,
            )

    def _read_once(self, url: str, offset: int, nbytes: int, buffers: list[memoryview]) -> None:
        if self.ranges is not None and (target := self._target(url)) is not None:
            self._read_obstore(self.ranges, url, target, offset, nbytes, buffers)
        else:
            self._read_http_client(url, offset, nbytes, buffers)

    def _read_obstore(
        self,
        ranges: ObstoreRanges,
        url: str,
        target: tuple[str, str],
        offset: int,
        nbytes: int,
        buffers: list[memoryview],
    ) -> None:
        """One range through obstore (:mod:`.httpstore`), copied into ``buffers``."""
        self._confined(url, target[0])
        try:
            data = ranges.read(*target, offset, offset + nbytes, self._sizes.get(url))
        except RangeFailure as err:
            raise HttpError(
                f"GET {url} (bytes={offset}-{offset + nbytes - 1}): {err}", err.retryable, err.status
            ) from None
        _copy(data, buffers)

    def _read_http_client(self, url: str, offset: int, nbytes: int, buffers: list[memoryview]) -> None:
        headers = {"Range": f"bytes={offset}-{offset + nbytes - 1}"}
        resp = self._attempt("GET", url, headers)
        where = f"GET {url}{_range_text(headers)}"
        if resp.status != 206:
            resp.close()
            self._drop(url)
            raise HttpError(
                f"{where}: HTTP {resp.status} instead of 206 Partial Content; the server does not serve byte ranges",
                retryable=False,
            )
        match = CONTENT_RANGE.fullmatch(resp.getheader("Content-Range") or "")
        if match is None or (int(match.group(1)), int(match.group(2))) != (offset, offset + nbytes - 1):
            self._drop(url)
            raise HttpError(f"{where}: answered Content-Range {resp.getheader('Content-Range')!r}", retryable=False)
        got = 0
        try:
            for buf in buffers:
                view = buf.cast("B") if buf.format != "B" else buf
                while len(view):
                    n = resp.readinto(view)
                    if not n:
                        raise http.client.IncompleteRead(b"", nbytes - got)
                    got += n
                    view = view[n:]
        except (OSError, http.client.HTTPException) as err:
            self._drop(url)
            raise HttpError(
                f"{where}: body ended after {got} of {nbytes} bytes ({_describe(err)})", retryable=True
            ) from err
        if resp.read(1):
            self._drop(url)
            raise HttpError(f"{where}: body longer than the {nbytes} bytes asked for", retryable=False)

    def read_runs(self, runs: list[tuple[RemoteFile, int, list[memoryview]]]) -> None:
        """Each run, one request each (runs of a file at most ``coalesce_bytes`` apart as one), side by
        side. Waits for every request before returning or raising, so no request writes into a buffer
        after the batch has failed."""
        if self.memory is not None:
            self.memory.read(runs, lambda f: (f.url, f.size), lambda f: f.size, self._block, self._pool)
            return
        tasks = self._tasks(coalesce(runs, self.settings.coalesce_bytes))
        if len(tasks) == 1:
            tasks[0]()
            return
        futures = [self._pool.submit(task) for task in tasks]
        wait(futures)
        for fut in futures:
            if (err := fut.exception()) is not None:
                raise err

    def _tasks(self, runs: list[tuple[RemoteFile, int, list[memoryview]]]) -> list[Callable[[], None]]:
        """What reads ``runs``: through obstore, a file's runs in bundles of up to :data:`~.httpstore.PARALLEL`
        (no more than half the dataset's limit now), one call each, so a full-shuffle batch of 500 runs costs
        its threads 50 turns at the GIL, not 500; through ``http.client``, one request per run."""
        tasks: list[Callable[[], None]] = []
        bundles: dict[str, list[tuple[int, list[memoryview]]]] = {}
        for f, offset, buffers in runs:
            if self._target(f.url) is None:
                tasks.append(partial(self.read_into, f.url, offset, buffers))
            elif any(len(b) for b in buffers):
                bundles.setdefault(f.url, []).append((offset, buffers))
        # at most half the limit a bundle: bundles of a batch then fit side by side, and when the limit
        # climbs (by half, inflight.py) one more fits, so the climb can show that it pays
        size = max(1, min(PARALLEL, self.inflight.limit // 2))
        for url, pieces in bundles.items():
            tasks += [partial(self._read_bundle, url, pieces[i : i + size]) for i in range(0, len(pieces), size)]
        return tasks

    def _target(self, url: str) -> tuple[str, str] | None:
        """Where obstore reads ``url`` (:meth:`~.httpstore.ObstoreRanges.path_of`, once per URL), or None."""
        if self.ranges is None:
            return None
        if url not in self._targets:
            self._targets[url] = self.ranges.path_of(url)
        return self._targets[url]

    def _read_bundle(self, url: str, pieces: list[tuple[int, list[memoryview]]]) -> None:
        """Fill each piece's buffers from ``url``: one obstore call for them all, retried as a whole."""
        spans = [(at, at + sum(len(b) for b in buffers)) for at, buffers in pieces]
        self._retrying(lambda: self._bundle_once(url, pieces, spans))

    def _bundle_once(self, url: str, pieces: list[tuple[int, list[memoryview]]], spans: list[tuple[int, int]]) -> None:
        target, ranges = self._target(url), self.ranges
        if target is None or ranges is None:
            raise AssertionError("a bundle of a URL obstore does not read")  # pragma: no cover - _tasks
        self._confined(url, target[0])
        n, host = len(spans), self._host(target[0])
        self.inflight.acquire(n=n)
        got, throttled = 0, False
        try:
            host.acquire(n)
            try:
                datas = ranges.read_many(*target, spans)
            except RangeFailure as err:
                throttled = err.status in (429, 503)
                where = f"bytes={spans[0][0]}-{spans[0][1] - 1}" + (f" and {n - 1} more ranges" if n > 1 else "")
                raise HttpError(f"GET {url} ({where}): {err}", err.retryable, err.status) from None
            finally:
                host.release(n)
            for (_, buffers), data in zip(pieces, datas):
                _copy(data, buffers)
            got = sum(b - a for a, b in spans)
        finally:
            self.inflight.release(got, throttled, n)

    def read_ahead(self, owner: object, blocks: list[tuple[RemoteFile, int]]) -> int:
        """Fetch ``blocks`` into the RAM cache ahead of their reads, replacing ``owner``'s last plan
        (:meth:`~.blockmemory.BlockMemory.prefetch`; as many at once as the dataset's requests in flight,
        which they share with the batches' own: the limit climbs while that pays)."""
        if self.memory is None:
            return 0
        depth = max(1, self.inflight.limit)
        return self.memory.prefetch(
            owner, blocks, lambda f: (f.url, f.size), lambda f: f.size, self._block, self._pool, depth
        )

    def _block(self, f: RemoteFile, start: int, length: int) -> bytearray:
        """One block of ``f`` for the RAM cache: one Range request, retried."""
        buf = bytearray(length)
        self.read_into(f.url, start, [memoryview(buf)])
        return buf


@dataclass(frozen=True, eq=False)
class RemoteFile:
    """One URL of ``size`` bytes, read through its dataset's :class:`RangeClient`."""

    client: RangeClient
    url: str
    size: int

    def __post_init__(self) -> None:
        self.client.note_size(self.url, self.size)


def _copy(data: memoryview, buffers: list[memoryview]) -> None:
    """``data`` laid into ``buffers`` in turn (as many bytes as they hold together)."""
    at = 0
    for buf in buffers:
        view = buf.cast("B") if buf.format != "B" else buf
        view[:] = data[at : at + len(view)]
        at += len(view)


def _via(first: str, last: str) -> str:
    return first if first == last else f"{first} (redirected to {last})"


def _range_text(headers: dict) -> str:
    return f" ({headers['Range']})" if "Range" in headers else ""


def _await_reply(conn: http.client.HTTPConnection, timeout_s: float) -> None:
    """Wait until the reply to the request just sent on ``conn`` has begun to arrive (or the connection
    closed), without holding the GIL or a Python turn (:data:`PYTHON_TURNS`); :class:`TimeoutError`
    after ``timeout_s``, as a read would."""
    sock = conn.sock
    if sock is None or (isinstance(sock, ssl.SSLSocket) and sock.pending()):
        return
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLPRI)
    if not poller.poll(timeout_s * 1000):
        raise TimeoutError("timed out")


def _describe(err: BaseException) -> str:
    if isinstance(err, http.client.IncompleteRead):
        return "connection closed early"
    if isinstance(err, TimeoutError):
        return "timed out"
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__

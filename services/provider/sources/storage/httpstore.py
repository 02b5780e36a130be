"""Byte ranges of ``http(s)://`` files read off the GIL: obstore's ``HTTPStore`` (the Rust ``object_store``
crate's HTTP client, on reqwest and tokio), one per origin, for :class:`~.httprange.RangeClient`.

Why: a remote dataset read at full speed has a hundred requests in flight, and through ``http.client``
every reply's status line and headers are parsed in Python, by a thread that takes the GIL from the
provider's serving loop (a local dataset beside a slow remote one waited 3-11× longer at p99 on two
cores). obstore sends the request, parses the reply and reads the body with the GIL released; the
calling thread holds it only to call and to copy the bytes into the batch.

What ``http.client`` did that obstore does not, kept here:

- **Confinement.** reqwest follows redirects itself (up to 10 hops) and cannot be asked to stop at each
  hop, so the store is told that every host outside the dataset's origins lies behind a proxy that does
  not exist (:data:`NOWHERE`: a connection to port 0 is refused): a redirect to another host is never
  sent, and fails the read naming the URL. The proxy's exceptions name hosts, not ports: a redirect to
  another port of an origin's host (or to a name under an origin's host name) is followed. A single read
  (:meth:`ObstoreRanges.read`: a RAM cache's block, a header) also checks that the answer is for a file of
  the size seen when the dataset opened (the ``Content-Range`` total); a bundle (:meth:`~ObstoreRanges.read_many`)
  cannot (obstore does not return it).
- **Errors that name the URL, the range and the status**, worded as the ``http.client`` path words them
  (:class:`RangeFailure`; :class:`~.httprange.RangeClient` prefixes the request); retries stay with the
  caller (obstore's are off), which knows the dataset's settings.
- **Deadlines**: ``timeout`` bounds the connection and each wait for bytes, as before; a whole request
  at most :data:`WHOLE_REQUEST_FACTOR` times that.

URLs obstore cannot name exactly (a query string, as a pre-signed URL has; percent-encoded or other
unusual characters, which it would encode again) are left to ``http.client`` (:meth:`ObstoreRanges.path_of`
returns ``None``), as are a dataset with a CA file of its own and every request when obstore is not installed
(:mod:`.httprange`). ``https://`` is verified against the system's CAs.
"""

from __future__ import annotations

import re
import threading
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

__all__ = ["NOWHERE", "PARALLEL", "ObstoreRanges", "RangeFailure"]

#: The proxy every host outside the dataset's origins is sent to: nothing listens on port 0.
NOWHERE = "127.0.0.1:0"
#: Ranges one ``get_ranges`` call requests at once (object_store's own bound): the size of a call's bundle.
PARALLEL = 10
#: A whole request (connect to last byte) may take this many times the dataset's ``timeout``.
WHOLE_REQUEST_FACTOR = 6
#: Paths obstore sends as written: RFC 3986 path characters apart from ``%`` (it would encode it again).
PLAIN_PATH = re.compile(r"(/[A-Za-z0-9._~!$&'()*+,;=:@-]+)+")
RETRY_STATUSES = {408, 429, 500, 502, 503, 504}
_STATUS = re.compile(r"status(?: code)?:? (\d{3})")
_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")
_OS_MESSAGE = re.compile(r'kind: (\w+),\s*message: "([^"]*)"')


class RangeFailure(Exception):
    """One range read failed: why (without the request, which the caller names), whether another try may
    succeed, and the HTTP status when there was one."""

    def __init__(self, why: str, retryable: bool, status: int | None = None):
        super().__init__(why)
        self.retryable, self.status = retryable, status


class ObstoreRanges:
    """Range reads of the URLs of one dataset's origins (``scheme://host:port``), through one
    ``HTTPStore`` per origin (see the module doc). :meth:`make` returns ``None`` without obstore."""

    def __init__(self, obstore: Any, store_type: Any, timeout_s: float, origins: tuple[str, ...]):
        self._ob, self._store_type = obstore, store_type
        self.origins = origins
        self._options: dict[str, Any] = {
            "connect_timeout": timedelta(seconds=timeout_s),
            "read_timeout": timedelta(seconds=timeout_s),
            "timeout": timedelta(seconds=timeout_s * WHOLE_REQUEST_FACTOR),
        }
        if origins:  # confined: every other host is behind the proxy that does not exist
            hosts = sorted({h for h in (urlsplit(o).hostname for o in origins) if h})
            self._options.update(proxy_url=f"http://{NOWHERE}", proxy_excludes=",".join(hosts))
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()

    @classmethod
    def make(cls, timeout_s: float, origins: tuple[str, ...]) -> ObstoreRanges | None:
        """The reader of ``origins`` (their hosts: the only ones reached; none named: any host); ``None``
        when obstore is not installed (``http.client`` then reads everything)."""
        try:
            import obstore  # noqa: PLC0415 - optional: the s3 extra
            from obstore.store import HTTPStore  # noqa: PLC0415
        except ImportError:
            return None
        return cls(obstore, HTTPStore, timeout_s, origins)

    @staticmethod
    def path_of(url: str) -> tuple[str, str] | None:
        """``(scheme://host:port, path)`` for a URL obstore requests exactly as written; ``None`` for the
        rest (a query string, percent-encoding, an empty segment, user info)."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or parts.query or parts.fragment or "@" in parts.netloc:
            return None
        if not PLAIN_PATH.fullmatch(parts.path) or any(s in (".", "..") for s in parts.path.split("/")):
            return None
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return f"{parts.scheme}://{(parts.hostname or '').lower()}:{port}", parts.path[1:]

    def _store(self, origin: str) -> Any:
        store = self._stores.get(origin)
        if store is None:
            with self._lock:
                store = self._stores.get(origin)
                if store is None:
                    options = {**self._options, "allow_http": origin.startswith("http://")}
                    store = self._store_type.from_url(
                        f"{origin}/", client_options=options, retry_config={"max_retries": 0}
                    )
                    self._stores[origin] = store
        return store

    def read(self, origin: str, path: str, start: int, end: int, size: int | None) -> memoryview:
        """Bytes ``start`` to ``end`` (exclusive) of the file at ``origin``/``path``, whose size is ``size``
        when known. Raises :class:`RangeFailure`."""
        try:
            result = self._ob.get(self._store(origin), path, options={"range": (start, end)})
            data = memoryview(result.bytes())
        except Exception as err:  # noqa: BLE001 - obstore raises its own types, FileNotFoundError and OSError
            raise _failure(err, end - start) from None
        total = result.meta.get("size")
        if size is not None and total != size:
            raise RangeFailure(
                f"answered for a file of {total} bytes, not the {size} bytes seen when the dataset opened "
                "(the file changed, or a redirect led elsewhere)",
                retryable=False,
            )
        if len(data) != end - start:
            raise RangeFailure(f"body of {len(data)} bytes, not the {end - start} asked for", retryable=False)
        return data

    def read_many(self, origin: str, path: str, spans: list[tuple[int, int]]) -> list[memoryview]:
        """Bytes ``start`` to ``end`` of each of ``spans`` of one file, requested side by side by one call
        (obstore's ``get_ranges``: up to :data:`PARALLEL` at once, none merged): the calling thread takes the
        GIL once for them all. Raises :class:`RangeFailure` (naming no span: the caller names them)."""
        try:
            got = self._ob.get_ranges(
                self._store(origin), path, starts=[a for a, _ in spans], ends=[b for _, b in spans], coalesce=0
            )
        except Exception as err:  # noqa: BLE001 - as in read
            raise _failure(err, sum(b - a for a, b in spans)) from None
        out = [memoryview(g) for g in got]
        for (a, b), data in zip(spans, out):
            if len(data) != b - a:
                raise RangeFailure(f"body of {len(data)} bytes, not the {b - a} asked for", retryable=False)
        return out


def _failure(err: BaseException, nbytes: int) -> RangeFailure:
    """What an obstore error means for a range read (from its text: obstore's types are coarse)."""
    text = str(err)
    if NOWHERE in text:
        return RangeFailure(
            "redirected to a host outside the dataset's origins; the provider reads nothing else unless "
            "allowed (?allow_origins=scheme://host:port)",
            retryable=False,
        )
    if type(err).__name__ == "NotSupportedError" and "Range request not supported" in text:
        return RangeFailure(
            "HTTP 200 instead of 206 Partial Content; the server does not serve byte ranges", retryable=False
        )
    if (m := _STATUS.search(text)) is not None:
        status = int(m.group(1))
        return RangeFailure(f"HTTP {status}", retryable=status in RETRY_STATUSES, status=status)
    if "too many redirects" in text.lower():
        return RangeFailure("more than 10 redirects", retryable=False)
    kind = m.group(1) if (m := _KIND.search(text)) is not None else ""
    os_error = f" ({m.group(1)}: {m.group(2)})" if (m := _OS_MESSAGE.search(text)) is not None else _cause(text)
    if kind == "Timeout" or "operation timed out" in text:
        return RangeFailure("timed out", retryable=True)
    if kind in ("Interrupted", "Decode") or "IncompleteBody" in text or "body error" in text:
        return RangeFailure(f"body ended before the {nbytes} bytes asked for (connection closed)", retryable=True)
    if kind == "Connect":
        return RangeFailure(f"cannot connect{os_error}", retryable=True)
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return RangeFailure(f"connection failed{os_error or ': ' + first.rsplit(' - ', 1)[-1][:200]}", retryable=True)


#: Wrappers in obstore's error chains, never the cause itself.
_WRAPPERS = {"Some", "Http", "HttpError", "Custom", "Other", "OtherError", "Error", "Connect", "Request", "Os"}


def _cause(text: str) -> str:
    """The innermost named cause in an obstore error's debug text (``InvalidCertificate(CaUsedAsEndEntity)``
    → `` (CaUsedAsEndEntity)``), or ``""``."""
    inner = text.partition("inner:")[2]
    names = [n for n in re.findall(r"\b([A-Z][A-Za-z]+)\b", inner) if n not in _WRAPPERS]
    return f" ({names[-1]})" if names else ""

"""``http://`` and ``https://`` dataset sources: the location part (which files, their sizes, reads by
HTTP Range request); the layouts are those of ``file://`` that read here (:mod:`.layouts`: token shards,
``.npy`` pairs, raw arrays, WebDataset shards).

Which files make the dataset:

- a numeric range in braces expands to one URL per number, in number order:
  ``http://host/shards/shard-{000..015}.bin`` (zero-padded when the first number is);
- ``?files=a.bin,b.bin`` names files relative to the URI (a directory URI ends in ``/``);
- ``?manifest=NAME`` names a text file beside them listing one file per line, optionally with its
  size in bytes after a space (lines starting with ``#`` are comments): no HEAD per file;
- a URI naming one file serves that file;
- a directory URI with none of these is probed for ``dataset.toml`` and the ``.npy`` names of
  :mod:`.formats.npy` (HTTP cannot list a directory).

The format is ``?format=``, or ``dataset.toml``'s, or detected as for ``file://`` (WebDataset when
``.tar`` files are named, raw when a fetched ``dataset.toml`` has a ``[train]`` table, then npy, then tokens). ``seq_len``, ``token_bytes``,
``vocab_size``, ``val_fraction``, ``classes`` and ``memory`` (default ``stream``) mean what they
mean for ``file://``. HTTP settings: ``timeout`` (seconds per request, default 10), ``retries``
(default 3), ``backoff`` (seconds before the first retry, doubling; default 0.2), ``concurrency``
(requests in flight per dataset at first, default 8; more while more pays, up to ``max_concurrency``,
default 128, and ``host_concurrency`` per host; a ``concurrency`` alone is held), ``coalesce`` (runs of
a file this many bytes apart are one request; default 65536), ``ca`` (a PEM file of CAs to trust for https instead
of the system's). File sizes are learned once at start-up.

URIs naming ``.tar`` files (``https://host/shards/train-{0000..0099}.tar``) are WebDataset shards,
decoded on the provider as under ``file://`` (:mod:`.images`: ``size``, ``augment``, ``bad``, …).
"""

from __future__ import annotations

import logging
import os
import re
from fnmatch import fnmatch
from pathlib import Path
from urllib.parse import urljoin, urlunsplit

from libbus.errors import DatasetError

from .base import OpenRequest, Source
from .formats.dataset import Context, FilePath
from .formats.dataset_toml import TOML, DatasetSettings
from .formats.location import Location
from .layouts import open_layout
from .storage.httprange import HttpError, HttpSettings, RangeClient, RemoteFile, origin_of
from .storage.reader import Segment

__all__ = ["MAX_FILES", "HttpLocation", "RemoteDir", "expand_template", "open_http_source"]

log = logging.getLogger(__name__)

#: Most files one URI may name (a typo in a range should not start a million HEAD requests).
MAX_FILES = 100_000
RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
#: Names probed in a directory URI that lists no files.
PROBED = [TOML] + [
    f"{n}.npy"
    for split in ("train", "val", "test")
    for column in ("x", "y")
    for n in (f"{split}_{column}", f"{column}_{split}")
]


def expand_template(url: str) -> list[str]:
    """The URLs a ``{A..B}`` range names, in order; ``[url]`` when it has none.

    Raises :class:`DatasetError` for more than one range, a range that runs backwards, or more
    than :data:`MAX_FILES` files.
    """
    found = RANGE.findall(url)
    if not found:
        return [url]
    if len(found) > 1:
        raise DatasetError(f"{url}: one {{A..B}} range per URL, found {len(found)}")
    first, last = found[0]
    a, b = int(first), int(last)
    if b < a or b - a + 1 > MAX_FILES:
        raise DatasetError(f"{url}: range {{{first}..{last}}} must run upwards over at most {MAX_FILES} files")
    width = len(first) if first.startswith("0") and len(first) > 1 else 0
    return [RANGE.sub(str(i).zfill(width), url) for i in range(a, b + 1)]


class RemotePath:
    """A file of a :class:`RemoteDir`: the part of ``pathlib.Path`` that the format openers use."""

    def __init__(self, parent: RemoteDir, name: str, url: str, order: int):
        self.parent, self.name, self.url, self.order = parent, name, url, order

    @property
    def suffix(self) -> str:
        dot = self.name.rfind(".")
        return self.name[dot:] if dot > 0 else ""

    @property
    def stem(self) -> str:
        return self.name[: -len(self.suffix)] if self.suffix else self.name

    def is_file(self) -> bool:
        return self.parent.has(self)

    def is_dir(self) -> bool:
        return False

    def read_bytes(self) -> bytes:
        """The whole file (a ``dataset.toml``)."""
        return self.parent.client.get(self.url)

    def __lt__(self, other: RemotePath) -> bool:  # listed order: a range's number order
        return self.order < other.order

    def __str__(self) -> str:
        return self.url


class RemoteDir:
    """The files an HTTP URI names, as a directory the format openers can read (see the module doc).

    Sizes come from the manifest or one HEAD request per file, once."""

    def __init__(self, base: str, client: RangeClient, listed: dict[str, tuple[str, int | None]] | None):
        self.base, self.client = base, client
        self.listed = listed  # name → (url, size or None); None: not listed, probe by name
        self.sizes: dict[str, int] = {url: size for url, size in (listed or {}).values() if size is not None}

    def __truediv__(self, name: str) -> RemotePath:
        listed = self.listed or {}
        if name in listed:
            return RemotePath(self, name, listed[name][0], list(listed).index(name))
        return RemotePath(self, name, urljoin(self.base, name), len(listed))

    def iterdir(self):
        return (RemotePath(self, n, url, i) for i, (n, (url, _)) in enumerate((self.listed or {}).items()))

    def glob(self, pattern: str):
        return (p for p in self.iterdir() if fnmatch(p.name, pattern))

    def has(self, path: RemotePath) -> bool:
        if self.listed is not None:
            return path.name in self.listed
        return self.size(path.url) is not None

    def size(self, url: str) -> int | None:
        """The size of ``url``; ``None`` when the server says it does not exist (404, 410)."""
        try:
            return self.file_size(url)
        except HttpError as err:
            if err.status not in (404, 410):
                raise
            return None

    def file_size(self, url: str) -> int:
        """The size of ``url``; raises :class:`HttpError` naming the URL and the status when it has none."""
        if url not in self.sizes:
            self.sizes[url] = self.client.size(url)
        return self.sizes[url]

    def __str__(self) -> str:
        return self.base


class RemoteContext(Context):
    """A :class:`Context` whose files are the URLs of ``files``, read by range."""

    def __init__(self, location: HttpLocation, files: RemoteDir, settings: DatasetSettings, toml: dict):
        # nothing is decompressed here (compressed layouts are refused over HTTP): no cache directory
        super().__init__(location.uri, location.root, Path(os.devnull), settings, toml, location=location)
        self.files = files

    def segment(self, path: FilePath, offset: int = 0, length: int | None = None, name: str | None = None) -> Segment:
        if not isinstance(path, RemotePath):
            raise DatasetError(f"{path}: not a file of {self.files}")
        size = self.files.file_size(path.url)
        remote = RemoteFile(self.files.client, path.url, size)
        return Segment(name or path.url, -1, offset, size - offset if length is None else length, remote)


def _http_settings(uri: str, params: dict) -> HttpSettings:
    defaults = HttpSettings()
    out: dict[str, float] = {}
    for key, field, kind in (
        ("timeout", "timeout_s", float),
        ("retries", "retries", int),
        ("backoff", "backoff_s", float),
        ("concurrency", "concurrency", int),
        ("max_concurrency", "max_concurrency", int),
        ("host_concurrency", "host_concurrency", int),
        ("coalesce", "coalesce_bytes", int),
        ("ram_cache", "ram_cache", int),
        ("block", "block_bytes", int),
    ):
        if key not in params:
            continue
        value = params.pop(key)
        try:
            out[field] = kind(value)
        except ValueError:
            raise DatasetError(
                f"{uri}: {key} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
            ) from None
        counted = key.endswith("concurrency") or key == "block"
        if out[field] < (1 if counted else 0) or (key == "timeout" and out[field] == 0):
            raise DatasetError(f"{uri}: {key} must be {'at least 1' if counted else 'positive'}, got {value!r}")
    allowed = [o.strip() for o in params.pop("allow_origins", "").split(",") if o.strip()]
    origins = (origin_of(uri), *(origin_of(o) for o in allowed))
    ca_file = params.pop("ca", None)
    if ca_file is not None and not Path(ca_file).is_file():
        raise DatasetError(f"{uri}: ca {ca_file!r} is not a file (a PEM bundle of CA certificates)")
    numbers = {
        f: out.get(f, getattr(defaults, f))
        for f in ("timeout_s", "retries", "backoff_s", "concurrency", "max_concurrency", "host_concurrency")
        + ("coalesce_bytes", "ram_cache", "block_bytes")
    }
    if "concurrency" in out and "max_concurrency" not in out:  # the operator's own number: held, not climbed
        numbers["max_concurrency"] = out["concurrency"]
    numbers["max_concurrency"] = max(numbers["max_concurrency"], numbers["concurrency"])
    return HttpSettings(**numbers, ca_file=ca_file, origins=origins)


def _listing(uri: str, url: str, params: dict, client: RangeClient) -> tuple[str, dict | None]:
    """(base URL, name → (url, size)) for the files the URI names; ``None``: probe by name."""
    base = url if url.endswith("/") else url[: url.rfind("/") + 1]
    chosen = [k for k in ("files", "manifest") if k in params] + (["range"] if RANGE.search(url) else [])
    if len(chosen) > 1:
        raise DatasetError(f"{uri}: give one of files=, manifest= or a {{A..B}} range, not {' and '.join(chosen)}")
    if "files" in params:
        names = [n.strip() for n in params.pop("files").split(",") if n.strip()]
        if not names:
            raise DatasetError(f"{uri}: files= names no file")
        return base, {n: (urljoin(url, n), None) for n in names}
    if "manifest" in params:
        murl = urljoin(url, params.pop("manifest"))
        listed = _manifest(murl, client.get(murl))
        origins = client.settings.origins
        for name, (u, _) in listed.items():  # refused now, not at the first batch
            if origins and origin_of(u) not in origins:
                raise DatasetError(
                    f"{murl}: entry {name!r} is {u}, outside the dataset's origin {origins[0]} "
                    "(allow it with ?allow_origins=scheme://host:port)"
                )
        return base, listed
    if found := RANGE.search(url):  # names relative to the folder above the range: unique, in range order
        base = url[: url.rfind("/", 0, found.start()) + 1]
        return base, {u[len(base) :]: (u, None) for u in expand_template(url)}
    if not url.endswith("/"):
        return base, {url[len(base) :]: (url, None)}
    return base, None


def _manifest(murl: str, data: bytes) -> dict:
    listed = {}
    for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, size = line.partition(" ")
        size = size.strip()
        if size and not size.isdigit():
            raise DatasetError(f"{murl} line {n}: expected 'NAME [SIZE]', got {line!r}")
        listed[name] = (urljoin(murl, name), int(size) if size else None)
    if not listed:
        raise DatasetError(f"{murl}: the manifest lists no file")
    return listed


class HttpLocation(Location):
    """The files an HTTP(S) URI names (see the module doc): sizes learned once, files read by range
    through one :class:`~.storage.httprange.RangeClient` per dataset."""

    kind, label, memory = "http", "over HTTP", "stream"

    def __init__(self, req: OpenRequest):
        uri, parts, params = req.uri, req.parts, req.params
        self.client = RangeClient(_http_settings(uri, params))
        try:
            url = urlunsplit((parts.scheme, parts.netloc, parts.path or "/", "", ""))
            base, listed = _listing(uri, url, params, self.client)
            self.files = root = RemoteDir(base, self.client, listed)
            if listed is None:  # a bare directory: find what is there
                found = {n: ((root / n).url, root.size((root / n).url)) for n in PROBED}
                root.listed = {n: (u, s) for n, (u, s) in found.items() if s is not None}
                if not root.listed:
                    raise DatasetError(
                        f"{uri}: HTTP cannot list a directory and none of {', '.join(PROBED[:3])}, "
                        "… is there: name the files with ?files=a.bin,b.bin, ?manifest=NAME or "
                        "a {000..015} range"
                    )
        except BaseException:
            self.client.close()
            raise
        super().__init__(req, root)
        self._cache: Path | None = None

    def cache_dir(self) -> Path:
        """``?cache=DIR`` (default ``~/.cache/batchbus/webdataset``): where shard indexes go."""
        if self._cache is None:
            default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchbus" / "webdataset"
            self._cache = Path(self.params.pop("cache", "") or default)
        return self._cache

    def stamp(self, path: RemotePath) -> tuple[int, str]:
        return self.client.version(path.url)  # its ETag, else its Last-Modified

    def pread(self, path: RemotePath, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        self.client.read_into(path.url, offset, [memoryview(buf)])
        return bytes(buf)

    def context(self, settings: DatasetSettings, toml: dict) -> Context:
        return RemoteContext(self, self.files, settings, toml)

    def close(self) -> None:
        self.client.close()


def open_http_source(req: OpenRequest) -> Source:
    """Open the dataset an ``http(s)://`` URI names, popping the ``params`` it knows.

    Raises :class:`DatasetError` naming the URL and the HTTP status or network error when a file
    cannot be reached, and as ``file://`` does for a bad layout or parameter.
    """
    location = HttpLocation(req)
    source = open_layout(location)
    memory, total = location.client.memory, sum(location.files.sizes.values())
    if memory is not None and total > memory.limit:
        log.warning(
            "%s: ram_cache holds %d of its %d bytes: a full shuffle evicts blocks before their other samples "
            "are read (each sample then costs a block); size it to the files, or use shuffle='block'",
            req.uri,
            memory.limit,
            total,
        )
    return source

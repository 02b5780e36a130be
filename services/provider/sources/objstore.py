"""``s3://BUCKET/PREFIX``, ``gs://BUCKET/PREFIX``, ``az://CONTAINER/PREFIX`` dataset sources: the
location part (a listed prefix, its objects read by range); the layouts (:mod:`.layouts`) are the
formats a provider serves from files (token shards, npy pairs, raw arrays with ``dataset.toml``,
Parquet by row group, CIFAR-10 batches, uncompressed IDX), and the image layouts (ImageFolder
prefixes, WebDataset ``.tar`` shards, ``?size=S`` as for ``file://``), read by byte range from an
object store. A shard's index is cached in the cache directory (``cache_dir``/webdataset, else
``~/.cache/batchbus/webdataset``) under the object's ETag: a rewritten shard is indexed again.

The prefix is listed once at open; the format is ``?format=``, ``dataset.toml``'s, or detected as for
``file://``.
Reads go through :mod:`.storage.objects` (one request per contiguous run, bounded concurrency per
dataset and per host, retries with jittered backoff, a deadline per batch) and, when the provider
has a ``cache_dir``, a bounded disk cache of blocks (:mod:`.storage.blockcache`).

The client is ``obstore`` (the Rust ``object_store`` crate; docs/performance.md says why). Credentials
come from the standard chains only: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
``AWS_ENDPOINT_URL``, ``AWS_REGION``, web identity and instance metadata (AWS); ``AWS_PROFILE`` and
profile files through boto3 when it is installed; ``GOOGLE_APPLICATION_CREDENTIALS`` and the metadata
server (GCS), or ``STORAGE_EMULATOR_HOST`` for an emulator (no credentials, as Google's libraries do);
``AZURE_STORAGE_CONNECTION_STRING`` (the Azure SDKs' variable, ``UseDevelopmentStorage=true`` included)
or ``AZURE_STORAGE_*`` (Azure). A URI that carries a credential is refused; messages name the store, the
operation and the object, never a key. gs:// and az:// are tested against fake-gcs-server and Azurite.

URI parameters: what ``file://`` takes (``format``, ``seq_len``, ``token_bytes``, ``vocab_size``,
``val_fraction``, ``classes``, ``memory``, default ``stream``; Parquet's ``column``, ``label``,
``subset``, ``cache_mb``), and ``concurrency``, ``host_concurrency``, ``retries``, ``backoff``,
``deadline`` (seconds per batch), ``timeout`` (seconds per request), ``block`` (cache block bytes),
``cache_dir``, ``cache_limit`` (bytes; override the provider's ``cache_dir``/``cache_limit``), ``cache=off``;
``ram_cache`` (bytes of whole ``block``-sized blocks kept in RAM, before the disk cache).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from libbus.errors import DatasetError

from .base import OpenRequest, Source, SourceInfo
from .formats.dataset import Context, FilePath
from .formats.dataset_toml import DatasetSettings
from .formats.location import Location
from .layouts import open_layout
from .storage import objects
from .storage.blockcache import BlockCache, cache_stats
from .storage.objects import (
    ObjectBackend,
    ObjectClient,
    ObjectFile,
    ObjectPath,
    ObjectSettings,
    ObjectStoreRow,
    ObjectTree,
)
from .storage.reader import Segment

__all__ = ["CACHE", "SCHEMES", "ObjectLocation", "configure_cache", "object_store_stats", "open_object_source"]

SCHEMES = ("s3", "gs", "az")
#: Query parameters that would carry a credential (refused by name; their value is never echoed).
SECRET_PARAMS = re.compile(
    r"(?i)^(aws_)?(access_key(_id)?|secret(_access_key)?|session_token|token|password|sas|sig|"
    r"x-amz-(credential|signature|security-token)|credentials?|key|account_key|service_account.*)$"
)
#: The provider's cache (``cache_dir``, ``cache_limit``), set at start-up by :func:`configure_cache`.
CACHE: dict = {"dir": "", "limit": 0}


def configure_cache(cache_dir: str, cache_limit: int) -> None:
    """The disk cache object-store datasets use unless their URI names another (provider settings).
    Process-wide: the provider sets it before opening its datasets (one provider per process)."""
    CACHE.update(dir=cache_dir, limit=int(cache_limit))


def object_store_stats(datasets: dict[str, Source]) -> ObjectStoreRow:
    """``{"object_store": {requests, retries, failures, bytes_fetched, caches}}`` when the provider
    serves an object-store dataset (else ``{}``): what ``busctl queues`` and the metrics show."""
    if not any(_reads_objects(s) for s in datasets.values()):
        return {}
    with objects.STATS_LOCK:
        counts = dict(objects.STATS)
    return {
        "object_store": {
            "requests": counts["requests"],
            "retries": counts["retries"],
            "failures": counts["failures"],
            "bytes_fetched": counts["bytes_fetched"],
            "caches": cache_stats(),
        }
    }


def _reads_objects(source: Source) -> bool:
    """Whether ``source`` reads an object store (a file format, Parquet, or an image layout's store)."""
    store = getattr(source, "store", None)
    return (
        isinstance(getattr(source, "location", None), ObjectLocation)
        or isinstance(getattr(store, "location", None), ObjectLocation)
        or isinstance(getattr(store, "root", None), ObjectPath)
    )


def _redacted(req: OpenRequest) -> str:
    return f"{req.parts.scheme}://{req.parts.hostname or ''}{req.parts.path}"


def _refuse_credentials(req: OpenRequest) -> None:
    parts = req.parts
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise DatasetError(
            f"{_redacted(req)}: a dataset URI must not carry credentials (they would show in logs, "
            "DatasetInfo and metrics); give the provider its credentials in the environment "
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS, "
            "AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_*)"
        )
    if bad := sorted(k for k in req.params if SECRET_PARAMS.match(k)):
        for k in bad:
            req.params.pop(k)
        raise DatasetError(
            f"{_redacted(req)}: parameter(s) {', '.join(bad)} would put a credential in the dataset URI; "
            "give the provider its credentials in the environment (AWS_*, GOOGLE_*, AZURE_*)"
        )


def _number(req: OpenRequest, key: str, kind, default, minimum):
    if key not in req.params:
        return default
    value = req.params.pop(key)
    try:
        out = kind(value)
    except ValueError:
        raise DatasetError(f"{_redacted(req)}: {key} must be a number, got {value!r}") from None
    if out < minimum:
        raise DatasetError(f"{_redacted(req)}: {key} must be at least {minimum}, got {value!r}")
    return out


def _settings(req: OpenRequest) -> tuple[ObjectSettings, float]:
    d = ObjectSettings()
    fixed = "concurrency" in req.params and "max_concurrency" not in req.params  # the operator's own number
    concurrency = _number(req, "concurrency", int, d.concurrency, 1)
    s = ObjectSettings(
        concurrency=concurrency,
        max_concurrency=concurrency
        if fixed
        else max(concurrency, _number(req, "max_concurrency", int, d.max_concurrency, 1)),
        host_concurrency=_number(req, "host_concurrency", int, d.host_concurrency, 1),
        retries=_number(req, "retries", int, d.retries, 0),
        backoff_s=_number(req, "backoff", float, d.backoff_s, 0),
        deadline_s=_number(req, "deadline", float, d.deadline_s, 0.001),
        block_bytes=_number(req, "block", int, d.block_bytes, 4096),
        coalesce_bytes=_number(req, "coalesce", int, d.coalesce_bytes, 0),
        ram_cache=_number(req, "ram_cache", int, d.ram_cache, 0),
    )
    return s, _number(req, "timeout", float, 5.0, 0.001)


def _cache(req: OpenRequest) -> BlockCache | None:
    where = req.params.pop("cache_dir", "") or CACHE["dir"]
    limit = _number(req, "cache_limit", int, CACHE["limit"], 0)
    off = req.params.pop("cache", "on")
    if off not in ("on", "off"):
        raise DatasetError(f"{_redacted(req)}: cache must be on or off, got {off!r}")
    if off == "off" or not where:
        return None
    if limit <= 0:
        raise DatasetError(f"{_redacted(req)}: a cache_dir needs a cache_limit in bytes (e.g. 10000000000)")
    return BlockCache.shared(Path(where), limit)


def _backend(req: OpenRequest, timeout_s: float):
    from .storage.obstore_backend import ObstoreBackend  # the client library, imported when used

    return ObstoreBackend(req.parts.scheme, req.parts.hostname or "", timeout_s)


class ObjectContext(Context):
    """A :class:`Context` whose files are objects read by range."""

    def segment(self, path: FilePath, offset: int = 0, length: int | None = None, name: str | None = None) -> Segment:
        if not isinstance(path, ObjectPath) or not path.is_file():
            raise DatasetError(f"{path}: no such object under {self.root}")
        meta = path.meta
        return Segment(
            name or str(path),
            -1,
            offset,
            meta.size - offset if length is None else length,
            ObjectFile(path.tree.client, meta),
        )


class ObjectLocation(Location):
    """The objects under a prefix, listed once at open (an :class:`~.storage.objects.ObjectPath` root),
    read by range through one :class:`~.storage.objects.ObjectClient` per dataset: bounded, retried,
    through the disk cache, each batch's reads under one deadline. Pops the object-store parameters
    (client, cache); refuses a URI carrying credentials."""

    kind, label, memory = "object", "from object stores", "stream"

    def __init__(self, req: OpenRequest):
        _refuse_credentials(req)
        settings, timeout_s = _settings(req)
        cache = _cache(req)
        backend, prefix = self.open_backend(req, timeout_s)
        self.client = ObjectClient(backend, settings, cache)
        try:
            listing = prefix if not prefix or prefix.endswith("/") else prefix + "/"
            objects = backend.list(listing)
            if not objects:
                raise DatasetError(f"{backend.name}/{listing}: no objects under this prefix")
        except BaseException:
            self.client.close()
            raise
        super().__init__(req, ObjectTree(self.client, listing, objects).root)

    def open_backend(self, req: OpenRequest, timeout_s: float) -> tuple[ObjectBackend, str]:
        """The store's client and the prefix listed in it (a location over another store overrides it)."""
        return _backend(req, timeout_s), req.parts.path.lstrip("/")

    @property
    def name(self) -> str:
        return _redacted(self.req)

    def cache_dir(self) -> Path:
        """Where shard indexes go: ``CACHE_DIR/webdataset`` (the disk cache's), else ``~/.cache/batchbus/webdataset``."""
        cache = self.client.cache
        where = (
            cache.root
            if cache is not None
            else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchbus"
        )
        return where / "webdataset"

    def context(self, settings: DatasetSettings, toml: dict) -> Context:
        return ObjectContext(self.uri, self.root, Path(os.devnull), settings, toml, location=self)

    def stamp(self, path: ObjectPath) -> tuple[int, str]:
        return path.meta.size, path.meta.etag

    def pread(self, path: ObjectPath, offset: int, n: int) -> bytes:
        return bytes(self.client.fetch(path.meta, offset, n))

    def read_files(self, paths: list[ObjectPath]) -> list[bytes]:
        return self.read_ranges([(path, 0, path.meta.size) for path in paths])

    def read_ranges(self, ranges: list[tuple[ObjectPath, int, int]]) -> list[bytes]:
        with self.client.batch():  # a batch's runs together: bounded, retried, one deadline
            return self.client.read_ranges([(path.meta, offset, n) for path, offset, n in ranges])

    def batch(self):
        return self.client.batch()

    def info(self) -> SourceInfo:
        return {"store": self.client.backend.name.split("://")[0]}

    def close(self) -> None:
        self.client.close()


def open_object_source(req: OpenRequest) -> Source:
    """Open the dataset under an object-store prefix, popping the ``params`` it knows.

    Raises :class:`DatasetError` for a URI with credentials, a refused or failed listing (naming the
    store and operation), an unknown layout or a bad parameter.
    """
    return open_layout(ObjectLocation(req))

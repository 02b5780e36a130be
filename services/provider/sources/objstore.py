"""``s3://BUCKET/PREFIX``, ``gs://BUCKET/PREFIX``, ``az://CONTAINER/PREFIX`` dataset sources: the
formats a provider serves from files (token shards, npy pairs, raw arrays with ``dataset.toml``,
Parquet by row group, CIFAR-10 batches, uncompressed IDX), and the image layouts (ImageFolder
prefixes, WebDataset ``.tar`` shards, ``?size=S`` as for ``file://``), read by byte range from an
object store. A shard's index is cached in the cache directory (``cache_dir``/webdataset, else
``~/.cache/batchbus/webdataset``) under the object's ETag: a rewritten shard is indexed again.

The prefix is listed once at open; the format is ``?format=`` or detected as for ``file://``.
Reads go through :mod:`.formats.objects` (one request per contiguous run, bounded concurrency per
dataset and per host, retries with jittered backoff, a deadline per batch) and, when the provider
has a ``cache_dir``, a bounded disk cache of blocks (:mod:`.formats.blockcache`).

The client is ``obstore`` (the Rust ``object_store`` crate; docs/performance.md says why). Credentials
come from the standard chains only: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
``AWS_ENDPOINT_URL``, ``AWS_REGION``, web identity and instance metadata (AWS); ``AWS_PROFILE`` and
profile files through boto3 when it is installed; ``GOOGLE_APPLICATION_CREDENTIALS`` and the metadata
server (GCS); ``AZURE_STORAGE_*`` (Azure). A URI that carries a credential is refused; messages name
the store, the operation and the object, never a key.

URI parameters: what ``file://`` takes (``format``, ``seq_len``, ``token_bytes``, ``vocab_size``,
``val_fraction``, ``classes``, ``memory``, default ``stream``; Parquet's ``column``, ``label``,
``subset``, ``cache_mb``), and ``concurrency``, ``host_concurrency``, ``retries``, ``backoff``,
``deadline`` (seconds per batch), ``timeout`` (seconds per request), ``block`` (cache block bytes),
``cache_dir``, ``cache_limit`` (bytes; override the provider's ``cache_dir``/``cache_limit``), ``cache=off``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from libbus.errors import DatasetError

from . import images, parquet
from .base import FieldBatch, OpenRequest, Source
from .formats import cifar, idx, imagefolder, npy, objects, raw, tokens, webdataset
from .formats.blockcache import BlockCache, cache_stats
from .formats.dataset import MEMORY_MODES, Context, FileSource
from .formats.dataset_toml import TOML, parse_dataset_toml, parse_settings
from .formats.objects import ObjectClient, ObjectPath, ObjectSettings, ObjectTree
from .formats.reader import Segment

__all__ = ["CACHE", "SCHEMES", "configure_cache", "object_root", "object_store_stats", "open_object_source"]

SCHEMES = ("s3", "gs", "az")
FORMATS = {
    "tokens": (tokens.detect, tokens.open_tokens),
    "npy": (npy.detect, npy.open_npy),
    "idx": (idx.detect, idx.open_idx),
    "cifar10": (cifar.detect, cifar.open_cifar),
    "raw": (None, raw.open_raw),
}
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


def object_store_stats(datasets: dict[str, Source]) -> dict:
    """``{"object_store": {requests, retries, failures, bytes_fetched, caches}}`` when the provider
    serves an object-store dataset (else ``{}``): what ``busctl queues`` and the metrics show."""
    if not any(_reads_objects(s) for s in datasets.values()):
        return {}
    with objects.STATS_LOCK:
        out: dict = dict(objects.STATS)
    out["caches"] = cache_stats()
    return {"object_store": out}


def _reads_objects(source: Source) -> bool:
    """Whether ``source`` reads an object store (a file format, Parquet, or an image layout's store)."""
    store = getattr(source, "store", None)
    return (
        isinstance(source, (ObjectFileSource, ObjectParquetSource))
        or isinstance(store, webdataset.ObjectShards)
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
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*)"
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
    s = ObjectSettings(
        concurrency=_number(req, "concurrency", int, d.concurrency, 1),
        host_concurrency=_number(req, "host_concurrency", int, d.host_concurrency, 1),
        retries=_number(req, "retries", int, d.retries, 0),
        backoff_s=_number(req, "backoff", float, d.backoff_s, 0),
        deadline_s=_number(req, "deadline", float, d.deadline_s, 0.001),
        block_bytes=_number(req, "block", int, d.block_bytes, 4096),
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
    from .objstore_obstore import ObstoreBackend  # the client library, imported when used

    return ObstoreBackend(req.parts.scheme, req.parts.hostname or "", timeout_s)


class ObjectContext(Context):
    """A :class:`Context` whose files are objects read by range."""

    def segment(self, path: ObjectPath, offset: int = 0, length: int | None = None, name: str | None = None) -> Segment:
        if not isinstance(path, ObjectPath) or not path.is_file():
            raise DatasetError(f"{path}: no such object under {self.root}")
        from .formats.objects import ObjectFile

        meta = path.meta
        return Segment(
            name or str(path),
            -1,
            offset,
            meta.size - offset if length is None else length,
            ObjectFile(self.root.tree.client, meta),
        )


class ObjectFileSource(FileSource):
    """A :class:`FileSource` over objects: each batch's reads share one deadline."""

    client: ObjectClient

    def read_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        with self.client.batch():
            super().read_into(split, indices, x, y)

    def info(self) -> dict:
        info = super().info()
        info["store"] = self.client.backend.name.split("://")[0]
        return info

    def close(self) -> None:
        super().close()
        self.client.close()


class ObjectParquetSource(parquet.ParquetSource):
    """A :class:`~.parquet.ParquetSource` over objects (row groups read by range)."""

    client: ObjectClient

    def read_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        with self.client.batch():
            super().read_into(split, indices, x, y)

    def read(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with self.client.batch():  # texts for a pipeline (?encoded=1): the same per-batch deadline
            return super().read(split, indices)

    def read_fields(self, split: str, indices: np.ndarray, epoch: int = 0) -> FieldBatch:
        with self.client.batch():  # named fields (?fields=): the same per-batch deadline
            return super().read_fields(split, indices, epoch)

    def close(self) -> None:
        super().close()
        self.client.close()


def object_root(req: OpenRequest) -> ObjectPath:
    """The listed prefix an object-store URI names, as a folder a file-backed format opens like a
    ``Path`` (its client: ``root.tree.client``; close it with the source). Pops the object-store
    parameters (client, cache); refuses a URI carrying credentials. What a kind that reads files
    (WebDataset tars, image folders) calls to take ``s3://`` too.
    """
    _refuse_credentials(req)
    settings, timeout_s = _settings(req)
    cache = _cache(req)
    backend = _backend(req, timeout_s)
    client = ObjectClient(backend, settings, cache)
    try:
        prefix = req.parts.path.lstrip("/")
        listing = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        objects = backend.list(listing)
        if not objects:
            raise DatasetError(f"{backend.name}/{listing}: no objects under this prefix")
        return ObjectTree(client, listing, objects).root
    except BaseException:
        client.close()
        raise


def open_object_source(req: OpenRequest) -> Source:
    """Open the dataset under an object-store prefix, popping the ``params`` it knows.

    Raises :class:`DatasetError` for a URI with credentials, a refused or failed listing (naming the
    store and operation), an unknown layout or a bad parameter.
    """
    uri, params = req.uri, req.params
    root = object_root(req)
    client = root.tree.client
    try:
        if params.get("format") == "parquet" or ("format" not in params and parquet.detect(root)):
            params.pop("format", None)
            src = parquet.open_parquet_dir(uri, root, params, source_class=ObjectParquetSource)
            src.client = client
            return src
        if (image_format := _image_format(root, params)) is not None:
            return _open_images(req, root, image_format)
        toml = _read_toml(root)
        file_settings = parse_settings(uri, params, toml)
        memory = params.pop("memory", "stream")
        if memory not in MEMORY_MODES:
            raise DatasetError(f"{uri}: memory must be one of {', '.join(MEMORY_MODES)}, got {memory!r}")
        fmt = file_settings.get("format") or _detect(root, toml)
        if fmt not in FORMATS:
            raise DatasetError(f"{uri}: unknown format {fmt!r}; expected one of parquet, {', '.join(FORMATS)}")
        if fmt in ("idx", "npy") and (packed := [p.name for p in root.iterdir() if p.name.endswith((".gz", ".npz"))]):
            raise DatasetError(
                f"{root}/{packed[0]}: compressed files are not read from object stores (each batch reads "
                "byte ranges); store the arrays uncompressed (.npy, IDX without .gz)"
            )
        ctx = ObjectContext(uri, root, Path(os.devnull), file_settings, toml)
        layout = FORMATS[fmt][1](ctx)
        source = ObjectFileSource.__new__(ObjectFileSource)
        source.client = client
        FileSource.__init__(source, uri, root, layout, ctx, memory, file_settings.get("val_fraction", 0.1))
        return source
    except BaseException:
        client.close()
        raise


def _image_format(root: ObjectPath, params: dict) -> str | None:
    fmt = params.get("format")
    if fmt in ("imagefolder", "webdataset"):
        params.pop("format")
        return fmt
    if fmt is None and imagefolder.detect(root):
        return "imagefolder"
    if fmt is None and webdataset.detect(root):
        return "webdataset"
    return None


def _open_images(req: OpenRequest, root: ObjectPath, fmt: str) -> Source:
    """An ImageFolder prefix or WebDataset shards, decoded on the provider as ``file://`` does."""
    try:
        val_fraction = float(req.params.pop("val_fraction", "0.1"))
    except ValueError:
        raise DatasetError(f"{_redacted(req)}: val_fraction must be a number") from None
    if not 0 <= val_fraction < 1:
        raise DatasetError(f"{_redacted(req)}: val_fraction must be in [0, 1), got {val_fraction}")
    if fmt == "imagefolder":
        if not imagefolder.detect(root):
            raise DatasetError(f"{_redacted(req)}: no ImageFolder tree in {root}; expected {imagefolder.EXPECTED}")
        return images.open_images(req, imagefolder.ImageFolder(req.uri, root, val_fraction), fmt)
    cache = root.tree.client.cache
    where = (
        cache.root
        if cache is not None
        else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchbus"
    )
    strict = req.params.get("bad") != "skip"
    store = webdataset.open_object_shards(req.uri, root, where / "webdataset", val_fraction, strict=strict)
    return images.open_images(req, store, fmt)


def _read_toml(root: ObjectPath) -> dict:
    path = root / TOML
    if not path.is_file():
        return {}
    return parse_dataset_toml(root.tree.client.get_small(path.meta), str(path))


def _detect(root: ObjectPath, toml: dict) -> str:
    if raw.detect(toml):
        return "raw"
    for fmt in ("idx", "cifar10", "npy", "tokens"):
        if FORMATS[fmt][0](root):
            return fmt
    names = [p.name for p in root.iterdir()][:10]
    raise DatasetError(
        f"no known dataset layout in {root}: expected Parquet files, a dataset.toml, IDX or CIFAR-10 "
        f"batches, .npy pairs or token shards; found {', '.join(names) or 'nothing'}"
    )

"""``hf://datasets/ORG/NAME[@REVISION][/PATH]``: a dataset repository on the Hugging Face Hub, its files read
by range where they are, without a download or a conversion.

The location part only: the repository (or ``PATH`` in it) is listed once at open, at the commit the
revision names then (a branch that moves later does not mix two versions into one dataset; DatasetInfo
says which commit), and its files are read by byte range through the same client as ``s3://``
(:mod:`.objstore`: bounded concurrency, retries with backoff under each batch's deadline, the provider's
disk cache of blocks, counters). The layout is found as for any prefix: the Hub's Parquet files are the
Parquet layout (``data/train-*.parquet``, ``SUBSET/train/*.parquet`` as ``@refs%2Fconvert%2Fparquet``
holds them, ``validation``/``test`` likewise; docs/datasets.md §5), and every other layout a bucket
serves is served from a repository too.

The client is ``huggingface_hub`` (the maintained one): ``HfFileSystem`` lists the repository and
``HfApi`` resolves the revision; a batch's ranged reads are the ``GET``s ``HfFileSystem``'s files make
(``hf_hub_url``, the library's session and headers), sent once each because :class:`~.storage.objects.ObjectClient`
retries with the batch's deadline in view. Credentials from the standard places only: ``HF_TOKEN``, else
the token file ``hf auth login`` writes (``HF_TOKEN_PATH``, ``$HF_HOME/token``); the endpoint from
``HF_ENDPOINT`` (a mirror, or the tests' loopback server). A revision with a ``/`` in it is written quoted,
as the Hub's own ``hf://`` paths are (``@refs%2Fconvert%2Fparquet``); ``refs/convert/NAME`` and
``refs/pr/N`` are also read unquoted.

URI parameters: those of ``s3://`` (:mod:`.objstore`) and of the layout.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlsplit

from libbus.errors import DatasetError

from .base import OpenRequest, Source, SourceInfo
from .layouts import open_layout
from .objstore import ObjectLocation
from .storage.objects import RETRY_STATUSES, ObjectError, ObjectMeta

__all__ = ["HfBackend", "HfLocation", "open_hf_source", "parse_hf_uri"]

AUTH_HELP = "HF_TOKEN, or the token file `hf auth login` writes (HF_TOKEN_PATH, $HF_HOME/token)"
DEFAULT_ENDPOINT = "https://huggingface.co"


def _hub() -> Any:
    try:
        import huggingface_hub
    except ImportError as err:
        raise DatasetError("hf:// datasets need huggingface_hub: pip install 'batchbus[hf]'") from err
    return huggingface_hub


def parse_hf_uri(req: OpenRequest) -> tuple[str, str, str]:
    """``hf://datasets/ORG/NAME[@REV][/PATH]`` → (``ORG/NAME``, revision or ``main``, path in the repo)."""
    where = f"hf://{req.parts.netloc}{req.parts.path}"
    parts = [p for p in req.parts.path.split("/") if p]
    if req.parts.netloc != "datasets" or len(parts) < 2:
        raise DatasetError(
            f"{where}: expected hf://datasets/ORG/NAME[@REVISION][/PATH] (a dataset repository; "
            "models and spaces are not datasets)"
        )
    org, name, rest = parts[0], parts[1], parts[2:]
    revision = "main"
    if "@" in name:
        name, revision = name.split("@", 1)
        revision = unquote(revision)
        if revision == "refs" and len(rest) >= 2 and rest[0] in ("convert", "pr"):
            revision, rest = f"refs/{rest[0]}/{rest[1]}", rest[2:]
    if not name or not revision:
        raise DatasetError(f"{where}: expected hf://datasets/ORG/NAME[@REVISION][/PATH]")
    return f"{org}/{name}", revision, "/".join(rest)


class HfBackend:
    """One dataset repository at one commit, through ``huggingface_hub``; an :class:`~.storage.objects.ObjectBackend`."""

    def __init__(self, repo_id: str, revision: str, timeout_s: float):
        hub = _hub()
        self._hub = hub
        self.repo_id, self.timeout_s = repo_id, timeout_s
        self.endpoint = (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        self.host = urlsplit(self.endpoint).netloc
        self.name = f"hf://datasets/{repo_id}@{revision}"
        self.fs = hub.HfFileSystem(endpoint=self.endpoint, skip_instance_cache=True)
        try:
            self.commit = hub.HfApi(endpoint=self.endpoint).dataset_info(repo_id, revision=revision).sha
        except Exception as err:  # noqa: BLE001 - the library's errors have several types
            raise self._error("INFO", "", err) from None
        if not self.commit:
            raise DatasetError(f"{self.name}: the Hub named no commit for revision {revision!r}")
        self._root = f"datasets/{repo_id}@{self.commit}"

    def _error(self, op: str, what: str, err: BaseException) -> ObjectError:
        hub = self._hub
        response = getattr(err, "response", None)
        status = getattr(response, "status_code", None)
        where = f"{op} {self.name}{'/' if what else ''}{what}"
        if isinstance(err, hub.errors.RevisionNotFoundError):
            return ObjectError(f"{where}: no such revision in {self.repo_id} (a branch, tag or commit)", status)
        if isinstance(err, hub.errors.RepositoryNotFoundError) or status in (401, 403):
            return ObjectError(
                f"{where}: not found, or private and not readable with the provider's token: check that "
                f"{self.repo_id} is a dataset repository on {self.endpoint} and the token ({AUTH_HELP})",
                status,
            )
        if isinstance(err, hub.errors.EntryNotFoundError | FileNotFoundError) or status == 404:
            return ObjectError(f"{where}: not found (404)", status)
        if status is not None:
            return ObjectError(f"{where}: HTTP {status}", status, retryable=status in RETRY_STATUSES)
        # no status: a connection or timeout error (retryable); its first line names no token
        line = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        return ObjectError(f"{where}: {line}", None, retryable=True)

    @staticmethod
    def _meta(entry: dict, key: str) -> ObjectMeta:
        lfs = entry.get("lfs") or {}
        # content-addressed: the LFS sha256 or git's blob id, so the disk cache never serves old bytes
        return ObjectMeta(
            key, int(entry.get("size") or 0), lfs.get("sha256") or lfs.get("oid") or entry.get("blob_id") or ""
        )

    def _key(self, path: str) -> str:
        return path[len(self._root) + 1 :] if path.startswith(self._root + "/") else path

    def list(self, prefix: str) -> list[ObjectMeta]:
        target = f"{self._root}/{prefix.rstrip('/')}" if prefix.strip("/") else self._root
        try:
            found = self.fs.find(target, detail=True)
        except Exception as err:  # noqa: BLE001
            raise self._error("LIST", prefix, err) from None
        return [self._meta(e, self._key(p)) for p, e in sorted(found.items()) if e.get("type") == "file"]

    def head(self, key: str) -> ObjectMeta:
        try:
            entry = self.fs.info(f"{self._root}/{key}")
        except Exception as err:  # noqa: BLE001
            raise self._error("HEAD", key, err) from None
        return self._meta(entry, key)

    def get_range(self, key: str, start: int, end: int, etag: str) -> memoryview:
        # the commit pins the bytes: no If-Match (the Hub's ETags are not the listing's ids)
        hub = self._hub
        url = hub.hf_hub_url(self.repo_id, key, repo_type="dataset", revision=self.commit, endpoint=self.endpoint)
        headers = {**hub.utils.build_hf_headers(), "Range": f"bytes={start}-{end - 1}"}
        what = f"{key} (bytes {start}-{end - 1})"
        try:
            response = hub.get_session().get(url, headers=headers, timeout=self.timeout_s)
            hub.utils.hf_raise_for_status(response)
        except Exception as err:  # noqa: BLE001
            raise self._error("GET", what, err) from None
        data = response.content
        if response.status_code == 200 and len(data) > end - start:  # a server that ignores Range
            data = data[start:end]
        if len(data) != end - start:
            raise ObjectError(
                f"GET {self.name}/{what}: {len(data)} bytes came back", response.status_code, retryable=True
            )
        return memoryview(data)


class HfLocation(ObjectLocation):
    """A Hub dataset repository (or a folder of it) as an object-store prefix."""

    def open_backend(self, req: OpenRequest, timeout_s: float) -> tuple[HfBackend, str]:
        repo_id, revision, path = parse_hf_uri(req)
        self.hf = HfBackend(repo_id, revision, timeout_s)
        return self.hf, path

    def info(self) -> SourceInfo:
        return {"store": "hf", "repo": self.hf.repo_id, "revision": self.hf.commit}


def open_hf_source(req: OpenRequest) -> Source:
    """Open the dataset in a Hub repository, popping the ``params`` it knows.

    Raises :class:`DatasetError` for a URI that names no dataset repository or carries a credential, a
    repository or revision not found (or not readable with the token), an unknown layout or a bad parameter.
    """
    return open_layout(HfLocation(req))

"""Final models kept by the router (``artifact_dir``), so that ``busctl job model`` works after the
trainer that made one has gone: ``<artifact_dir>/<job>/model.safetensors``, checked against the
sha256 the trainer reported and written atomically before the result is acknowledged."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from libbus.errors import BadRequest, NotFound
from services.atomic import write_atomic

__all__ = ["Artifacts"]

_JOB_ID = re.compile(r"^j[0-9a-f]{10}$")


class Artifacts:
    """The router's copies of final models, one directory per job."""

    def __init__(self, directory: str):
        self.directory = Path(directory)

    def _path(self, job: str) -> Path:
        if not _JOB_ID.match(job):  # ids are the store's own; anything else must not name a path
            raise NotFound(f"no model for job {job!r}")
        return self.directory / job / "model.safetensors"

    def put(self, job: str, data: bytes | memoryview, sha256: str) -> str:
        """Store a job's final weights; raises :class:`BadRequest` when ``data`` is not what the
        trainer's sha256 says. Returns the path."""
        digest = hashlib.sha256(data).hexdigest()
        if digest != sha256:
            raise BadRequest(
                f"model of job {job}: the bytes have sha256 {digest[:12]}…, the result says {sha256[:12]}…"
            )
        path = self._path(job)
        write_atomic(path, data)
        return str(path)

    def get(self, job: str) -> bytes:
        """The weights of ``job``; :class:`NotFound` when the router has none."""
        try:
            return self._path(job).read_bytes()
        except FileNotFoundError as err:
            raise NotFound(f"the router holds no model for job {job}") from err

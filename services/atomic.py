"""Files written so that a crash leaves the old version or the new one, never half of one."""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: Path, data: bytes | memoryview) -> str:
    """Write ``data`` to ``path`` (temporary file in the same directory, fsync, rename, fsync of the
    directory); returns the sha256 of ``data``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself is durable once the directory is
    finally:
        os.close(fd)
    return hashlib.sha256(data).hexdigest()

"""Files written so that a crash leaves the old version or the new one, never half of one."""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

__all__ = ["write_atomic"]


def _private_dirs(directory: Path) -> None:
    """Create ``directory`` and its missing parents with mode 0700 (whatever the umask)."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            continue
        os.chmod(d, 0o700)


def write_atomic(path: Path, data: bytes | memoryview) -> str:
    """Write ``data`` to ``path`` (temporary file in the same directory, fsync, rename, fsync of the
    directory); returns the sha256 of ``data``.

    The file is created 0600 and directories it creates 0700, whatever the umask: checkpoints and
    models are the owner's data, not the host's (outside systemd's ``UMask=0077`` too)."""
    path = Path(path)
    _private_dirs(path.parent)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as fh:
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

"""Confinement: the files a ``file://`` dataset names really lie under its directory (docs/security.md §8).

A ``dataset.toml`` entry, a symlinked file, class folder or shard must not make the provider serve what
lies elsewhere (the cluster secret, ``/etc``): a path is checked as it really is, symlinks resolved
(for an open file, as opened, through ``/proc/self/fd``), against the dataset's directory and what the
provider's operator allows on the URI (``?allow_paths=DIR,...``); a dataset's own files cannot allow.
"""

from __future__ import annotations

import os
from pathlib import Path

from libbus.errors import DatasetError

__all__ = ["Confinement"]


class Confinement:
    """Where the files of the dataset in ``root`` may really be: ``allowed`` (symlinks resolved), or
    anywhere when ``allowed`` is empty."""

    def __init__(self, root: Path, allowed: tuple[Path, ...] = ()):
        self.root = root
        self.allowed = tuple(Path(os.path.realpath(p)) for p in allowed)

    def check(self, path: Path, real: Path | None = None) -> None:
        """Refuse ``path`` unless it (``real``: what it really is; default: resolved now) lies in an
        allowed place. Raises :class:`DatasetError` naming both."""
        if not self.allowed:
            return
        real = Path(os.path.realpath(path)) if real is None else real
        if not any(real == a or a in real.parents for a in self.allowed):
            raise DatasetError(
                f"{path}: is really {real}, outside the dataset's directory {self.root}; "
                "a provider serves files elsewhere only when its operator allows them "
                "(?allow_paths=DIR on the dataset's URI)"
            )

    def check_fd(self, path: Path, fd: int) -> None:
        """:meth:`check` on the file ``fd`` really is, as opened (no race with a swapped symlink)."""
        if self.allowed:
            self.check(path, Path(os.readlink(f"/proc/self/fd/{fd}")))

    def open(self, path: Path) -> int:
        """``path`` opened read-only, once checked. Raises :class:`DatasetError` (the fd closed)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise DatasetError(f"{path}: cannot open it: {err.strerror}") from None
        try:
            self.check_fd(path, fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

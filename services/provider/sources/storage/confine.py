"""Confinement: the files a ``file://`` dataset names really lie under its directory (docs/security.md §8).

A ``dataset.toml`` entry, a symlinked file, class folder or shard must not make the provider serve what
lies elsewhere (the cluster secret, ``/etc``): a path is checked as it really is, symlinks resolved
(for an open file, as opened, through ``/proc/self/fd``), against the dataset's directory and what the
provider's operator allows on the URI (``?allow_paths=DIR,...``); a dataset's own files cannot allow.

A hard link has no "real" path to resolve: a file linked into the directory from elsewhere (the cluster
secret, another user's data) is the same inode under a name that lies inside. So a regular file with
more than one link is refused (the check is on the file as opened, by ``fstat``), unless the operator
says the dataset's links are theirs (``?allow_hardlinks=1`` on the URI; a dataset.toml cannot).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from libbus.errors import DatasetError

__all__ = ["Confinement"]


class Confinement:
    """Where the files of the dataset in ``root`` may really be: ``allowed`` (symlinks resolved), or
    anywhere when ``allowed`` is empty."""

    def __init__(self, root: Path, allowed: tuple[Path, ...] = (), hardlinks: bool = False):
        self.root = root
        self.allowed = tuple(Path(os.path.realpath(p)) for p in allowed)
        #: The operator allows regular files with several links (``?allow_hardlinks=1``).
        self.hardlinks = hardlinks

    def check(self, path: Path, real: Path | None = None) -> None:
        """Refuse ``path`` unless it (``real``: what it really is; default: resolved now) lies in an
        allowed place and, when it is resolved here, is not a hard-linked file. Raises
        :class:`DatasetError` naming both."""
        if not self.allowed:
            return
        resolved = real is None
        real = Path(os.path.realpath(path)) if real is None else real
        if not any(real == a or a in real.parents for a in self.allowed):
            raise DatasetError(
                f"{path}: is really {real}, outside the dataset's directory {self.root}; "
                "a provider serves files elsewhere only when its operator allows them "
                "(?allow_paths=DIR on the dataset's URI)"
            )
        if resolved:
            try:
                st = os.stat(real)
            except OSError:
                return  # a missing file is its opener's to name
            self._check_links(path, st)

    def check_fd(self, path: Path, fd: int) -> None:
        """:meth:`check` on the file ``fd`` really is, as opened (no race with a swapped symlink or
        a link made after the check)."""
        if self.allowed:
            self.check(path, Path(os.readlink(f"/proc/self/fd/{fd}")))
            self._check_links(path, os.fstat(fd))

    def _check_links(self, path: Path, st: os.stat_result) -> None:
        if self.hardlinks or not stat.S_ISREG(st.st_mode) or st.st_nlink <= 1:
            return
        raise DatasetError(
            f"{path}: is a hard link ({st.st_nlink} names for one file), which may be a file from outside "
            f"the dataset's directory {self.root}; copy it in, or, if every link is the operator's, "
            "allow them with ?allow_hardlinks=1 on the dataset's URI"
        )

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

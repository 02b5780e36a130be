"""A POSIX shared-memory segment: a ``/dev/shm`` file mapped into this process.

We ``open`` + ``mmap`` the file ourselves instead of using ``multiprocessing.shared_memory``: its
resource tracker unlinks segments when *any* process that touched them exits, so an attaching
provider would delete its trainer's ring. Here the rule is simple: the creator unlinks, attachers
only close.

A fresh ``/dev/shm`` file has no pages: every 4 KiB of a ring slot would cost a page fault
(allocate and zero) on its first write in the provider and another (map) on its first read in the
trainer, about 750 per 3 MB slot, all paid inside the first pass over the ring. So the creator
allocates the pages up front (``posix_fallocate``, which also turns a full ``/dev/shm`` into an
error here rather than a SIGBUS on some later write) and maps them present (``MAP_POPULATE``), and
an attacher maps a segment's pages in with :meth:`Segment.populate` once it has checked the segment
(only pages that exist: it never allocates on behalf of whoever created the file).

A file shrunk under a mapping (``ftruncate`` by anyone who can write it: the trainer's own user) turns
every access past its new end into SIGBUS, which kills the process. So an attacher keeps the file open
and :meth:`Segment.check_size` compares its size (``fstat``) with the mapping before the memory is
touched: the provider calls it before each access to a ring (:mod:`.ring`), and refuses a shrunk one.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
from pathlib import Path

from shm.errors import ShmError

from .names import SHM_DIR, path_of

__all__ = ["Segment"]

log = logging.getLogger(__name__)

#: ``mmap`` flag: map with the pages present (Linux); 0 where the platform has none.
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
#: ``madvise`` advice (Linux 5.14+): fault the range in writable now, as a write to each page would.
_MADV_POPULATE_WRITE = 23


class Segment:
    """A mapped segment. ``owner`` is true for the process that created it (and only it unlinks).

    Use :meth:`create` or :meth:`attach`. ``buf`` is the mapping (an ``mmap``); views of it keep it
    alive, so :meth:`close` never unmaps memory that a tensor still points into.
    """

    def __init__(
        self, name: str, path: Path, buf: mmap.mmap, owner: bool, allocated: bool = True, fd: int | None = None
    ):
        self.name = name
        self.path = path
        self.buf: mmap.mmap | None = buf
        self.size = len(buf)
        self.owner = owner
        #: Every page of the file exists (``st_blocks`` covers its size): populating maps, never allocates.
        self.allocated = allocated
        #: An attacher's open file, for :meth:`check_size` (``None`` for the creator, or once closed).
        self._fd = fd

    @classmethod
    def create(cls, name: str, size: int, shm_dir: Path = SHM_DIR) -> Segment:
        """Create segment ``name`` of ``size`` zeroed bytes, mode 0600. Raises :class:`ShmError`."""
        path = path_of(name, shm_dir)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as err:
            raise ShmError(f"cannot create shared memory {path}: {err.strerror}") from err
        try:
            os.fchmod(fd, 0o600)  # whatever the umask said
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED | _MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as err:
            os.unlink(path)
            raise ShmError(f"cannot size shared memory {path} to {size} bytes: {err}") from err
        finally:
            os.close(fd)
        return cls(name, path, buf, owner=True)

    @classmethod
    def attach(cls, name: str, shm_dir: Path = SHM_DIR) -> Segment:
        """Map an existing segment that this user owns and nobody else can read.

        Raises :class:`ShmError` for a bad name, a missing file (another host, or its owner is
        gone), a file that is not a private regular file of this user, or an empty one.
        """
        try:
            path = path_of(name, shm_dir)
        except ValueError as err:
            raise ShmError(str(err)) from err
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ShmError(f"no shared memory {path} on this host (another host, or its owner is gone)") from None
        except OSError as err:
            raise ShmError(f"cannot open shared memory {path}: {err.strerror}") from err
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ShmError(f"{path} is not a regular file")
            if st.st_uid != os.geteuid():
                raise ShmError(f"{path} belongs to uid {st.st_uid}, not to this service's uid {os.geteuid()}")
            if st.st_mode & 0o077:
                raise ShmError(f"{path} has mode {stat.S_IMODE(st.st_mode):o}; a ring must be 0600")
            if st.st_size == 0:
                raise ShmError(f"{path} is empty")
            buf = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, path, buf, owner=False, allocated=st.st_blocks * 512 >= st.st_size, fd=fd)

    def check_size(self) -> None:
        """Raise :class:`ShmError` unless the attached file still covers the whole mapping (a
        segment its creator or another process of its user shrank: touching the lost part would
        kill this process with SIGBUS). A no-op for the creator."""
        if self._fd is None:
            if self.buf is None:
                raise ShmError(f"shared memory {self.name} is closed")
            return
        size = os.fstat(self._fd).st_size
        if size < self.size:
            raise ShmError(
                f"{self.path} was shrunk to {size} bytes after it was attached ({self.size} mapped); "
                "nothing more is written into it"
            )

    def mapping(self) -> mmap.mmap:
        """The live mapping. Raises :class:`ShmError` once the segment is closed."""
        if self.buf is None:
            raise ShmError(f"shared memory {self.name} is closed")
        return self.buf

    def populate(self) -> bool:
        """Map every page of an attached segment into this process now, so that the first write
        into each costs no fault. Only for a fully allocated segment (as :meth:`create` makes
        them): a sparse one is left to fault page by page, so attaching never allocates memory.
        Returns whether the pages were mapped (False also on a kernel without the advice)."""
        if self.buf is None or not self.allocated or not hasattr(self.buf, "madvise"):
            return False
        try:
            self.buf.madvise(_MADV_POPULATE_WRITE)
        except OSError:
            return False  # before Linux 5.14: the pages fault in on first use, as before
        return True

    def close(self) -> None:
        """Unmap, unless views are alive: then the mapping goes when the last view does."""
        buf, self.buf = self.buf, None
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        if buf is None:
            return
        try:
            buf.close()
        except BufferError:
            # Tensors still view this memory. Dropping our reference is enough: the mmap object
            # lives exactly as long as they do and unmaps itself after.
            log.debug("shared memory %s still has live views; unmapped when they go", self.name)

    def unlink(self) -> None:
        """Remove the name (creator only). Mappings stay valid until closed."""
        if not self.owner:
            raise ShmError(f"{self.name}: only the process that created a segment unlinks it")
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass  # gc'd by someone who thought we were gone, or unlinked twice: either way, gone

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self.owner:
            self.unlink()

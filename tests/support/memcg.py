"""A memory cgroup of the tests' own (cgroup v2 or v1's memory controller, as root): processes put in
it share a limit, and the kernel's out-of-memory killer picks its victim among them only."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["memory_cgroup"]


def _parent() -> tuple[Path, str, str] | None:
    """(directory new groups go under, the limit file's name, the member file's name), or None."""
    unified = Path("/sys/fs/cgroup")
    if (unified / "cgroup.controllers").exists() and "memory" in (unified / "cgroup.subtree_control").read_text():
        own = Path("/proc/self/cgroup").read_text().splitlines()[0].split("::", 1)[-1]
        return unified / own.lstrip("/"), "memory.max", "cgroup.procs"
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes", "cgroup.procs"
    return None


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[Path]:
    """A fresh memory cgroup limited to ``limit_bytes``; write a pid to ``<it>/cgroup.procs`` to put
    a process (and the children it starts afterwards) in it. Skips the test where none can be made."""
    found = _parent() if os.geteuid() == 0 else None
    if found is None:
        pytest.skip("no memory cgroup can be made here (needs root and a cgroup memory controller)")
    parent, limit_file, _ = found
    group = parent / f"batchbus-test-{secrets.token_hex(4)}"
    try:
        group.mkdir()
        (group / limit_file).write_text(str(limit_bytes))
    except OSError as err:
        pytest.skip(f"cannot make a memory cgroup under {parent}: {err}")
    try:
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():  # whatever is left goes back up
            with contextlib.suppress(OSError):
                (parent / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            group.rmdir()

"""Segment names and owners: the one place that makes, parses and checks ring names.

A ring's name is ``batchbus-<pid>-<16 hex digits>``: the creator's pid, so that ``busctl shm gc``
can tell whose it is, and 64 random bits, so that no other user can guess it. Names never hold a
``/``: a peer that sends one is refused before any path is built from it.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

__all__ = ["PREFIX", "SHM_DIR", "new_name", "parse_name", "path_of", "pid_alive", "process_start"]

#: Where POSIX shared memory lives on Linux; ``shm_open(name)`` is ``open("/dev/shm/" + name)``.
SHM_DIR = Path("/dev/shm")
PREFIX = "batchbus"
_NAME = re.compile(rf"^{PREFIX}-([1-9][0-9]{{0,9}})-([0-9a-f]{{16}})$")


def new_name(pid: int | None = None) -> str:
    """A fresh, unguessable segment name carrying ``pid`` (default: this process)."""
    return f"{PREFIX}-{pid or os.getpid()}-{secrets.token_hex(8)}"


def parse_name(name: str) -> int | None:
    """The owner pid a ring name carries, or ``None`` if ``name`` is not a batchbus ring name."""
    match = _NAME.fullmatch(name)  # fullmatch: "$" alone would accept a trailing newline
    return int(match.group(1)) if match else None


def path_of(name: str, shm_dir: Path = SHM_DIR) -> Path:
    """The file behind ring ``name``. Raises ``ValueError`` for anything but a ring name."""
    if parse_name(name) is None:
        raise ValueError(f"{name!r} is not a batchbus ring name ({PREFIX}-<pid>-<16 hex digits>)")
    return shm_dir / name


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or ``None`` if there is no such process.

    A pid alone is not an identity: pids are reused. The start time, recorded in the ring header by
    its creator, tells the creator apart from a later process that got the same pid.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])  # field 22 of stat(5), counting from field 3 here


def pid_alive(pid: int, start: int | None = None) -> bool:
    """Whether ``pid`` runs, and, given ``start``, is still the process that started then."""
    now = process_start(pid)
    if now is None:
        return False
    return start is None or start == 0 or now == start

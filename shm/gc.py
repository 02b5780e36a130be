"""Finding and removing rings whose owner is gone (``busctl shm ls|gc``, service start-up)."""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from .names import PREFIX, SHM_DIR, parse_name, pid_alive
from .ring import read_header

__all__ = ["SegmentInfo", "collect_garbage", "list_segments"]


@dataclass(frozen=True)
class SegmentInfo:
    """One ring file in the shared-memory directory, and whether its creator still runs."""

    name: str
    path: Path
    size: int
    pid: int
    alive: bool
    age_s: float
    slots: int
    slot_bytes: int

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "size": self.size,
            "pid": self.pid,
            "alive": self.alive,
            "age_s": round(self.age_s, 1),
            "slots": self.slots,
            "slot_bytes": self.slot_bytes,
        }


def list_segments(shm_dir: Path = SHM_DIR) -> list[SegmentInfo]:
    """Every batchbus ring under ``shm_dir``, oldest first."""
    out = []
    now = time.time()
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return []
    for entry in entries:
        if not entry.name.startswith(PREFIX + "-"):
            continue
        pid = parse_name(entry.name)
        if pid is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue  # removed while we looked
        if not stat.S_ISREG(st.st_mode):
            continue  # a ring is a regular file: a link, FIFO or directory with our prefix is not ours
        header = read_header(Path(entry.path)) or {}
        # The header's start time tells the creator apart from a later process with its pid;
        # a ring we cannot read (another user's) is judged by its pid alone.
        alive = pid_alive(pid, header.get("start")) if header.get("pid", pid) == pid else False
        out.append(
            SegmentInfo(
                entry.name,
                Path(entry.path),
                st.st_size,
                pid,
                alive,
                now - st.st_mtime,
                header.get("slots", 0),
                header.get("slot_bytes", 0),
            )
        )
    return sorted(out, key=lambda s: -s.age_s)


def collect_garbage(shm_dir: Path = SHM_DIR) -> list[SegmentInfo]:
    """Unlink every ring whose creator is gone; returns what was removed."""
    removed = []
    for seg in list_segments(shm_dir):
        if seg.alive:
            continue
        try:
            os.unlink(seg.path)
        except FileNotFoundError:
            continue
        except OSError:
            continue  # not ours to remove (another user's): ls still shows it
        removed.append(seg)
    return removed

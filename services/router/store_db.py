"""The router's job database file: its schema, and when its writes reach the disk.

Every write commits before the router acknowledges it. How it is made durable:

- Standalone (tests, tools): state transitions commit with ``synchronous=FULL`` (an fsync of the WAL
  each); progress reports and lease renewals commit without one (:meth:`Durability.relaxed`).
- Grouped (the running router, :meth:`Durability.group`): every commit is ``synchronous=NORMAL``
  (written to the WAL, not synced), and :meth:`Durability.sync` fsyncs the WAL once at the end of
  the loop turn, before the turn's replies go out (libbus/server.py holds them until the handler's
  ``flush``). That is what ``FULL`` does at each commit (``NORMAL`` plus an fsync of the WAL), once
  for all of a turn's transitions: group commit. A router killed or a machine losing power after a
  reply went out still has what it acknowledged; one that dies before the sync has acknowledged
  nothing of that turn. Progress-only turns (no transition) still need no fsync.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ADDED_COLUMNS", "INDEXES", "SCHEMA", "Durability"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id        TEXT PRIMARY KEY,
    spec      TEXT NOT NULL,
    state     TEXT NOT NULL,
    priority  INTEGER NOT NULL DEFAULT 0,
    trainer   TEXT,
    attempts  INTEGER NOT NULL DEFAULT 0,
    created   REAL NOT NULL,
    updated   REAL NOT NULL,
    progress  TEXT,
    result    TEXT,
    error     TEXT
);
CREATE INDEX IF NOT EXISTS jobs_queue ON jobs (state, priority DESC, created);
CREATE INDEX IF NOT EXISTS jobs_created ON jobs (created);
CREATE INDEX IF NOT EXISTS jobs_trainer ON jobs (trainer);
CREATE TABLE IF NOT EXISTS events (
    job    TEXT NOT NULL,
    at     REAL NOT NULL,
    state  TEXT NOT NULL,
    reason TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_job ON events (job, at);
CREATE TABLE IF NOT EXISTS progress (
    job      TEXT NOT NULL,
    at       REAL NOT NULL,
    progress TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS progress_job ON progress (job, at);
CREATE TABLE IF NOT EXISTS checkpoints (
    job     TEXT NOT NULL,
    at      REAL NOT NULL,
    trainer TEXT NOT NULL,
    step    INTEGER NOT NULL,
    epoch   INTEGER NOT NULL,
    path    TEXT NOT NULL,
    sha256  TEXT NOT NULL,
    record  TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS checkpoints_job ON checkpoints (job, step);
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
"""

#: Columns added to ``jobs`` after the first release; a database made before gets them on open.
ADDED_COLUMNS = {
    "lease_expires": "REAL",
    "failures": "INTEGER NOT NULL DEFAULT 0",
    "checkpoint": "TEXT",
    "gang": "TEXT",
}


#: Indexes on columns of :data:`ADDED_COLUMNS` (made once they exist): the gang check of every
#: ``GetTask`` reads the held gang jobs, not every held job.
INDEXES = "CREATE INDEX IF NOT EXISTS jobs_gang ON jobs (state) WHERE gang IS NOT NULL"


class Durability:
    """When the commits of ``db`` (a WAL database at ``path``) are fsynced; see the module's docstring."""

    def __init__(self, db: sqlite3.Connection, path: str):
        self.db = db
        self.wal = path + "-wal"
        self.grouped = False
        #: ``db.total_changes`` when everything committed so far was durable (or needed not be).
        self._synced = db.total_changes
        #: fsyncs :meth:`sync` made (for statistics and tests).
        self.syncs = 0

    def group(self) -> None:
        """Commit without an fsync from now on; :meth:`sync` (once a turn) makes the commits durable."""
        self.sync_now()
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.grouped = True

    @property
    def pending(self) -> bool:
        """Whether something committed since the last sync needs one."""
        return self.grouped and self.db.total_changes != self._synced

    def sync(self) -> None:
        """Make every commit so far durable: one fsync of the WAL, when one needs it."""
        if self.pending:
            self.sync_now()

    def sync_now(self) -> None:
        changes = self.db.total_changes
        if os.path.exists(self.wal):
            fd = os.open(self.wal, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self.syncs += 1
        self._synced = changes

    @contextmanager
    def relaxed(self) -> Iterator[None]:
        """A transaction that needs no fsync of its own (progress reports, lease renewals): a killed
        router still has it (the WAL is written before the commit returns); a power cut may lose the
        last few before the next synced commit, and a restarted router renews every lease anyway."""
        clean = self.db.total_changes == self._synced
        if not self.grouped:
            self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        finally:
            if not self.grouped:
                self.db.execute("PRAGMA synchronous=FULL")
        if clean:  # nothing else waits for a sync: this needs none
            self._synced = self.db.total_changes

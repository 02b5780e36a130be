"""The router's job database file: its schema, and when its writes reach the disk.

Every write commits before the router acknowledges it. How it is made durable:

- Standalone (tests, tools): state transitions commit with ``synchronous=FULL`` (an fsync of the WAL
  each); progress reports and lease renewals commit without one (``Durability.write(relaxed=True)``).
- Grouped (the running router, :meth:`Durability.group`): the writes of one turn of the router's
  loop are one transaction (each write a savepoint in it, so a refused one undoes only itself),
  which :meth:`Durability.sync` commits at the end of the turn (``synchronous=NORMAL``: written to
  the WAL) and then makes durable with one fsync of the WAL, before the turn's replies go out
  (libbus/serve/server.py holds them until the handler's ``flush``). That is what ``FULL`` does at a
  commit (``NORMAL`` plus an fsync of the WAL), once for all of a turn's writes: group commit. A
  router killed or a machine losing power after a reply went out still has what it acknowledged;
  one that dies before the sync has acknowledged nothing of that turn. A turn of progress reports
  only (no transition) commits without an fsync.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ADDED_COLUMNS", "INDEXES", "SCHEMA", "Durability", "savepoint"]

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
CREATE TABLE IF NOT EXISTS segments (
    job    TEXT NOT NULL,
    at     REAL NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS segments_job ON segments (job, at);
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
#: ``GetTask`` reads the held gang jobs, not every held job; early stopping's look twice a second
#: reads the held jobs with ``patience``, not every held job's spec (a thousand ``json_extract``s
#: were 3 ms of the loop at a thousand running jobs).
INDEXES = """
CREATE INDEX IF NOT EXISTS jobs_gang ON jobs (state) WHERE gang IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_watched ON jobs (state) WHERE json_extract(spec, '$.patience') > 0;
"""


@contextmanager
def savepoint(db: sqlite3.Connection) -> Iterator[None]:
    """One write of the other tables on the job database (studies, revocations), all or none: nested
    in the turn's transaction when the router has one open (a failure undoes this write only, never the
    turn's others), else a transaction of its own. :class:`Durability` counts it for the turn's fsync."""
    db.execute("SAVEPOINT other")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK TO other")
        db.execute("RELEASE other")
        raise
    db.execute("RELEASE other")


class Durability:
    """When the writes to ``db`` (a WAL database at ``path``) commit and reach the disk; see the
    module's docstring. Every writer of the job database goes through :meth:`write`."""

    def __init__(self, db: sqlite3.Connection, path: str):
        self.db = db
        self.wal = path + "-wal"
        self.grouped = False
        #: ``db.total_changes`` at the last sync, and the changes since that need no fsync (progress).
        self._synced = db.total_changes
        self._relaxed = 0
        #: fsyncs :meth:`sync` made (for statistics and tests).
        self.syncs = 0

    def group(self) -> None:
        """From now on the writes of a turn are one transaction, committed and fsynced by :meth:`sync`."""
        self._fsync()
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.grouped = True

    @property
    def pending(self) -> bool:
        """Whether something written since the last sync needs an fsync (a transition, not progress)."""
        return self.grouped and self.db.total_changes - self._synced > self._relaxed

    def sync(self) -> None:
        """The end of a turn: commit its transaction, and fsync the WAL once if a write needs it."""
        if not self.grouped:
            return
        if self.db.in_transaction:
            try:
                self.db.execute("COMMIT")
            except sqlite3.Error:
                if self.db.in_transaction:  # the turn's writes are undone: none was acknowledged
                    self.db.execute("ROLLBACK")
                raise
        if self.pending:
            self._fsync()
        self._synced, self._relaxed = self.db.total_changes, 0

    def _fsync(self) -> None:
        """What ``synchronous=FULL`` does at each commit: everything committed so far reaches the disk."""
        if os.path.exists(self.wal):
            fd = os.open(self.wal, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self.syncs += 1

    @contextmanager
    def write(self, relaxed: bool = False) -> Iterator[None]:
        """One write (several statements, all or none). Grouped: a savepoint in the turn's transaction
        (opened by the first write of the turn). Standalone: a transaction of its own, committed with an
        fsync unless ``relaxed`` (progress reports, lease renewals: a killed router still has them, the
        WAL being written before the commit returns; a power cut may lose the last few, and a restarted
        router renews every lease anyway)."""
        if self.grouped:
            with self._savepoint(relaxed):
                yield
            return
        if relaxed:
            self.db.execute("PRAGMA synchronous=NORMAL")
        try:
            with self.db:
                self.db.execute("BEGIN IMMEDIATE")
                yield
        finally:
            if relaxed:
                self.db.execute("PRAGMA synchronous=FULL")

    @contextmanager
    def _savepoint(self, relaxed: bool) -> Iterator[None]:
        if not self.db.in_transaction:
            self.db.execute("BEGIN IMMEDIATE")
        before = self.db.total_changes
        self.db.execute("SAVEPOINT write")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK TO write")
            self.db.execute("RELEASE write")
            raise
        self.db.execute("RELEASE write")
        if relaxed:
            self._relaxed += self.db.total_changes - before

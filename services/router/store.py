"""The router's job queue in SQLite (WAL; every write committed before it is acknowledged)."""

from __future__ import annotations

import secrets
import sqlite3
import time
from pathlib import Path
from typing import Callable

import orjson

from libbus.errors import BadRequest, ConfigError, NotFound
from libbus.jobs import JOB_STATES, TERMINAL_STATES, JobSpec

__all__ = ["JobStore"]

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
CREATE TABLE IF NOT EXISTS events (
    job    TEXT NOT NULL,
    at     REAL NOT NULL,
    state  TEXT NOT NULL,
    reason TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_job ON events (job, at);
"""


class JobStore:
    """Jobs and their state transitions. Used by the router's single loop thread."""

    def __init__(self, path: str):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        try:
            # One thread uses the store at a time (the router loop), though not the one that opened it.
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.executescript(SCHEMA)
        except sqlite3.DatabaseError as err:
            raise ConfigError(f"job database {path}: {err}") from err
        self.db.row_factory = sqlite3.Row
        self.path = path

    def close(self) -> None:
        self.db.close()

    def _transition(self, job: str, state: str, reason: str, **fields) -> None:
        now = time.time()
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute(f"UPDATE jobs SET state = ?, updated = ?{', ' + sets if sets else ''} WHERE id = ?",
                            (state, now, *fields.values(), job))
            self.db.execute("INSERT INTO events VALUES (?, ?, ?, ?)", (job, now, state, reason))

    def submit(self, spec: JobSpec) -> str:
        job = "j" + secrets.token_hex(5)
        now = time.time()
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute("INSERT INTO jobs (id, spec, state, priority, created, updated) "
                            "VALUES (?, ?, 'queued', ?, ?, ?)",
                            (job, orjson.dumps(spec.to_dict()).decode(), spec.priority, now, now))
            self.db.execute("INSERT INTO events VALUES (?, ?, 'queued', 'submitted')", (job, now))
        return job

    def _row(self, job: str) -> sqlite3.Row:
        row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job,)).fetchone()
        if row is None:
            raise NotFound(f"no job {job!r}; 'busctl jobs' lists them")
        return row

    @staticmethod
    def _as_dict(row: sqlite3.Row) -> dict:
        out = dict(row)
        for key in ("spec", "progress", "result"):
            out[key] = orjson.loads(out[key]) if out[key] else None
        return out

    def get(self, job: str, events: bool = True) -> dict:
        out = self._as_dict(self._row(job))
        if events:
            rows = self.db.execute("SELECT at, state, reason FROM events WHERE job = ? ORDER BY at, rowid",
                                   (job,)).fetchall()
            out["events"] = [dict(r) for r in rows]
        return out

    def list(self, state: str | None = None, limit: int = 100) -> list[dict]:
        if state is not None and state not in JOB_STATES:
            raise BadRequest(f"unknown state {state!r}; expected one of {', '.join(JOB_STATES)}")
        limit = max(1, min(limit, 10000))
        if state:
            rows = self.db.execute("SELECT * FROM jobs WHERE state = ? ORDER BY created DESC LIMIT ?",
                                   (state, limit))
        else:
            rows = self.db.execute("SELECT * FROM jobs ORDER BY created DESC LIMIT ?", (limit,))
        return [self._as_dict(r) for r in rows.fetchall()]

    def claim(self, trainer: str, accept: Callable[[dict], bool] | None = None) -> dict | None:
        """Hand the best queued job (priority, then age) that ``accept`` takes (given ``{id, spec}``)
        to ``trainer``; None when there is none."""
        now = time.time()
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            rows = self.db.execute("SELECT id, spec FROM jobs WHERE state = 'queued' "
                                   "ORDER BY priority DESC, created")
            row = next((r for r in rows if accept is None
                        or accept({"id": r["id"], "spec": orjson.loads(r["spec"])})), None)
            if row is None:
                return None
            self.db.execute("UPDATE jobs SET state = 'running', trainer = ?, attempts = attempts + 1, "
                            "updated = ? WHERE id = ?", (trainer, now, row["id"]))
            self.db.execute("INSERT INTO events VALUES (?, ?, 'running', ?)",
                            (row["id"], now, f"assigned to {trainer}"))
        return self.get(row["id"], events=False)

    def running(self) -> list[dict]:
        rows = self.db.execute("SELECT * FROM jobs WHERE state = 'running'").fetchall()
        return [self._as_dict(r) for r in rows]

    def set_progress(self, job: str, progress: dict) -> None:
        with self.db:
            self.db.execute("UPDATE jobs SET progress = ?, updated = ? WHERE id = ?",
                            (orjson.dumps(progress).decode(), time.time(), job))

    def finish(self, job: str, state: str, reason: str, result: dict | None = None, error: str = "") -> None:
        if state not in TERMINAL_STATES:
            raise BadRequest(f"a job ends {', '.join(TERMINAL_STATES)}, not {state!r}")
        self._transition(job, state, reason, result=orjson.dumps(result or {}).decode(), error=error)

    def requeue(self, job: str, reason: str) -> None:
        self._transition(job, "queued", reason, trainer=None)

"""Studies and their trials in the router's SQLite database (the job store's connection, tables of
their own). These rows are the study's truth: the Optuna study a router works with is rebuilt from
them when it starts (services/router/studies.py), so a router killed at any moment continues.

A trial row: its ``number`` in the study, its ``job`` (an ordinary job, named ``STUDY/NUMBER``), the
``params`` it was given, its ``state`` (``running``, ``pruning`` — a stop sent, not yet ended —
``pruned``, ``complete``, ``failed``, ``stopped``), the objective ``value`` and the ``reports``
(``{epoch: value}``) the pruner saw, and Optuna's ``attrs`` for the trial (its system attributes:
the rungs ASHA promoted it past, a grid point), so that a rebuilt study judges as the first did.
"""

from __future__ import annotations

import builtins
import secrets
import sqlite3
import time
from enum import StrEnum
from typing import Any, TypedDict, cast

import orjson

from libbus.errors import NotFound

from .store_db import savepoint

__all__ = ["StudyRow", "StudyState", "StudyStore", "TrialRow", "TrialState", "TRIAL_ENDED"]


class TrialRow(TypedDict):
    """A study's trial as the store keeps it (its ``trials`` row, JSON columns parsed)."""

    study: str
    number: int
    #: its job, once submitted
    job: str | None
    params: dict[str, Any]
    state: str
    value: float | None
    #: epoch → the objective reported then
    reports: dict[int, float]
    epochs: float
    attrs: dict[str, Any]
    updated: float


class StudyRow(TypedDict):
    """A study as the store keeps it (its ``studies`` row, its spec parsed) with its trials."""

    id: str
    spec: dict[str, Any]
    state: str
    created: float
    updated: float
    reason: str
    trials: list[TrialRow]


class StudyState(StrEnum):
    """Where a study is: trials still run (or are still to start), all ended, or stopped by an admin."""

    RUNNING = "running"
    COMPLETE = "complete"
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value


class TrialState(StrEnum):
    """Where a trial is; ``pruning``: its stop is sent and its job has not ended yet."""

    RUNNING = "running"
    PRUNING = "pruning"
    PRUNED = "pruned"
    COMPLETE = "complete"
    FAILED = "failed"
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value

    @property
    def live(self) -> bool:
        """Its job may still be running: the study follows it."""
        return self in (TrialState.RUNNING, TrialState.PRUNING)


TRIAL_ENDED = tuple(s for s in TrialState if not s.live)

SCHEMA = """
CREATE TABLE IF NOT EXISTS studies (
    id      TEXT PRIMARY KEY,
    spec    TEXT NOT NULL,
    state   TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    reason  TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS trials (
    study   TEXT NOT NULL,
    number  INTEGER NOT NULL,
    job     TEXT,
    params  TEXT NOT NULL,
    state   TEXT NOT NULL,
    value   REAL,
    reports TEXT NOT NULL DEFAULT '{}',
    epochs  REAL NOT NULL DEFAULT 0,
    attrs   TEXT NOT NULL DEFAULT '{}',
    updated REAL NOT NULL,
    PRIMARY KEY (study, number)
);
"""


class StudyStore:
    """Study and trial rows on ``db`` (autocommit; every write is its own transaction)."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db
        self.db.executescript(SCHEMA)

    def create(self, spec: dict) -> str:
        study = "s" + secrets.token_hex(4)
        now = time.time()
        with savepoint(self.db):
            self.db.execute(
                "INSERT INTO studies VALUES (?, ?, ?, ?, ?, '')",
                (study, orjson.dumps(spec).decode(), StudyState.RUNNING, now, now),
            )
        return study

    def set_state(self, study: str, state: StudyState, reason: str) -> None:
        with savepoint(self.db):
            self.db.execute(
                "UPDATE studies SET state = ?, reason = ?, updated = ? WHERE id = ?",
                (state, reason, time.time(), study),
            )

    def get(self, study: str) -> StudyRow:
        row = self.db.execute("SELECT * FROM studies WHERE id = ?", (study,)).fetchone()
        if row is None:
            raise NotFound(f"no study {study!r}; 'busctl studies' lists them")
        out = {**dict(row), "spec": orjson.loads(row["spec"]), "trials": self.trials(study)}
        return cast(StudyRow, out)  # the table's columns, its spec parsed, with its trials

    def list(self, state: str | None = None) -> list[StudyRow]:
        if state:
            rows = self.db.execute("SELECT id FROM studies WHERE state = ? ORDER BY created", (state,))
        else:
            rows = self.db.execute("SELECT id FROM studies ORDER BY created DESC")
        return [self.get(r[0]) for r in rows.fetchall()]

    def trials(self, study: str) -> builtins.list[TrialRow]:
        rows = self.db.execute("SELECT * FROM trials WHERE study = ? ORDER BY number", (study,)).fetchall()
        out: builtins.list[TrialRow] = []
        for r in rows:
            trial = dict(r)
            trial["params"] = orjson.loads(trial["params"])
            trial["attrs"] = orjson.loads(trial["attrs"])
            trial["reports"] = {int(k): v for k, v in orjson.loads(trial["reports"]).items()}
            out.append(cast(TrialRow, trial))  # the table's columns, its JSON ones parsed
        return out

    def add_trial(self, study: str, number: int, params: dict) -> None:
        """A trial asked for, its job not yet submitted (``job`` NULL)."""
        with savepoint(self.db):
            self.db.execute(
                "INSERT INTO trials (study, number, params, state, updated) VALUES (?, ?, ?, ?, ?)",
                (study, number, orjson.dumps(params).decode(), TrialState.RUNNING, time.time()),
            )

    def update_trial(self, study: str, number: int, **fields) -> None:
        """Change ``job``, ``state``, ``value``, ``reports``, ``epochs``, ``params`` or ``attrs`` of a trial."""
        for key in ("reports", "params", "attrs"):
            if key in fields:
                fields[key] = orjson.dumps({str(k): v for k, v in fields[key].items()}).decode()
        sets = ", ".join(f"{k} = ?" for k in fields)
        with savepoint(self.db):
            self.db.execute(
                f"UPDATE trials SET {sets}, updated = ? WHERE study = ? AND number = ?",
                (*fields.values(), time.time(), study, number),
            )

"""The router's job queue in SQLite (WAL; every write is committed and made durable before the router
acknowledges it, so a router killed at any moment comes back with everything it said yes to: how, and
the group commit of a running router, in services/router/store_db.py).

A job row holds its spec, state, lease (trainer + expiry, wall-clock seconds), attempt counters,
last progress, last checkpoint and result. A job with ``world_size`` > 1 also holds its ``gang``
(``{members: [trainer by rank], rendezvous, delivered: [rank, ...]}``); its ``trainer`` is rank 0,
which holds the lease and reports for the gang (services/router/gangs.py). Every state
transition, and every command and its acknowledgement, is a row in ``events``; progress reports
and checkpoint records have tables of their own.
"""

from __future__ import annotations

import builtins
import os
import secrets
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, NamedTuple, NotRequired, TypedDict, cast, overload

import orjson

from libbus.errors import BadRequest, ConfigError, NotFound
from libbus.jobs.spec import JOB_STATES, MAX_ATTEMPTS, TERMINAL_STATES, JobSpec
from libbus.jobs.state import JobState, check_transition
from libbus.order.epochs import Cursor
from libbus.security.auth import private_dir

from .store_db import ADDED_COLUMNS, INDEXES, SCHEMA, Durability

__all__ = [
    "GangRecord",
    "HOLDING_STATES",
    "HeldDataset",
    "HeldGang",
    "HeldGrant",
    "HeldGrantId",
    "HeldMembers",
    "JobEvent",
    "JobRecord",
    "JobRow",
    "JobStore",
    "JobView",
    "QueuedJob",
    "Segment",
    "StoredCheckpoint",
]


class StoredCheckpoint(TypedDict):
    """A checkpoint record as the store keeps it: the trainer's, checked (:data:`CHECKPOINT_FIELDS`), with
    the trainer that wrote it and when the router recorded it."""

    path: str
    sha256: str
    step: int
    epoch: int
    cursor: dict[str, Any]
    bytes: NotRequired[int]
    trainer: str
    at: float


class GangRecord(TypedDict):
    """A gang job's ``gang`` column: its trainers by rank (rank 0 holds the lease and reports), where rank 0
    waits for the others ("" until it said), the ranks handed their task, and the checkpoint of another job
    its first rank was handed to start from (services/router/task_models.py), which every rank then gets."""

    members: list[str]
    rendezvous: str
    delivered: list[int]
    initial: NotRequired[StoredCheckpoint]


class JobRow(TypedDict):
    """A job as the store keeps it: a ``jobs`` row, its JSON columns parsed (``JobList.jobs``; a trainer's
    ``Task`` is made from it). ``spec`` is the spec's JSON (:func:`stored_spec` types it); ``progress`` the
    trainer's last progress report and ``result`` its result, with the job's own metrics among their keys."""

    id: str
    spec: dict[str, Any]
    state: str
    priority: int
    #: Who holds the job (rank 0 of a gang); None while no trainer does.
    trainer: str | None
    attempts: int
    created: float
    updated: float
    progress: dict[str, Any] | None
    result: dict[str, Any] | None
    error: str | None
    lease_expires: float | None
    #: Attempts lost (lease lapsed, abandoned) since it was last queued by an admin.
    failures: int
    #: The checkpoint its next attempt resumes from.
    checkpoint: StoredCheckpoint | None
    #: Only a job running on a gang (``world_size`` > 1) has one.
    gang: GangRecord | None


class HeldDataset(TypedDict):
    """The part of a held job's spec that grants read: the dataset it names."""

    dataset: str


class HeldMembers(TypedDict):
    """The part of a held gang job's ``gang`` column that grants read: its trainers by rank."""

    members: list[str]


class HeldGrant(TypedDict):
    """A held job as ``grants.assignments`` reads it (:meth:`JobStore.held_grants`): the part of a
    :class:`JobRow` that says which trainers read which dataset."""

    spec: HeldDataset
    trainer: str
    gang: HeldMembers | None


class HeldGrantId(TypedDict):
    """A held job as a scoped admin's ``Stats`` reads it (:meth:`JobStore.held_grants_ids`): its id, dataset
    and trainer."""

    id: str
    spec: HeldDataset
    trainer: str


class Segment(TypedDict):
    """A ``segments`` record: where an attempt started (libbus/order/history.py reads the job's, oldest first),
    the step and cursor of the checkpoint it resumed (None: the start), its world size and batch size (None:
    the spec's default), how many of the spec's skips it read under (absent from a record kept from before
    skips were recorded), and when."""

    step: int
    cursor: dict[str, Any] | None
    world_size: int
    batch_size: int | None
    skips: NotRequired[int]
    at: float


class JobEvent(TypedDict):
    """One of a job's events: a state it entered, or a command and its acknowledgement (``state`` unchanged)."""

    at: float
    state: str
    reason: str


class JobRecord(JobRow):
    """A job with its history (:meth:`JobStore.get` with ``events``): a page of its events and checkpoint
    records, oldest first, and how many events are kept in all."""

    events: list[JobEvent]
    events_total: int
    checkpoints: list[StoredCheckpoint]


class JobView(JobRecord):
    """A job as ``GetJob`` answers it (``JobInfo.job``, what ``busctl job show`` prints): its record and,
    when asked for, its last progress reports, oldest first, each with its time ``at``."""

    progress_history: NotRequired[list[dict[str, Any]]]


class QueuedJob(TypedDict):
    """A queued job as :meth:`JobStore.claim`'s ``accept`` sees it (and :meth:`JobStore.first_queued` gives
    it): its id and its spec's JSON."""

    id: str
    spec: dict[str, Any]


class HeldGang(NamedTuple):
    """A held job that runs on a gang, with its gang (:meth:`JobStore.held_gangs`)."""

    job: JobRow
    gang: GangRecord


#: States in which a trainer holds the job under a lease.
HOLDING_STATES = tuple(s.value for s in JobState if s.holding)
_QUEUED, _RUNNING = JobState.QUEUED.value, JobState.RUNNING.value
#: Progress reports kept per job (older ones are pruned; the last one is also on the job row).
PROGRESS_KEPT = 1000
#: Retention, so that storage is bounded however long a job runs or a router lives: a job keeps
#: its first events (submission, first assignments) and its last ones, and its last checkpoint
#: records (the job row keeps its result, model hash and last checkpoint in any case).
EVENTS_KEPT_FIRST = 20
EVENTS_KEPT = 500
CHECKPOINTS_KEPT = 50
#: Segments kept per job (one per attempt: where it resumed, at what world size; libbus/order/history.py):
#: the steps of older ones are no longer explained.
SEGMENTS_KEPT = 1000
#: Bytes of progress history kept per job (the newest reports; a report over ``PROGRESS_SMALL``
#: bytes trims the older ones to fit): with a report's own bound (256 KiB, libbus/wire/schema.py)
#: and ``PROGRESS_KEPT``, what a trainer holding one job can make the router store is bounded.
PROGRESS_BYTES_KEPT = 4 * 1024 * 1024
PROGRESS_SMALL = 4096
#: Characters of an event's reason kept (it may quote a peer's error or detail).
REASON_CHARS = 2000
#: What ``get`` returns by default: the newest events and checkpoint records (``busctl job show`` pages).
EVENTS_SHOWN = 200
_HELD = "SELECT * FROM jobs WHERE state IN (?, ?) AND trainer IS NOT NULL"

#: Keys of a checkpoint record and their types (what a trainer must report).
CHECKPOINT_FIELDS = {"path": str, "sha256": str, "step": int, "epoch": int, "cursor": dict}


class JobStore:
    """Jobs, their leases and their history. Used by the router's single loop thread."""

    def __init__(self, path: str):
        try:
            private_dir(Path(path).parent)
            # the database holds every job's spec, events and results: 0600 from its first byte (SQLite
            # gives its -wal and -shm files the database's mode); an existing one keeps its own mode
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        except OSError as err:
            raise ConfigError(f"job database {path}: {err.strerror or err}") from err
        try:
            # One thread uses the store at a time (the router loop), though not the one that opened it.
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.executescript(SCHEMA)
            have = {row[1] for row in self.db.execute("PRAGMA table_info(jobs)")}
            for column, decl in ADDED_COLUMNS.items():
                if column not in have:
                    self.db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {decl}")
            self.db.executescript(INDEXES)
        except sqlite3.DatabaseError as err:
            raise ConfigError(f"job database {path}: {err}") from err
        self.db.row_factory = sqlite3.Row
        self.path = path
        self.durability = Durability(self.db, path)
        #: Bumped by every write that can change who holds what: readers of the held jobs recompute then.
        self.changes = 0

    def close(self) -> None:
        self.durability.sync()
        self.db.close()

    def next_epoch(self) -> int:
        """A number no earlier start of the router on this database had: command ids carry it,
        so a trainer that applied command 1 of the last router still applies this one's."""
        with self.durability.write():
            self.db.execute(
                "INSERT INTO meta VALUES ('router_epoch', 1) ON CONFLICT(key) DO UPDATE SET value = value + 1"
            )
            return self.db.execute("SELECT value FROM meta WHERE key = 'router_epoch'").fetchone()[0]

    # -- writes ---------------------------------------------------------------------------------
    def _transition(self, job: str, state: str, reason: str, **fields) -> None:
        """Move ``job`` to ``state`` (checked against :data:`libbus.jobs.state.TRANSITIONS` inside the
        write transaction: :class:`~libbus.jobs.state.IllegalTransition` changes nothing)."""
        now = time.time()
        sets = ", ".join(f"{k} = ?" for k in fields)
        self.changes += 1
        with self.durability.write():
            row = self.db.execute("SELECT state FROM jobs WHERE id = ?", (job,)).fetchone()
            if row is None:
                raise NotFound(f"no job {job!r}; 'busctl jobs' lists them")
            state = check_transition(job, row[0], state).value
            self.db.execute(
                f"UPDATE jobs SET state = ?, updated = ?{', ' + sets if sets else ''} WHERE id = ?",
                (state, now, *fields.values(), job),
            )
            self.db.execute("INSERT INTO events VALUES (?, ?, ?, ?)", (job, now, state, _cut(reason)))
            self._retain_events(job)  # (checkpoint records are trimmed as they are added)

    def _retain(self, job: str) -> None:
        """Trim ``job``'s events and checkpoint records to the retention limits (inside the
        caller's transaction; progress reports are trimmed as they arrive)."""
        self.db.execute(
            "DELETE FROM events WHERE job = ? AND rowid NOT IN (SELECT rowid FROM events WHERE job = ? "
            "ORDER BY at, rowid LIMIT ?) AND rowid NOT IN (SELECT rowid FROM events WHERE job = ? "
            "ORDER BY at DESC, rowid DESC LIMIT ?)",
            (job, job, EVENTS_KEPT_FIRST, job, EVENTS_KEPT),
        )
        self.db.execute(
            "DELETE FROM checkpoints WHERE job = ? AND rowid NOT IN (SELECT rowid FROM checkpoints "
            "WHERE job = ? ORDER BY at DESC, rowid DESC LIMIT ?)",
            (job, job, CHECKPOINTS_KEPT),
        )

    def submit(self, spec: JobSpec) -> str:
        job = "j" + secrets.token_hex(5)
        now = time.time()
        with self.durability.write():
            self.db.execute(
                "INSERT INTO jobs (id, spec, state, priority, created, updated) VALUES (?, ?, ?, ?, ?, ?)",
                (job, orjson.dumps(spec.to_dict()).decode(), _QUEUED, spec.priority, now, now),
            )
            self.db.execute("INSERT INTO events VALUES (?, ?, ?, 'submitted')", (job, now, _QUEUED))
        return job

    def event(self, job: str, reason: str) -> None:
        """Log ``reason`` (a command, an acknowledgement) without changing the job's state."""
        state = self._row(job)["state"]
        with self.durability.write():
            self.db.execute("INSERT INTO events VALUES (?, ?, ?, ?)", (job, time.time(), state, _cut(reason)))
            self._retain_events(job)

    def _retain_events(self, job: str) -> None:
        """Events past the retention limit: one trim per ``EVENTS_KEPT // 10`` events, not per event."""
        count = self.db.execute("SELECT COUNT(*) FROM events WHERE job = ?", (job,)).fetchone()[0]
        if count > EVENTS_KEPT_FIRST + EVENTS_KEPT + EVENTS_KEPT // 10:
            self._retain(job)

    def set_state(self, job: str, state: str, reason: str) -> None:
        """Move a held job between ``running`` and ``paused``, or a trainer-less one between
        ``queued`` and ``paused``."""
        if state not in (JobState.QUEUED, JobState.RUNNING, JobState.PAUSED):
            raise BadRequest(f"set_state moves jobs between queued, running and paused, not {state!r}")
        self._transition(job, state, reason)

    def set_spec(self, job: str, spec: JobSpec, reason: str) -> None:
        """Store a changed spec (``busctl job set``), logged: a resumed job runs with it."""
        now = time.time()
        with self.durability.write():
            self.db.execute(
                "UPDATE jobs SET spec = ?, updated = ? WHERE id = ?", (orjson.dumps(spec.to_dict()).decode(), now, job)
            )
            self.db.execute(
                "INSERT INTO events SELECT id, ?, state, ? FROM jobs WHERE id = ?", (now, _cut(reason), job)
            )

    def claim(self, trainer: str, lease_s: float, accept: Callable[[QueuedJob], bool] | None = None) -> JobRow | None:
        """Hand the best queued job (priority, then age) that ``accept`` takes (given its id and spec)
        to ``trainer`` under a lease of ``lease_s``; None when there is none. The job's last
        checkpoint (if any) comes with it."""
        now = time.time()
        self.changes += 1
        with self.durability.write():
            rows = self.db.execute(
                "SELECT id, spec, checkpoint FROM jobs WHERE state = ? ORDER BY priority DESC, created", (_QUEUED,)
            )
            row = next((r for r in rows if accept is None or accept(_queued(r))), None)
            if row is None:
                return None
            self.db.execute(
                # a new attempt has reported nothing yet: the last one's step (or "paused") is not its
                "UPDATE jobs SET state = ?, trainer = ?, attempts = attempts + 1, progress = NULL, "
                "lease_expires = ?, updated = ? WHERE id = ?",
                (_RUNNING, trainer, now + lease_s, now, row["id"]),
            )
            resumed = ""
            if row["checkpoint"]:
                ckpt = orjson.loads(row["checkpoint"])
                resumed = f" (resumes from step {ckpt['step']}, {Cursor.of_checkpoint(ckpt).shown()})"
            self.db.execute(
                "INSERT INTO events VALUES (?, ?, ?, ?)", (row["id"], now, _RUNNING, f"assigned to {trainer}{resumed}")
            )
            self._segment(row["id"], now, row["spec"], row["checkpoint"], 1)
        return self.get(row["id"], events=False)

    def first_queued(self, accept: Callable[[QueuedJob], bool] | None = None) -> QueuedJob | None:
        """The queued job :meth:`claim` would hand out next, without taking it."""
        rows = self.db.execute("SELECT id, spec FROM jobs WHERE state = ? ORDER BY priority DESC, created", (_QUEUED,))
        for r in rows:
            job = _queued(r)
            if accept is None or accept(job):
                return job
        return None

    def form_gang(self, job: str, members: list[str], lease_s: float) -> None:
        """Start a queued job on its gathered gang: ``members[0]`` (rank 0) holds the lease."""
        now = time.time()
        gang: GangRecord = {"members": members, "rendezvous": "", "delivered": []}
        self.changes += 1
        with self.durability.write():
            row = self.db.execute("SELECT state, checkpoint FROM jobs WHERE id = ?", (job,)).fetchone()
            if row is None or row["state"] != _QUEUED:
                raise BadRequest(f"job {job} is not queued; its gang cannot start it")
            self.db.execute(
                "UPDATE jobs SET state = ?, trainer = ?, gang = ?, attempts = attempts + 1, progress = NULL, "
                "lease_expires = ?, updated = ? WHERE id = ?",
                (_RUNNING, members[0], orjson.dumps(gang).decode(), now + lease_s, now, job),
            )
            resumed = ""
            if row["checkpoint"]:
                ckpt = orjson.loads(row["checkpoint"])
                resumed = f" (resumes from step {ckpt['step']}, {Cursor.of_checkpoint(ckpt).shown()})"
            ranks = ", ".join(f"{rank}: {name}" for rank, name in enumerate(members))
            self.db.execute(
                "INSERT INTO events VALUES (?, ?, ?, ?)",
                (job, now, _RUNNING, f"assigned to a gang of {len(members)} (rank {ranks}){resumed}"),
            )
            spec = self.db.execute("SELECT spec FROM jobs WHERE id = ?", (job,)).fetchone()["spec"]
            self._segment(job, now, spec, row["checkpoint"], len(members))

    def gang(self, job: str) -> GangRecord:
        """The gang ``job`` runs on. Raises :class:`BadRequest` when it runs on none (not a gang job, or
        not running)."""
        gang = self._as_row(self._row(job))["gang"]
        if gang is None:
            raise BadRequest(f"job {job} has no gang")
        return gang

    def update_gang(
        self,
        job: str,
        reason: str = "",
        *,
        rendezvous: str | None = None,
        delivered: builtins.list[int] | None = None,
        initial: StoredCheckpoint | None = None,
    ) -> None:
        """Change fields of a running job's gang: rank 0's ``rendezvous``, the ranks ``delivered``, the
        ``initial`` checkpoint its ranks start from (those given; :meth:`gang` raises for a job without one)."""
        gang = self.gang(job)
        if rendezvous is not None:
            gang["rendezvous"] = rendezvous
        if delivered is not None:
            gang["delivered"] = delivered
        if initial is not None:
            gang["initial"] = initial
        self.changes += 1
        with self.durability.write():
            self.db.execute("UPDATE jobs SET gang = ? WHERE id = ?", (orjson.dumps(gang).decode(), job))
            if reason:
                self.db.execute(
                    "INSERT INTO events SELECT id, ?, state, ? FROM jobs WHERE id = ?", (time.time(), reason, job)
                )

    def renew(self, job: str, lease_s: float) -> None:
        """Extend a held job's lease to ``lease_s`` from now."""
        self.renew_many([job], lease_s)

    def renew_many(self, jobs: list[str], lease_s: float) -> None:
        """Extend these held jobs' leases to ``lease_s`` from now, in one transaction."""
        with self.durability.write(relaxed=True):
            self.db.executemany(
                "UPDATE jobs SET lease_expires = ? WHERE id = ?", [(time.time() + lease_s, j) for j in jobs]
            )

    def renew_all(self, lease_s: float) -> int:
        """Give every held job a fresh lease: a router that just started cannot know which trainers
        are alive, so each gets one lease period to say Hello again. Returns how many."""
        with self.durability.write():
            cur = self.db.execute(
                "UPDATE jobs SET lease_expires = ? WHERE state IN (?, ?) AND trainer IS NOT NULL",
                (time.time() + lease_s, *HOLDING_STATES),
            )
        return cur.rowcount

    def set_progress(self, job: str, progress: dict, lease_s: float) -> None:
        """Store a progress report (the last one on the job row, a slim copy in the history) and
        renew the lease of the trainer that sent it."""
        now = time.time()
        slim = {k: v for k, v in progress.items() if k != "history"}
        with self.durability.write(relaxed=True):
            self.db.execute(
                "UPDATE jobs SET progress = ?, updated = ?, lease_expires = ? WHERE id = ?",
                (orjson.dumps(progress).decode(), now, now + lease_s, job),
            )
            text = orjson.dumps(slim).decode()
            self.db.execute("INSERT INTO progress VALUES (?, ?, ?)", (job, now, text))
            self.db.execute(
                "DELETE FROM progress WHERE job = ? AND rowid NOT IN (SELECT rowid FROM progress "
                "WHERE job = ? ORDER BY at DESC LIMIT ?)",
                (job, job, PROGRESS_KEPT),
            )
            if len(text) > PROGRESS_SMALL:  # (small reports alone stay within PROGRESS_KEPT x PROGRESS_SMALL)
                self.db.execute(
                    "DELETE FROM progress WHERE rowid IN (SELECT rowid FROM (SELECT rowid, SUM(LENGTH(progress)) "
                    "OVER (ORDER BY at DESC, rowid DESC) AS kept FROM progress WHERE job = ?) WHERE kept > ?)",
                    (job, PROGRESS_BYTES_KEPT),
                )

    def add_checkpoint(self, job: str, trainer: str, record: dict) -> StoredCheckpoint:
        """Record a checkpoint the trainer wrote; the job resumes from the latest one.

        Raises :class:`BadRequest` naming a missing or mistyped field of ``record``.
        """
        for key, kind in CHECKPOINT_FIELDS.items():
            value = record.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise BadRequest(f"checkpoint record needs '{key}' ({kind.__name__}), got {value!r}")
        now = time.time()
        stored = cast(StoredCheckpoint, {**record, "trainer": trainer, "at": now})  # its fields checked above
        text = orjson.dumps(stored).decode()
        with self.durability.write():
            self.db.execute(
                "INSERT INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (job, now, trainer, stored["step"], stored["epoch"], stored["path"], stored["sha256"], text),
            )
            self.db.execute("UPDATE jobs SET checkpoint = ?, updated = ? WHERE id = ?", (text, now, job))
            self.db.execute(
                "DELETE FROM checkpoints WHERE job = ? AND rowid NOT IN (SELECT rowid FROM "
                "checkpoints WHERE job = ? ORDER BY at DESC, rowid DESC LIMIT ?)",
                (job, job, CHECKPOINTS_KEPT),
            )
        return stored

    def _segment(self, job: str, now: float, spec_text: str, checkpoint: str | None, world_size: int) -> None:
        """Record the segment an attempt starts (inside the assignment's transaction): the step and
        cursor of the checkpoint it resumes, its world size and batch size (libbus/order/history.py)."""
        ckpt = orjson.loads(checkpoint) if checkpoint else {}
        spec = orjson.loads(spec_text)
        segment: Segment = {
            "step": int(ckpt.get("step", 0)),
            "cursor": ckpt.get("cursor") or None,
            "world_size": world_size,
            "batch_size": spec.get("batch_size"),
            "skips": len(spec.get("skip") or []),
            "at": now,
        }
        self.db.execute("INSERT INTO segments VALUES (?, ?, ?)", (job, now, orjson.dumps(segment).decode()))
        self.db.execute(
            "DELETE FROM segments WHERE job = ? AND rowid NOT IN (SELECT rowid FROM segments "
            "WHERE job = ? ORDER BY at DESC, rowid DESC LIMIT ?)",
            (job, job, SEGMENTS_KEPT),
        )

    def rewind(self, job: str, spec: JobSpec, checkpoint: StoredCheckpoint | None, reason: str) -> None:
        """Give ``job`` a new spec (its skips) and the checkpoint its next attempt resumes from (None:
        the start), in one write; the job's event says why (``busctl job skip``)."""
        now = time.time()
        text = orjson.dumps(checkpoint).decode() if checkpoint else None
        with self.durability.write():
            self.db.execute(
                "UPDATE jobs SET spec = ?, checkpoint = ?, updated = ? WHERE id = ?",
                (orjson.dumps(spec.to_dict()).decode(), text, now, job),
            )
            self.db.execute(
                "INSERT INTO events SELECT id, ?, state, ? FROM jobs WHERE id = ?", (now, _cut(reason), job)
            )

    def segments(self, job: str) -> builtins.list[Segment]:
        """The job's segments, oldest first (one per attempt; see :meth:`_segment`)."""
        self._row(job)
        rows = self.db.execute("SELECT record FROM segments WHERE job = ? ORDER BY at, rowid", (job,)).fetchall()
        return [orjson.loads(r[0]) for r in rows]

    def finish(self, job: str, state: str, reason: str, result: dict[str, Any] | None = None, error: str = "") -> None:
        if state not in TERMINAL_STATES:
            raise BadRequest(f"a job ends {', '.join(TERMINAL_STATES)}, not {state!r}")
        self._transition(
            job, state, reason, result=orjson.dumps(result or {}).decode(), error=error, lease_expires=None
        )

    def reopen(self, job: str, reason: str) -> None:
        """Queue a stopped or failed job again (an admin's resume), with fresh attempts."""
        self._transition(
            job,
            JobState.QUEUED,
            reason,
            trainer=None,
            gang=None,
            lease_expires=None,
            failures=0,
            result=None,
            error=None,
        )

    def release(self, job: str, reason: str, *, lost: bool) -> JobState:
        """Take a held job from its trainer; returns the job's new state.

        A paused job stays paused (it waits for ``resume``); any other goes back to ``queued``,
        where the next trainer resumes it from its last checkpoint. ``lost`` (the lease lapsed, the
        trainer abandoned it) counts against the spec's ``max_attempts``: the job that has lost
        that many is ``failed`` with the reason. A trainer that hands a job back on shutdown is
        not ``lost``; an attempt that failed for a reason the next may not meet (a provider gone) is.
        """
        row = self._row(job)
        failures = row["failures"] + (1 if lost else 0)
        limit = min(orjson.loads(row["spec"]).get("max_attempts", 3), MAX_ATTEMPTS)
        if lost and failures >= limit:
            self._transition(
                job,
                JobState.FAILED,
                f"{reason}; poisoned: gave up after {failures} lost attempt(s) (max_attempts {limit})",
                trainer=None,
                gang=None,
                lease_expires=None,
                failures=failures,
                error=f"poisoned: lost or failed {failures} trainer(s): {reason}",
                result="{}",
            )
            return JobState.FAILED
        state = JobState.PAUSED if row["state"] == JobState.PAUSED else JobState.QUEUED
        self._transition(job, state, reason, trainer=None, gang=None, lease_expires=None, failures=failures)
        return state

    # -- reads ----------------------------------------------------------------------------------
    def _row(self, job: str) -> sqlite3.Row:
        row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job,)).fetchone()
        if row is None:
            raise NotFound(f"no job {job!r}; 'busctl jobs' lists them")
        return row

    @staticmethod
    def _as_row(row: sqlite3.Row) -> JobRow:
        """A ``jobs`` row as :class:`JobRow` (its keys in the table's column order, as the wire carries them)."""
        return {
            "id": row["id"],
            "spec": orjson.loads(row["spec"]),
            "state": row["state"],
            "priority": row["priority"],
            "trainer": row["trainer"],
            "attempts": row["attempts"],
            "created": row["created"],
            "updated": row["updated"],
            "progress": _json(row["progress"]),
            "result": _json(row["result"]),
            "error": row["error"],
            "lease_expires": row["lease_expires"],
            "failures": row["failures"],
            "checkpoint": _json(row["checkpoint"]),
            "gang": _json(row["gang"]),
        }

    @overload
    def get(self, job: str, events: Literal[False]) -> JobRow: ...

    @overload
    def get(self, job: str, events: Literal[True] = True, limit: int = EVENTS_SHOWN, offset: int = 0) -> JobRecord: ...

    def get(self, job: str, events: bool = True, limit: int = EVENTS_SHOWN, offset: int = 0) -> JobRow | JobRecord:
        """The job's row; with ``events``, its record: also its events and checkpoint records (oldest
        first): ``limit`` of them, skipping the ``offset`` newest (a page); ``events_total`` counts all kept."""
        row = self._as_row(self._row(job))
        if not events:
            return row
        limit, offset = max(1, min(limit, 10000)), max(0, offset)
        rows = self.db.execute(
            "SELECT at, state, reason FROM events WHERE job = ? ORDER BY at DESC, rowid DESC LIMIT ? OFFSET ?",
            (job, limit, offset),
        ).fetchall()
        records = self.db.execute(
            "SELECT record FROM checkpoints WHERE job = ? ORDER BY at DESC, rowid DESC LIMIT ?", (job, limit)
        ).fetchall()
        return {
            **row,
            "events": [{"at": at, "state": state, "reason": reason} for at, state, reason in reversed(rows)],
            "events_total": self.db.execute("SELECT COUNT(*) FROM events WHERE job = ?", (job,)).fetchone()[0],
            "checkpoints": [orjson.loads(r[0]) for r in reversed(records)],
        }

    def progress_history(self, job: str, limit: int = 100) -> builtins.list[dict[str, Any]]:
        """The last ``limit`` progress reports of ``job``, oldest first, each with its time ``at``."""
        self._row(job)
        rows = self.db.execute(
            "SELECT at, progress FROM progress WHERE job = ? ORDER BY at DESC LIMIT ?", (job, max(1, limit))
        ).fetchall()
        return [{"at": r[0], **orjson.loads(r[1])} for r in reversed(rows)]

    def list(self, state: str | None = None, limit: int = 100, offset: int = 0) -> builtins.list[JobRow]:
        """Jobs, newest first: ``limit`` of them after skipping ``offset`` (a page)."""
        if state is not None and state not in JOB_STATES:
            raise BadRequest(f"unknown state {state!r}; expected one of {', '.join(JOB_STATES)}")
        limit, offset = max(1, min(limit, 10000)), max(0, offset)
        if state:
            rows = self.db.execute(
                "SELECT * FROM jobs WHERE state = ? ORDER BY created DESC LIMIT ? OFFSET ?", (state, limit, offset)
            )
        else:
            rows = self.db.execute("SELECT * FROM jobs ORDER BY created DESC LIMIT ? OFFSET ?", (limit, offset))
        return [self._as_row(r) for r in rows.fetchall()]

    def held_by(self, trainer: str) -> builtins.list[JobRow]:
        """Jobs ``trainer`` holds now (as rank 0 of a gang too)."""
        return [self._as_row(r) for r in self.db.execute(_HELD + " AND trainer = ?", (*HOLDING_STATES, trainer))]

    def held_gangs(self) -> builtins.list[HeldGang]:
        """Held jobs that run on a gang (``world_size`` > 1), each with its gang."""
        held = [self._as_row(r) for r in self.db.execute(_HELD + " AND gang IS NOT NULL", HOLDING_STATES)]
        return [HeldGang(job, job["gang"]) for job in held if job["gang"] is not None]

    def held_leases(self) -> builtins.list[tuple[str, str, float]]:
        """``(job, trainer, lease_expires)`` of every held job: the lease check, without the rows."""
        rows = self.db.execute(_HELD.replace("*", "id, trainer, lease_expires", 1), HOLDING_STATES)
        return [(r[0], r[1], r[2] or 0.0) for r in rows.fetchall()]

    def held_grants(self) -> builtins.list[HeldGrant]:
        """Held jobs as ``grants.assignments`` reads them, without decoding specs and progress."""
        cols = "json_extract(spec, '$.dataset'), trainer, json_extract(gang, '$.members')"
        rows = self.db.execute(_HELD.replace("*", cols, 1), HOLDING_STATES).fetchall()
        return [
            {"spec": {"dataset": d}, "trainer": t, "gang": {"members": orjson.loads(m)} if m else None}
            for d, t, m in rows
        ]

    def held_grants_ids(self) -> builtins.list[HeldGrantId]:
        """Held jobs as ``{id, spec: {dataset}, trainer}`` (a scoped admin's ``Stats``)."""
        cols = "id, json_extract(spec, '$.dataset'), trainer"
        rows = self.db.execute(_HELD.replace("*", cols, 1), HOLDING_STATES).fetchall()
        return [{"id": i, "spec": {"dataset": d}, "trainer": t} for i, d, t in rows]

    def held_watched(self) -> dict[str, float]:
        """Early stopping's read: ``{job: updated}`` of the held jobs whose spec sets ``patience``
        (their rows are read only when they change)."""
        cols, where = "id, updated", " AND json_extract(spec, '$.patience') > 0"  # the index jobs_watched
        return dict(self.db.execute(_HELD.replace("*", cols, 1) + where, HOLDING_STATES).fetchall())

    def held(self) -> builtins.list[JobRow]:
        """Jobs a trainer holds now (running or paused, with a trainer)."""
        return [self._as_row(r) for r in self.db.execute(_HELD, HOLDING_STATES).fetchall()]


def stored_spec(raw: dict) -> JobSpec:
    """A stored job's spec (a row's ``spec``, or a task's made from it), typed: the one place the router
    parses a spec it wrote (every spec was checked with :meth:`JobSpec.from_dict` where it entered, at
    submit or when a study made a trial)."""
    return JobSpec.from_dict(raw)


def _json(text: str | None) -> Any:
    """A JSON column's value: None when it holds none (NULL, or empty)."""
    return orjson.loads(text) if text else None


def _queued(row: sqlite3.Row) -> QueuedJob:
    return {"id": row["id"], "spec": orjson.loads(row["spec"])}


def _cut(reason: str) -> str:
    """An event's reason within ``REASON_CHARS`` (the rest is marked cut, not silently lost)."""
    return reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS] + f"... ({len(reason)} characters, cut)"

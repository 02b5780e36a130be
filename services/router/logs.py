"""What entrypoint jobs' attempts printed, for ``busctl job logs`` (services/trainer/service/attempt_run.py sends it).

Kept in the router's database, in a table of its own, bounded: per attempt the last
:data:`ATTEMPT_BYTES` of output (earlier lines are dropped and counted), per job the last
:data:`ATTEMPTS_KEPT` attempts. Only the trainer holding a job adds to its output (the handler checks
that, as for progress reports); lines are stored as text, at most :data:`MAX_LINE_BYTES` bytes of
UTF-8 each. Sizes are bytes, not characters: a reply's lines are bounded by the JSON bytes they take
(a control character takes 6), so every reply fits in a message.
"""

from __future__ import annotations

import sqlite3

from libbus.errors import BadRequest
from libbus.wire.text import cut_utf8, json_size

from .store_db import savepoint

__all__ = ["ATTEMPTS_KEPT", "ATTEMPT_BYTES", "JobOutput"]

#: Output bytes kept per attempt (the last ones), attempts kept per job, bytes of UTF-8 per line.
ATTEMPT_BYTES = 256 << 10
ATTEMPTS_KEPT = 5
MAX_LINE_BYTES = 4096
#: The most JSON bytes of output one reply carries (a message is at most 1 MiB; the rest comes on the next ask).
REPLY_BYTES = 512 << 10
#: Lines one JobLog may carry.
MAX_LINES = 1000

SCHEMA = """
CREATE TABLE IF NOT EXISTS job_output (
    job TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    line TEXT NOT NULL,
    PRIMARY KEY (job, attempt, seq)
);
CREATE TABLE IF NOT EXISTS job_output_dropped (
    job TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    dropped INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    PRIMARY KEY (job, attempt)
);
"""


class JobOutput:
    def __init__(self, db: sqlite3.Connection):
        self.db = db
        self.db.executescript(SCHEMA)

    def add(self, job: str, attempt: int, seq: int, lines: list) -> None:
        """Store ``lines`` (line ``seq`` on) of ``attempt``; a resend of lines already stored is a no-op."""
        if not isinstance(lines, list) or len(lines) > MAX_LINES or not all(isinstance(x, str) for x in lines):
            raise BadRequest(f"JobLog.lines must be a list of at most {MAX_LINES} strings")
        if attempt < 0 or seq < 0:
            raise BadRequest("JobLog attempt and seq must not be negative")
        rows = [(job, attempt, seq + i, cut_utf8(line, MAX_LINE_BYTES)) for i, line in enumerate(lines)]
        with savepoint(self.db):
            self.db.executemany("INSERT OR IGNORE INTO job_output VALUES (?, ?, ?, ?)", rows)
            added = sum(len(r[3].encode("utf-8", "replace")) + 1 for r in rows)
            self.db.execute(
                "INSERT INTO job_output_dropped VALUES (?, ?, 0, ?) "
                "ON CONFLICT (job, attempt) DO UPDATE SET bytes = bytes + excluded.bytes",
                (job, attempt, added),
            )
            self._bound(job, attempt)

    def _bound(self, job: str, attempt: int) -> None:
        (size,) = self.db.execute(
            "SELECT bytes FROM job_output_dropped WHERE job = ? AND attempt = ?", (job, attempt)
        ).fetchone()
        if size > ATTEMPT_BYTES:  # drop the oldest lines down to 3/4 of the bound (not a line at a time)
            dropped, freed = 0, 0
            for seq, length in self.db.execute(
                "SELECT seq, length(CAST(line AS BLOB)) FROM job_output WHERE job = ? AND attempt = ? ORDER BY seq",
                (job, attempt),
            ):
                if size - freed <= ATTEMPT_BYTES * 3 // 4:
                    break
                freed += length + 1
                dropped += 1
                last = seq
            if dropped:
                self.db.execute(
                    "DELETE FROM job_output WHERE job = ? AND attempt = ? AND seq <= ?", (job, attempt, last)
                )
                self.db.execute(
                    "UPDATE job_output_dropped SET dropped = dropped + ?, bytes = bytes - ? WHERE job = ? AND attempt = ?",
                    (dropped, freed, job, attempt),
                )
        old = [
            a
            for (a,) in self.db.execute(
                "SELECT attempt FROM job_output_dropped WHERE job = ? ORDER BY attempt DESC", (job,)
            )
        ][ATTEMPTS_KEPT:]
        for a in old:
            self.db.execute("DELETE FROM job_output WHERE job = ? AND attempt = ?", (job, a))
            self.db.execute("DELETE FROM job_output_dropped WHERE job = ? AND attempt = ?", (job, a))

    def read(self, job: str, attempt: int, after: int, limit: int) -> tuple[int, list[str], int, int, list[int]]:
        """``(attempt, lines, next, dropped, attempts)`` of ``job``'s output (``attempt`` -1: the latest)."""
        attempts = [
            a
            for (a,) in self.db.execute("SELECT attempt FROM job_output_dropped WHERE job = ? ORDER BY attempt", (job,))
        ]
        if attempt < 0:
            attempt = attempts[-1] if attempts else 0
        limit = max(1, min(limit, 5000))
        rows: list[tuple[int, str]] = []
        size = 0
        for row in self.db.execute(
            "SELECT seq, line FROM job_output WHERE job = ? AND attempt = ? AND seq >= ? ORDER BY seq LIMIT ?",
            (job, attempt, max(0, after), limit),
        ):
            size += json_size(row[1]) + 1
            if rows and size > REPLY_BYTES:  # the rest on the next ask
                break
            rows.append(row)
        found = self.db.execute(
            "SELECT dropped FROM job_output_dropped WHERE job = ? AND attempt = ?", (job, attempt)
        ).fetchone()
        nxt = rows[-1][0] + 1 if rows else max(0, after)
        return attempt, [r[1] for r in rows], nxt, found[0] if found else 0, attempts

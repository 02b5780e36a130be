"""Who may read what, as the router tells its providers: revoked tokens and job assignments.

Providers check every request locally, with no round trip to the router per batch. The router
keeps them current with one unsolicited ``Entitlements`` message per change:

- **revoked**: the ``jti``s an administrator revoked (``busctl token revoke``) that have not expired
  yet. They live in the router's SQLite file, so a restarted router still refuses them.
- **assigned**: per dataset, the token subjects of the trainers running a job on it (every member
  of a gang, services/router/gangs.py). A provider
  with ``assigned_only`` (the default) serves a trainer only the datasets of its current job
  (or those its token's ``datasets`` scope names explicitly).
"""

from __future__ import annotations

import math
import sqlite3
import time

from libbus.errors import BadRequest
from libbus.jobs.spec import dataset_name
from libbus.security.auth import LEEWAY_S

from .store_db import savepoint

__all__ = ["Revocations", "assignments", "MAX_JTI_LEN"]

MAX_JTI_LEN = 128

SCHEMA = """
CREATE TABLE IF NOT EXISTS revoked (
    jti    TEXT PRIMARY KEY,
    exp    REAL NOT NULL,
    at     REAL NOT NULL,
    reason TEXT NOT NULL
);
"""


class Revocations:
    """Revoked token ids in the router's database (its own table, committed before the ack)."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db
        self.db.executescript(SCHEMA)

    def revoke(self, jti: str, exp: float, reason: str) -> None:
        if not jti or len(jti) > MAX_JTI_LEN or not jti.isprintable():
            raise BadRequest(f"a token id (jti) is 1 to {MAX_JTI_LEN} printable characters, got {jti!r}")
        if not math.isfinite(exp):
            raise BadRequest(f"revocation expiry must be a finite time, got {exp!r}")
        reason = reason[:500]
        now = time.time()
        with savepoint(self.db):
            self.db.execute("INSERT OR REPLACE INTO revoked VALUES (?, ?, ?, ?)", (jti, float(exp), now, reason))
            # Rows whose token has expired can never matter again.
            self.db.execute("DELETE FROM revoked WHERE exp + ? < ?", (LEEWAY_S, now))

    def active(self, now: float | None = None) -> list[dict]:
        """Revocations whose token could still be accepted (``exp`` + clock leeway not yet past),
        newest first. A read only: the router asks every few hundred milliseconds."""
        now = time.time() if now is None else now
        rows = self.db.execute(
            "SELECT jti, exp, at, reason FROM revoked WHERE exp + ? >= ? ORDER BY at DESC", (LEEWAY_S, now)
        ).fetchall()
        return [{"jti": r[0], "exp": r[1], "at": r[2], "reason": r[3]} for r in rows]

    def jtis(self) -> list[str]:
        return sorted(r["jti"] for r in self.active())


def assignments(running: list[dict], trainer_subjects: dict[str, str]) -> dict[str, list[str]]:
    """``{dataset: [token subject, ...]}`` of trainers connected now and running a job on it.

    ``running`` are job rows (``spec``, ``trainer`` = the trainer's session name, ``gang`` = every
    rank's trainer when ``world_size`` > 1);
    ``trainer_subjects`` maps connected trainers' names to their tokens' subjects. A job whose
    trainer is not connected grants nothing: its next trainer is granted when it takes the job.
    """
    out: dict[str, set[str]] = {}
    for job in running:
        names = (job.get("gang") or {}).get("members") or [job.get("trainer") or ""]
        for name in names:
            sub = trainer_subjects.get(name)
            if sub is not None:
                out.setdefault(dataset_name(job["spec"]["dataset"]), set()).add(sub)
    return {name: sorted(subs) for name, subs in sorted(out.items())}

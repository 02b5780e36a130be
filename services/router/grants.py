"""Who may read what, as the router tells its providers: revoked tokens and job assignments.

Providers check every request locally, with no round trip to the router per batch. The router
keeps them current with one unsolicited ``Entitlements`` message per change:

- **revoked**: the ``jti``s an administrator revoked (``busctl token revoke``) that have not expired
  yet. They live in the router's SQLite file, so a restarted router still refuses them. Who may
  revoke what, and how many, is bounded (:func:`check_revocable`, :class:`Revocations`), so the
  list always fits one push.
- **assigned**: per dataset, the token subjects of the trainers running a job on it (every member
  of a gang, services/router/gangs.py). A provider
  with ``assigned_only`` (the default) serves a trainer only the datasets of its current job
  (or those its token's ``datasets`` scope names explicitly).
"""

from __future__ import annotations

import math
import sqlite3
import time

from libbus.errors import BadRequest, Forbidden, RateLimited
from libbus.jobs.spec import dataset_name
from libbus.security.auth import LEEWAY_S, Claims

from .store_db import savepoint

__all__ = [
    "Revocations",
    "assignments",
    "check_revocable",
    "MAX_JTI_LEN",
    "MAX_REVOKED",
    "MAX_REVOKED_BY_SCOPED",
    "LONGEST_TOKEN_S",
]

MAX_JTI_LEN = 128
#: Unexpired revocations the router keeps, all administrators together: every ``Entitlements`` push
#: carries them (at most 4096 x 128 characters, about half a MiB: a push always fits the 1 MiB a
#: peer reads), so a provider keeps learning assignments however many tokens were revoked.
MAX_REVOKED = 4096
#: Unexpired revocations one dataset- or job-limited administrator may have made.
MAX_REVOKED_BY_SCOPED = 256
#: The longest lifetime of a token (``busctl token issue --ttl`` mints no longer one): a revocation
#: lasts until its token's expiry, so never longer than this from now.
LONGEST_TOKEN_S = 366 * 24 * 3600.0
#: Characters of a revocation's reason kept.
REASON_CHARS = 200

SCHEMA = """
CREATE TABLE IF NOT EXISTS revoked (
    jti    TEXT PRIMARY KEY,
    exp    REAL NOT NULL,
    at     REAL NOT NULL,
    reason TEXT NOT NULL
);
"""


def check_revocable(admin: Claims, target: Claims | None, jti: str) -> None:
    """Who may revoke what. An unrestricted admin (no ``datasets`` or ``jobs`` scope) revokes any
    token id. A scoped admin revokes only what it could have been given itself: its own token, or
    a token the router sees in use now (``target``, a live session's claims) whose scopes lie
    inside its own — a ``datasets`` (``jobs``) scope that is a subset of the admin's. A token the
    router has not seen, or a wider one, needs an unrestricted admin. Raises :class:`Forbidden`."""
    if not admin.scopes or jti == admin.jti:
        return
    if target is None:
        raise Forbidden(
            f"token {jti[:MAX_JTI_LEN]!r} is not in use here; an administrator limited to "
            f"{_scope_text(admin)} revokes only tokens of live sessions inside its scope (ask an unrestricted admin)"
        )
    for name, mine in admin.scopes.items():
        theirs = target.scopes.get(name)
        if theirs is None or not set(theirs) <= set(mine):
            raise Forbidden(
                f"token {jti!r} ({target.role} {target.sub!r}) reaches "
                f"{'every ' + name if theirs is None else ', '.join(sorted(set(theirs) - set(mine)))} "
                f"beyond this administrator's {name} scope [{', '.join(mine)}]; ask an unrestricted admin"
            )


def _scope_text(claims: Claims) -> str:
    return " and ".join(f"{name} [{', '.join(values)}]" for name, values in claims.scopes.items())


class Revocations:
    """Revoked token ids in the router's database (its own table, committed before the ack),
    bounded: an expiry at most :data:`LONGEST_TOKEN_S` ahead, :data:`MAX_REVOKED` in all and
    :data:`MAX_REVOKED_BY_SCOPED` per scoped admin; expired rows are pruned as they pass."""

    def __init__(self, db: sqlite3.Connection, limit: int = MAX_REVOKED, scoped_limit: int = MAX_REVOKED_BY_SCOPED):
        self.db = db
        self.limit = limit
        self.scoped_limit = scoped_limit
        self.db.executescript(SCHEMA)
        if "by" not in {row[1] for row in self.db.execute("PRAGMA table_info(revoked)")}:
            self.db.execute("ALTER TABLE revoked ADD COLUMN by TEXT NOT NULL DEFAULT ''")
        self.db.execute("DELETE FROM revoked WHERE exp + ? < ?", (LEEWAY_S, time.time()))  # (a router that starts)
        #: The sorted ids in force, and when the first of them expires (then they are read again).
        self._jtis: list[str] | None = None
        self._until = 0.0

    def revoke(self, jti: str, exp: float, reason: str, by: str = "", scoped: bool = False) -> None:
        """Refuse ``jti`` until ``exp``; ``by`` (the admin's subject) is kept, and a ``scoped`` admin's
        revocations count against :attr:`scoped_limit`. Raises :class:`BadRequest` for a malformed id or
        an expiry past the longest token lifetime, :class:`RateLimited` past a bound."""
        if not jti or len(jti) > MAX_JTI_LEN or not jti.isprintable():
            raise BadRequest(f"a token id (jti) is 1 to {MAX_JTI_LEN} printable characters, got {jti[:MAX_JTI_LEN]!r}")
        now = time.time()
        if not math.isfinite(exp) or exp > now + LONGEST_TOKEN_S + LEEWAY_S:
            raise BadRequest(
                f"revocation expiry must be a time at most {LONGEST_TOKEN_S / 86400:.0f} days from now (the "
                f"longest token lifetime), got {exp!r}"
            )
        with savepoint(self.db):
            # Rows whose token has expired can never matter again.
            self.db.execute("DELETE FROM revoked WHERE exp + ? < ?", (LEEWAY_S, now))
            if self.db.execute("SELECT 1 FROM revoked WHERE jti = ?", (jti,)).fetchone() is None:
                total = self.db.execute("SELECT COUNT(*) FROM revoked").fetchone()[0]
                if total >= self.limit:
                    raise RateLimited(
                        f"the router keeps at most {self.limit} unexpired revocations and has {total}; "
                        "they end as their tokens expire (to refuse every token at once, change the cluster's "
                        "secret or signing key and issue new tokens)"
                    )
                mine = self.db.execute("SELECT COUNT(*) FROM revoked WHERE by = ?", (by,)).fetchone()[0]
                if scoped and mine >= self.scoped_limit:
                    raise RateLimited(
                        f"{by!r} has {mine} unexpired revocations, the most a dataset- or job-limited "
                        f"administrator may have ({self.scoped_limit}); ask an unrestricted admin"
                    )
            self.db.execute(
                "INSERT OR REPLACE INTO revoked (jti, exp, at, reason, by) VALUES (?, ?, ?, ?, ?)",
                (jti, float(exp), now, reason[:REASON_CHARS], by),
            )
        self._jtis = None

    def active(self, now: float | None = None, by: str | None = None) -> list[dict]:
        """Revocations whose token could still be accepted (``exp`` + clock leeway not yet past),
        newest first; only those ``by`` made, when given."""
        now = time.time() if now is None else now
        where = "exp + ? >= ?"
        args: list[object] = [LEEWAY_S, now]
        if by is not None:
            where += " AND by = ?"
            args.append(by)
        rows = self.db.execute(
            f"SELECT jti, exp, at, reason, by FROM revoked WHERE {where} ORDER BY at DESC", args
        ).fetchall()
        return [{"jti": r[0], "exp": r[1], "at": r[2], "reason": r[3], "by": r[4]} for r in rows]

    def jtis(self) -> list[str]:
        """The ids in force, sorted (read from the database only when one was added or expired: the
        router asks every few hundred milliseconds)."""
        now = time.time()
        if self._jtis is None or now > self._until:
            rows = self.active(now)
            self._jtis = sorted(r["jti"] for r in rows)
            self._until = min((r["exp"] + LEEWAY_S for r in rows), default=math.inf)
        return self._jtis


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

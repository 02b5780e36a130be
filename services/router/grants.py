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

:class:`ProviderGrants`, a mixin of :class:`~.handler.RouterHandler`, serves ``RevokeToken`` and
``ListRevoked`` and pushes each provider what changed for its datasets.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import TypedDict

from libbus.errors import BadRequest, Forbidden, RateLimited
from libbus.jobs.spec import dataset_name
from libbus.security.auth import LEEWAY_S, Claims
from libbus.serve.handler import serves
from libbus.serve.server import Session
from libbus.wire.messages import Entitlements, ListRevoked, Message, Ok, RevokedList, RevokeToken

from .replies import fit_list
from .store import HeldGrant, JobStore
from .store_db import savepoint

__all__ = [
    "ProviderGrants",
    "Revocation",
    "Revocations",
    "assignments",
    "check_revocable",
    "MAX_JTI_LEN",
    "MAX_REVOKED",
    "MAX_REVOKED_BY_SCOPED",
    "LONGEST_TOKEN_S",
]

log = logging.getLogger(__name__)

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


class Revocation(TypedDict):
    """A ``revoked`` row as :meth:`Revocations.active` reads it (``RevokedList.revoked``): the token id,
    its expiry, when and why it was revoked, and by whom (the admin's subject)."""

    jti: str
    exp: float
    at: float
    reason: str
    by: str


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

    def active(self, now: float | None = None, by: str | None = None) -> list[Revocation]:
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


def assignments(running: list[HeldGrant], trainer_subjects: dict[str, str]) -> dict[str, list[str]]:
    """``{dataset: [token subject, ...]}`` of trainers connected now and running a job on it.

    ``running`` are job rows (``spec``, ``trainer`` = the trainer's session name, ``gang`` = every
    rank's trainer when ``world_size`` > 1);
    ``trainer_subjects`` maps connected trainers' names to their tokens' subjects. A job whose
    trainer is not connected grants nothing: its next trainer is granted when it takes the job.
    """
    out: dict[str, set[str]] = {}
    for job in running:
        gang = job.get("gang")
        names = (gang.get("members") if gang else None) or [job.get("trainer") or ""]
        for name in names:
            sub = trainer_subjects.get(name)
            if sub is not None:
                out.setdefault(dataset_name(job["spec"]["dataset"]), set()).add(sub)
    return {name: sorted(subs) for name, subs in sorted(out.items())}


class ProviderGrants:
    """What the router's handler tells its providers (this module's docstring), for the handler, which
    provides ``store``, the server's ``push`` and :class:`~.peers.Peers`' sessions."""

    store: JobStore
    peers: dict[str, Session]
    _serving: dict[str, dict[str, Session]]
    _roster: int
    push: Callable[[str, Message], None]
    sessions_of: Callable[[str], list[Session]]
    _trainer_names: Callable[[], AbstractSet[str]]

    #: How often the router recomputes what providers must know (assignments follow job changes).
    GRANTS_CHECK_S = 0.2

    def init_grants(self) -> None:
        self.revocations = Revocations(self.store.db)
        #: Set by the service: applies the revoked token ids to the router's own server.
        self.apply_revoked: Callable[[list[str]], None] = lambda jtis: None
        #: provider session id -> the (revoked, assigned) it was last sent.
        self._sent: dict[str, tuple[list[str], dict]] = {}
        self._assigned_at: tuple[int, int] | None = None
        self._granted: tuple[list[str], dict] | None = None
        #: Datasets whose trainers this turn's claims added to: their providers hear of it once, at the
        #: turn's tick (just after the turn's replies), not once per claim.
        self._grants_due: set[str] = set()
        self._last_grants_check = 0.0

    def tick_grants(self, now: float) -> None:
        """Keep providers' entitlements current: this turn's claims now, every assignment each
        :attr:`GRANTS_CHECK_S`."""
        self._push_grants()
        if now - self._last_grants_check >= self.GRANTS_CHECK_S:
            self._last_grants_check = now
            self._push_entitlements()

    def welcome_provider(self, session: Session) -> None:
        """A provider's session opened: it is sent what it must know at once."""
        self._push_to_provider(session, self.revocations.jtis(), self._assigned())

    def forget_sent(self, sid: str) -> None:
        """A session closed: what it was sent is forgotten."""
        self._sent.pop(sid, None)

    @serves(RevokeToken, "admin")
    def on_RevokeToken(self, session: Session, msg: RevokeToken) -> Ok:
        admin = session.claims
        target = next((p.claims for p in self.peers.values() if p.claims.jti == msg.jti), None)
        check_revocable(admin, target, msg.jti)  # services/router/grants.py: who may revoke what
        # a scoped admin's revocation lasts as long as the token it saw (the only ones it may revoke)
        exp = msg.exp if not admin.scopes else (admin if msg.jti == admin.jti else target or admin).exp
        self.revocations.revoke(
            msg.jti, exp, msg.reason or f"revoked by {session.subject}", by=session.subject, scoped=bool(admin.scopes)
        )
        self.apply_revoked(self.revocations.jtis())
        log.warning("token %s revoked by %s: %s", msg.jti, session.subject, msg.reason[:200] or "no reason given")
        self._push_entitlements()  # providers hear of it now, not at the next check
        return Ok(detail={"jti": msg.jti, "until": exp})

    @serves(ListRevoked, "admin")
    def on_ListRevoked(self, session: Session, msg: ListRevoked) -> RevokedList:
        # a scoped admin sees the revocations it made; the list is cut to fit one reply, newest first
        rows = self.revocations.active(by=session.subject if session.claims.scopes else None)
        return RevokedList(revoked=fit_list(rows)[0])

    def entitlements(self) -> Entitlements:
        """Every dataset's assignments (each provider is sent those of its own datasets)."""
        return Entitlements(revoked=self.revocations.jtis(), assigned=self._assigned())

    def _assigned(self) -> dict[str, list[str]]:
        subjects = {sub: sub for sub in self._trainer_names()}  # jobs are held by subject
        return assignments(self.store.held_grants(), subjects)

    def _push_entitlements(self) -> None:
        """Send each provider what changed for its datasets since its last push (nothing when
        nothing did): a job taken on one dataset is news to its providers only, and a provider
        reads only its own datasets' lists (services/provider/admission.py ``entitled``)."""
        moved = (self.store.changes, self._roster)
        if self._granted is not None and moved == self._assigned_at:  # no job or trainer came or went
            now = (self.revocations.jtis(), self._granted[1])
        else:
            now = (self.revocations.jtis(), self._assigned())
            self._assigned_at = moved
        if now == self._granted:
            return
        self._granted = now
        for provider in self.sessions_of("provider"):
            self._push_to_provider(provider, *now)

    def _grant(self, dataset: str, subject: str) -> None:
        """A trainer took a job on ``dataset``: add it to what that dataset's providers are sent (at
        this turn's tick), without recomputing every assignment (the :attr:`GRANTS_CHECK_S` check does)."""
        if self._granted is None:
            self._push_entitlements()
            return
        revoked, assigned = self._granted
        subjects = assigned.get(dataset, [])
        if subject in subjects:
            return
        self._granted = (revoked, {**assigned, dataset: sorted([*subjects, subject])})
        self._grants_due.add(dataset)

    def _push_grants(self) -> None:
        """The providers of the datasets this turn's claims were on hear of them: one push each per
        turn, just after the turn's replies (a provider holds a request from a trainer not yet assigned
        up to ``ASSIGNMENT_WAIT_S`` for it, services/provider/admission.py)."""
        if not self._grants_due or self._granted is None:
            return
        due, self._grants_due = self._grants_due, set()
        providers = {sid: p for dataset in due for sid, p in self._serving.get(dataset, {}).items()}
        for provider in providers.values():
            self._push_to_provider(provider, *self._granted)

    def _push_to_provider(self, provider: Session, revoked: list[str], assigned: dict) -> None:
        served = provider.hello.caps["datasets"]
        mine = (revoked, {name: subs for name, subs in assigned.items() if name in served})
        sent = self._sent.get(provider.sid)
        if sent != mine:
            self._sent[provider.sid] = mine
            # what changed only: the revoked list (up to MAX_REVOKED ids) goes again only when it changed
            same = sent is not None and sent[0] == revoked
            self.push(provider.sid, Entitlements(revoked=None if same else mine[0], assigned=mine[1]))

"""Whether a provider serves a request now: who may send what, the token's scope, and the router's word.

A request reaches its route only after two checks, both local (no round trip to the router per batch):

- **scope**: a token's ``datasets`` and ``jobs`` scopes name what it may read or have scored
  (:meth:`Admission.check_scope`); a request outside them is refused ``FORBIDDEN`` at once.
- **assignment**: a trainer (or an attempt's grant) reads a dataset only while the router says it runs a
  job there (services/router/grants.py pushes ``{dataset: [token subject]}``; :meth:`Admission.entitled`).
  A request that arrives before the router's word waits for it, up to ``ASSIGNMENT_WAIT_S`` (longer while
  the provider has heard nothing from the router at all: ``UNSYNCED_WAIT_S``).

:class:`Admission` is a mixin of :class:`~.handler.ProviderHandler`, which provides the datasets, the
``refused`` counters and ``serve`` (the route a request is answered by).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

from libbus.errors import Forbidden, Unavailable
from libbus.serve.server import Session
from libbus.wire.messages import (
    AttachRing,
    BatchRequest,
    DatasetInfoRequest,
    Evaluate,
    LocateSamples,
    Message,
    ReadAhead,
)

from .sources import Source

__all__ = [
    "Admission",
    "READERS",
    "BATCH_READERS",
    "EVALUATORS",
    "READS_DATASET",
    "ASSIGNMENT_WAIT_S",
    "UNSYNCED_WAIT_S",
]

#: Who may read a provider's stats.
READERS = ("trainer", "admin")
#: Who may read batches: a reader token's loader too (a script's token: its datasets, no jobs, no
#: evaluations; libbus/security/auth.py ROLES), and an attempt's grant (its job's dataset).
BATCH_READERS = ("trainer", "reader", "admin", "attempt")
#: Who may have a model scored: an attempt's grant too, for its own job only.
EVALUATORS = ("trainer", "admin", "attempt")
#: How long a request from a trainer not (yet) assigned to a job on its dataset waits for the
#: router's word before FORBIDDEN: a trainer given a task connects at once, and the router's
#: Entitlements push may still be on its way.
ASSIGNMENT_WAIT_S = 3.0
#: A provider that has not yet heard from the router at all (just started, its link still connecting
#: on a loaded machine) knows nothing of assignments: its waits begin once the router's first word
#: arrives, and a request still waiting this long without it gets UNAVAILABLE (retryable), never a
#: FORBIDDEN that would fail the job of a trainer the router did assign.
UNSYNCED_WAIT_S = 30.0

#: The requests that name the dataset they read (or score on): their token's scope and the router's assignment
#: are checked against it. A new request that names a dataset joins them.
READS_DATASET = (BatchRequest, DatasetInfoRequest, Evaluate, LocateSamples, ReadAhead)


def _chain(done: Future, into: Future) -> None:
    """Copy a finished future's outcome into another."""
    err = done.exception()
    if err is None:
        into.set_result(done.result())
    else:
        into.set_exception(err)


class Admission:
    """A provider handler's admission of requests (scope, then assignment), and the requests waiting for
    the router's word."""

    datasets: dict[str, Source]
    refused: dict[str, int]
    serve: Callable[[Session, Message], Message | Future | None]

    def init_admission(self, assigned_only: bool) -> None:
        #: Serve a trainer only the datasets of its current job (or its token's explicit scope).
        self.assigned_only = assigned_only
        #: ``{dataset: {token subject}}`` of trainers on a job, as the router last said. Replaced
        #: whole from the router link's thread; read on the serving loop.
        self.assigned: dict[str, frozenset[str]] = {}
        #: When the router's first Entitlements arrived (None: not yet; see UNSYNCED_WAIT_S).
        self.synced_at: float | None = None
        #: Requests waiting for an assignment: (deadline, session, message, future).
        self._waiting: list[tuple[float, Session, Message, Future]] = []

    @property
    def waiting_assignment(self) -> int:
        """Requests waiting now for the router to assign their trainer."""
        return len(self._waiting)

    def set_assigned(self, assigned: dict[str, list[str]]) -> None:
        """Take the router's assignments (any thread: one reference swap)."""
        self.assigned = {name: frozenset(subs) for name, subs in assigned.items()}
        if self.synced_at is None:
            self.synced_at = time.monotonic()

    def check_scope(self, session: Session, msg: Message) -> None:
        """Refuse (FORBIDDEN) a request for a dataset or job outside the token's scopes. A ring
        carries no dataset: it is refused only to a token that may read nothing served here."""
        claims = session.claims
        if isinstance(msg, READS_DATASET):
            claims.check_dataset(msg.dataset)
        if isinstance(msg, Evaluate) and msg.job:
            claims.check_job(msg.job)
        if isinstance(msg, Evaluate) and not msg.job and session.role == "attempt":
            raise Forbidden("an attempt's grant scores models for its own job only: Evaluate must name it")
        if isinstance(msg, AttachRing) and not any(claims.allows_dataset(d) for d in self.datasets):
            raise Forbidden(
                f"this token's datasets scope [{', '.join(claims.scopes['datasets'])}] "
                f"covers none of the datasets served here ({', '.join(sorted(self.datasets))})"
            )

    def entitled(self, session: Session, msg: Message) -> bool:
        """Whether the router has entitled this peer to what ``msg`` reads: admins and readers always
        (a reader's grant is its token's ``datasets`` scope, checked before); a trainer when it runs a
        job on the dataset, or its token names datasets explicitly, or ``assigned_only`` is off; an
        attempt's grant (scoped by the router to its job's dataset) while its trainer runs a job there."""
        if session.role not in ("trainer", "attempt") or not self.assigned_only:
            return True
        if session.role == "trainer" and "datasets" in session.claims.scopes:
            return True
        sub = session.claims.sub
        if isinstance(msg, READS_DATASET):
            return sub in self.assigned.get(msg.dataset, ())
        if isinstance(msg, AttachRing):
            return any(sub in self.assigned.get(name, ()) for name in self.datasets)
        return True

    def handle(self, session: Session, msg: Message) -> Message | Future | None:
        try:
            self.check_scope(session, msg)
        except Forbidden:
            self.refused["scope"] += 1
            raise
        if not self.entitled(session, msg):
            fut: Future = Future()
            self._waiting.append((time.monotonic() + ASSIGNMENT_WAIT_S, session, msg, fut))
            return fut
        return self.serve(session, msg)

    def answer_waiting(self, now: float) -> None:
        """Serve the waiting requests whose assignment arrived; refuse those whose wait ran out."""
        if not self._waiting:
            return
        still = []
        for deadline, session, msg, fut in self._waiting:
            if self.entitled(session, msg):
                try:
                    reply = self.serve(session, msg)
                except Exception as err:  # noqa: BLE001 - a BusError goes to the peer, others as INTERNAL
                    fut.set_exception(err)
                    continue
                if isinstance(reply, Future):
                    reply.add_done_callback(partial(_chain, into=fut))
                else:
                    fut.set_result(reply)
            elif self.synced_at is None:
                if now > deadline - ASSIGNMENT_WAIT_S + UNSYNCED_WAIT_S:
                    fut.set_exception(
                        Unavailable(
                            "this provider has not heard from the router yet, so it knows no assignments; ask again"
                        )
                    )
                else:
                    still.append((deadline, session, msg, fut))
            elif now > max(deadline, self.synced_at + ASSIGNMENT_WAIT_S):
                self.refused["unassigned"] += 1
                what = getattr(msg, "dataset", "") or "any dataset served here"
                fut.set_exception(
                    Forbidden(
                        f"{session.claims.sub!r} is not assigned to a job on {what}; the router assigns "
                        "trainers to jobs (or issue a token scoped to the dataset: busctl token issue --dataset)"
                    )
                )
            else:
                still.append((deadline, session, msg, fut))
        self._waiting = still

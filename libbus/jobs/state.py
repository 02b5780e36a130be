"""A job's lifecycle as one state machine: the states, and the only moves between them.

Modelled on :class:`shm.SlotState` (and mosaicml/streaming's ``_IterState``): the states are an
enum, the allowed transitions a table beside it, and :func:`check_transition` the one guard every
state change of the job store goes through (SQL included: the store binds these values, it
spells none). A move the table does not allow is refused with :class:`IllegalTransition`, naming
the job, both states and what is allowed from there, and counted in :data:`REFUSED`.

::

    queued    -> running (a trainer or gang takes it), paused, stopped, failed (poisoned)
    running   -> queued (handed back, lease lapsed, retryable failure), paused, running,
                 succeeded, failed, stopped
    paused    -> running (resumed on its trainer), queued (resumed without one), paused (its
                 trainer gone: it stays paused), succeeded (a result crossing the pause), stopped,
                 failed
    succeeded -> (nothing: final)
    failed    -> queued (an admin's resume)
    stopped   -> queued (an admin's resume)
"""

from __future__ import annotations

from collections import Counter
from enum import StrEnum

from libbus.errors import BadRequest

__all__ = ["IllegalTransition", "JobState", "REFUSED", "TRANSITIONS", "check_transition"]


class JobState(StrEnum):
    """Where a job is. A ``str`` enum: stored, sent and compared as its value."""

    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)

    @property
    def holding(self) -> bool:
        """A trainer holds the job under a lease."""
        return self in (JobState.RUNNING, JobState.PAUSED)


S = JobState
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.QUEUED: frozenset({S.RUNNING, S.PAUSED, S.STOPPED, S.FAILED}),
    S.RUNNING: frozenset({S.QUEUED, S.PAUSED, S.RUNNING, S.SUCCEEDED, S.FAILED, S.STOPPED}),
    S.PAUSED: frozenset({S.RUNNING, S.QUEUED, S.PAUSED, S.SUCCEEDED, S.STOPPED, S.FAILED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset({S.QUEUED}),
    S.STOPPED: frozenset({S.QUEUED}),
}

#: Refused moves, by ``"from->to"``, since this process started (the router's stats show them).
REFUSED: Counter = Counter()


class IllegalTransition(BadRequest):
    """A state change the job lifecycle does not allow."""


def check_transition(job: str, current: str, new: str) -> JobState:
    """``new`` as a :class:`JobState` if ``job`` may move there from ``current``; else counts the
    attempt and raises :class:`IllegalTransition`."""
    try:
        old, to = JobState(current), JobState(new)
    except ValueError as err:
        REFUSED[f"{current}->{new}"] += 1
        raise IllegalTransition(f"job {job}: {err}; states are {', '.join(s.value for s in JobState)}") from err
    if to not in TRANSITIONS[old]:
        REFUSED[f"{old.value}->{to.value}"] += 1
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[old])) or "nothing (it is final)"
        raise IllegalTransition(
            f"job {job} is {old.value} and cannot become {to.value}; from {old.value} it can become {allowed}"
        )
    return to

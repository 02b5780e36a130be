"""Gangs: the trainers of one job with ``world_size`` > 1, gathered and started together.

The rules, in one place:

- **Gathering.** A queued job with ``world_size: N`` is taken by no single trainer. Each trainer that
  asks for work (``GetTask``) while it is the best queued job it may take joins its gang, in the
  order they ask (that order is their rank), and is told to ask again shortly (``NoTask``). Members
  are kept in the router's memory only: a member that disconnects, or a job that stops being
  queued (paused, stopped), leaves or dissolves the gathering, and a router that restarts gathers
  anew (the trainers keep asking).
- **Start.** With N members the job turns ``running`` under one lease held by rank 0 (``trainer`` of
  the job row; the gang's members, rendezvous and delivered ranks are in its ``gang`` column). Rank 0
  gets its ``Task`` at its next ``GetTask``, opens a torch.distributed TCPStore on its host and
  reports its address (``Rendezvous``); each other rank gets its ``Task`` with that address at its
  next ``GetTask``.
- **One voice.** Rank 0 alone reports progress, checkpoints, command acknowledgements and the
  result; commands go to rank 0, which relays them to the other ranks at the next step
  (services/trainer/attempt/gang.py). The other ranks' liveness is watched by the gang itself: a rank that
  dies breaks rank 0's next collective, and rank 0 fails the attempt as retryable (counted against
  ``max_attempts``). Rank 0's own lease works as for any job: when it lapses the whole attempt is
  released and the job requeued from its last checkpoint, to be gathered again.
- **Never blocking.** A gathering that has not completed within the job's ``gather_timeout_s``
  releases its members to other work; the job then waits out as long before it gathers again
  (other queued jobs go first meanwhile), or fails with the reason (``gather_policy = "fail"``).
  A queued job of higher priority than a gathering's also releases it: priorities hold.
- **Elastic.** A job with ``elastic = true`` gathers up to ``max_world_size`` (its ``world_size``)
  and starts at once with that many; a gathering still short of it when ``gather_timeout_s`` has
  passed starts with the members it has if they are at least ``min_world_size`` (else it is
  released as above). Each rank's ``Task`` carries the world size chosen; a requeued elastic gang
  gathers anew and resumes its checkpoint at its new size (the cursor re-split, libbus/order/elastic.py).
- A rank above 0 that asks for work again after its ``Task`` has finished its part (or left it):
  the job stays with rank 0, which decides its fate.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Set as AbstractSet

from libbus.errors import BadRequest, NotFound
from libbus.jobs.spec import JobSpec
from libbus.jobs.state import JobState
from libbus.wire.messages import NoTask, Task

from .store import JobRow, JobStore, QueuedJob, stored_spec

__all__ = ["Gangs", "GANG_POLL_MS", "min_world_size"]

log = logging.getLogger(__name__)

#: How soon a gathering member asks again (a gang starts when the last member asks).
GANG_POLL_MS = 100
_ADDRESS = re.compile(r"^tcp://[A-Za-z0-9.\-:\[\]]{1,255}:\d{1,5}$")


def min_world_size(spec: JobSpec) -> int:
    """The fewest trainers ``spec`` starts with once its gather timeout has passed (its ``world_size``,
    the most it gathers, unless it is elastic)."""
    return spec.min_world_size if spec.elastic else spec.world_size


def _wanted(spec: JobSpec) -> str:
    low, high = min_world_size(spec), spec.world_size
    return str(high) if low == high else f"{low} to {high}"


class Gangs:
    """Gathers gangs for queued jobs and hands their ranks their tasks.

    Args:
        store: the job database.
        lease_s: the lease a started gang's rank 0 gets.
        retry_ms: what a trainer waiting on its gang is told to wait before asking again.
    """

    def __init__(self, store: JobStore, lease_s: float, retry_ms: int = GANG_POLL_MS):
        self.store = store
        self.lease_s = lease_s
        self.retry_ms = retry_ms
        #: job id -> the trainers gathered for it so far, in rank order.
        self.gathering: dict[str, list[str]] = {}
        #: job id -> when its gathering began (monotonic).
        self.since: dict[str, float] = {}
        #: job id -> until when it gathers no more (its last gathering timed out; policy "wait").
        self.held_back: dict[str, float] = {}

    def waiting(self, job_id: str, now: float | None = None) -> bool:
        """Whether ``job_id`` sits out its turn after a gathering that timed out."""
        return self.held_back.get(job_id, 0.0) > (time.monotonic() if now is None else now)

    def task_for(self, trainer: str) -> Task | NoTask | None:
        """``trainer``'s answer when it is in a gang: its ``Task`` once it may start, ``NoTask``
        while its gang gathers or waits for rank 0's rendezvous; None when it is in no gang."""
        for job, gang in self.store.held_gangs():
            if trainer not in gang["members"]:
                continue
            rank = gang["members"].index(trainer)
            if rank in gang["delivered"]:
                continue  # it ran (or left) its part: it asks for new work
            if rank > 0 and not gang["rendezvous"]:
                return NoTask(retry_ms=self.retry_ms)
            self.store.update_gang(
                job["id"], f"rank {rank} handed to {trainer}", delivered=sorted({*gang["delivered"], rank})
            )
            return Task(
                job=job["id"],
                spec=job["spec"],
                rank=rank,
                world_size=len(gang["members"]),
                resume=None if job["checkpoint"] is None else dict(job["checkpoint"].items()),  # its JSON object
                rendezvous=gang["rendezvous"],
                attempt=max(0, job["attempts"] - 1),  # one number for every rank of this assignment
            )
        if any(trainer in members for members in self.gathering.values()):
            return NoTask(retry_ms=self.retry_ms)
        return None

    def join(self, trainer: str, job: QueuedJob) -> Task | NoTask:
        """``trainer`` joins the gang gathering for queued ``job``; the member that completes it starts the job."""
        members = self.gathering.setdefault(job["id"], [])
        self.since.setdefault(job["id"], time.monotonic())
        members.append(trainer)
        size = stored_spec(job["spec"]).world_size
        self.store.event(job["id"], f"{trainer} joined its gang ({len(members)}/{size})")
        if len(members) < size:
            return NoTask(retry_ms=self.retry_ms)
        self._start(job["id"], members)
        return self.task_for(trainer) or NoTask(retry_ms=self.retry_ms)

    def _start(self, job_id: str, members: list[str]) -> None:
        """Start ``job_id`` on its gathered ``members`` (each gets its ``Task`` at its next ask)."""
        self._dissolve(job_id)
        self.store.form_gang(job_id, members, self.lease_s)
        log.info("job %s: gang of %d formed: %s", job_id, len(members), ", ".join(members))

    def rendezvous(self, job_id: str, address: str) -> None:
        """Rank 0 of ``job_id`` meets its gang at ``address``; the caller checked it is rank 0."""
        if not _ADDRESS.match(address):
            raise BadRequest(f"rendezvous address must be tcp://HOST:PORT, got {address!r}")
        self.store.update_gang(job_id, f"rank 0 waits for its gang at {address}", rendezvous=address)

    def _dissolve(self, job_id: str) -> None:
        self.gathering.pop(job_id, None)
        self.since.pop(job_id, None)

    def tick(self, connected: AbstractSet[str], now: float | None = None) -> bool:
        """Members that disconnected leave their gathering; a job no longer queued dissolves it; a
        gathering past its job's ``gather_timeout_s``, or behind a queued job of higher priority,
        releases its members (or, elastic, starts with them). True if a gang started."""
        now = time.monotonic() if now is None else now
        started = False
        for job_id, until in list(self.held_back.items()):
            if until <= now:
                del self.held_back[job_id]
        for job_id, members in list(self.gathering.items()):
            try:
                job = self.store.get(job_id, events=False)
            except NotFound:  # gone: nothing to gather for
                self._dissolve(job_id)
                continue
            if job["state"] != JobState.QUEUED:
                self._dissolve(job_id)
                continue
            gone = [m for m in members if m not in connected]
            for member in gone:
                members.remove(member)
                self.store.event(job_id, f"{member} left its gathering gang (disconnected)")
            if not members:
                self._dissolve(job_id)
                continue
            if self._released(job, members, now):  # an elastic gang may start instead (members connected)
                started = started or self.store.get(job_id, events=False)["state"] == JobState.RUNNING
        return started

    def _released(self, job: JobRow, members: list[str], now: float) -> bool:
        """Release the gathering of ``job`` if it timed out (then hold the job back, or fail it;
        an elastic job with enough members starts instead) or a queued job of higher priority
        waits. True if released or started."""
        job_id, spec = job["id"], stored_spec(job["spec"])
        timeout = spec.gather_timeout_s
        first = self.store.first_queued(
            accept=lambda j: j["id"] not in self.gathering and not self.waiting(j["id"], now)
        )
        if first is not None and stored_spec(first["spec"]).priority > int(job["priority"]):
            self._dissolve(job_id)
            self.store.event(
                job_id, f"gathering released ({', '.join(members)}): job {first['id']} of higher priority is queued"
            )
            return True
        if now - self.since.get(job_id, now) < timeout:
            return False
        if spec.elastic and len(members) >= min_world_size(spec):
            self.store.event(
                job_id, f"elastic gang starts with {len(members)} of up to {spec.world_size} after {timeout:g} s"
            )
            self._start(job_id, list(members))
            return True
        self._dissolve(job_id)
        reason = (
            f"its gang of {_wanted(spec)} did not gather within {timeout:g} s "
            f"({len(members)} trainer(s) came: {', '.join(members)}); they went to other work"
        )
        if spec.gather_policy == "fail":
            self.store.finish(job_id, JobState.FAILED, reason, error=f"{reason} (gather_policy fail)")
            log.warning("job %s failed: %s", job_id, reason)
        else:
            self.held_back[job_id] = now + timeout
            self.store.event(job_id, f"{reason}; it waits {timeout:g} s before gathering again")
            log.info("job %s: %s", job_id, reason)
        return True

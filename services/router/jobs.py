"""The router's job control: leases, hand-backs, retries, and live commands with acknowledgements.

Kept apart from the handler (which checks roles and scopes, then calls in here) so that the rules a
job lives by read in one place (what a finished job leaves, its scored result and final model, is kept by
:mod:`.job_results`; the samples of its steps, looked up and skipped, are :mod:`.job_samples`):

- A trainer holds a ``running`` or ``paused`` job by a lease (an expiry time in the job store). The
  lease is renewed while the trainer's session is alive (its heartbeats) and by each progress
  report. A lease that lapses takes the job from the trainer: back to ``queued`` with its last
  checkpoint (a paused job stays ``paused``), counted as a lost attempt; ``max_attempts`` lost
  attempts fail the job with the reason.
- A router that starts gives every held job a fresh lease, so trainers that kept training while it
  was down have one lease period to say Hello again.
- ``pause``, ``resume``, ``stop``, ``checkpoint`` and ``set`` for a job on a connected trainer are
  pushed as a ``Command`` with a sequence number (and repeated in the replies to its progress
  reports until acknowledged, in case the push was lost); the admin's ``ControlJob`` is answered when the
  trainer's ``CommandAck`` arrives (or with ``TIMEOUT`` after ``ack_timeout_s``). Each command and
  each acknowledgement is an event of the job.
- ``eval`` (``busctl job eval``) travels the same way, but the trainer acknowledges it only once the
  provider has scored the copied weights, so it waits up to ``EVAL_ACK_TIMEOUT_S``; an
  acknowledgement that comes later still records the result as an event of the job.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from dataclasses import dataclass

from libbus.errors import BadRequest, Forbidden, Timeout, Unavailable
from libbus.jobs.commands import ADMIN_COMMANDS, JobCommand
from libbus.jobs.spec import JobSpec
from libbus.jobs.state import JobState
from libbus.wire.messages import (
    Checkpointed,
    Command,
    CommandAck,
    Message,
    Model,
    Ok,
    Progress,
    PushResult,
    SkipJob,
    Task,
)

from . import job_samples
from .artifacts import Artifacts
from .job_results import JobResults, current_model
from .scores import TestScores
from .store import JobRow, JobStore, stored_spec

__all__ = ["EVAL_ACK_TIMEOUT_S", "JobControl"]

log = logging.getLogger(__name__)

#: How long an admin's command waits for the trainer's acknowledgement.
ACK_TIMEOUT_S = 5.0
#: ``eval`` is acknowledged with the provider's score: the weights cross to it and its test split is
#: read (below the idle limit of an admin's session, 300 s, so the waiting CLI is still there).
EVAL_ACK_TIMEOUT_S = 240.0
#: How often leases are checked.
LEASE_CHECK_S = 0.5
#: Commands remembered for their acknowledgements (a late ``eval`` one still counts): beyond
#: these, the oldest is forgotten and its acknowledgement refused.
SENT_KEPT = 4096


@dataclass
class _Pending:
    """A command pushed to a trainer, waiting for its acknowledgement."""

    job: str
    command: str
    args: dict
    trainer: str
    by: str
    sent: float
    future: Future
    timeout_s: float
    #: The session the command was delivered to (pushed, or repeated in a progress reply): only
    #: that session's acknowledgement settles it.
    sid: str = ""


class JobControl:
    """Leases and commands over a :class:`JobStore`.

    Args:
        store: the job database.
        push: sends a message to a trainer by its token subject; returns the session id it went to,
            or "" if the trainer is not connected.
        connected: the subjects of the trainers connected now.
        lease_s: lease length.
        ack_timeout_s: how long a command waits for the trainer's acknowledgement.
        artifacts: where final models sent with a result are kept (None: not kept).
    """

    def __init__(
        self,
        store: JobStore,
        push: Callable[[str, Message], str],
        connected: Callable[[], AbstractSet[str]],
        *,
        lease_s: float,
        ack_timeout_s: float = ACK_TIMEOUT_S,
        artifacts: Artifacts | None = None,
    ):
        self.store = store
        #: What a job leaves: its scored result and its final model (:mod:`.job_results`).
        self.results = JobResults(artifacts)
        self.push = push
        self.connected = connected
        self.lease_s = lease_s
        self.ack_timeout_s = ack_timeout_s
        self.stop_requested: set[str] = set()
        self.pending: dict[int, _Pending] = {}
        #: Commands sent, oldest first (the last ``SENT_KEPT``): seq -> (job, trainer, command,
        #: acknowledged). A late acknowledgement (after its timeout) is still recorded; one this
        #: router never sent is refused.
        self.sent: OrderedDict[int, tuple[str, str, str, bool]] = OrderedDict()
        #: trainer -> (key of its last GetTask that got a job, that Task): a resend gets it again.
        self.tasks: dict[str, tuple[str, Task]] = {}
        #: Command ids: this start's router epoch in the high bits, so none repeats an earlier
        #: start's (a trainer applies each id once and remembers those it has seen).
        self.epoch = store.next_epoch()
        self._seq = itertools.count((self.epoch << 32) + 1)
        self._last_check = 0.0
        renewed = store.renew_all(lease_s)
        if renewed:
            log.info("%d job(s) held by trainers: each has %.0f s to reconnect", renewed, lease_s)

    @property
    def scores(self) -> TestScores:
        """Providers' reports of their evaluations: the only source of a job's test score."""
        return self.results.scores

    # -- admin commands ---------------------------------------------------------------------------
    def control(self, by: str, job_id: str, command: str, args: dict) -> Ok | Future:
        """Apply ``command`` to ``job_id`` for admin ``by``: at once when no trainer holds the job,
        else by pushing it to the trainer (the returned future resolves on its acknowledgement)."""
        if command not in ADMIN_COMMANDS:
            raise BadRequest(f"unknown command {command!r}; supported: {', '.join(ADMIN_COMMANDS)}")
        cmd = JobCommand(command)
        job = self.store.get(job_id, events=False)
        state, trainer = JobState(job["state"]), job["trainer"]
        spec = None
        if cmd is JobCommand.SET:
            spec = stored_spec(job["spec"]).with_hyper(args)
        elif cmd is JobCommand.ADOPT:
            _check_adopt(args)
        elif args:
            raise BadRequest(f"{cmd} takes no arguments, got {', '.join(args)}")
        if cmd is JobCommand.RESUME and state in (JobState.STOPPED, JobState.FAILED):
            return self._restart(by, job)
        if state.terminal:
            hint = "; its final scores are in busctl job show" if cmd is JobCommand.EVAL else ""
            raise BadRequest(f"job {job_id} already ended ({state}){hint}")
        if trainer is None or state is JobState.QUEUED:
            return self._without_trainer(by, job, cmd, spec)
        if cmd is JobCommand.STOP:
            self.stop_requested.add(job_id)
        if (cmd, state) in ((JobCommand.PAUSE, JobState.PAUSED), (JobCommand.RESUME, JobState.RUNNING)):
            return Ok(detail={"state": state, "trainer": trainer, "acked": True, "note": f"already {state}"})
        if trainer not in self.connected():
            if cmd is JobCommand.STOP:
                self.store.finish(job_id, JobState.STOPPED, f"stopped by {by}; trainer {trainer} absent")
                self.stop_requested.discard(job_id)
                return Ok(detail={"state": JobState.STOPPED})
            raise Unavailable(
                f"trainer {trainer} of job {job_id} is not connected now; its lease "
                f"decides the job's fate (try again, or stop the job)"
            )
        return self._send(by, job_id, trainer, cmd, args)

    def _send(self, by: str, job_id: str, trainer: str, command: JobCommand, args: dict) -> Future:
        seq = next(self._seq)
        future: Future = Future()
        timeout_s = EVAL_ACK_TIMEOUT_S if command.slow else self.ack_timeout_s
        pending = _Pending(job_id, command, args, trainer, by, time.monotonic(), future, timeout_s)
        self.pending[seq] = pending
        self.sent[seq] = (job_id, trainer, str(command), False)
        while len(self.sent) > SENT_KEPT:
            self.sent.popitem(last=False)
        what = f"{command} {_args(args)}".strip()
        self.store.event(
            job_id, f"{what if command is not JobCommand.ADOPT else command} requested by {by}, sent to {trainer}"
        )
        pending.sid = self.push(trainer, Command(job=job_id, command=command, args=args, seq=seq)) or ""
        log.info("job %s: %s requested by %s, sent to %s", job_id, what, by, trainer)
        return future

    def _without_trainer(self, by: str, job: JobRow, command: JobCommand, spec: JobSpec | None) -> Ok:
        job_id, state = job["id"], JobState(job["state"])
        if command is JobCommand.STOP:
            self.store.finish(job_id, JobState.STOPPED, f"stopped by {by} while {state}")
            return Ok(detail={"state": JobState.STOPPED})
        if command is JobCommand.PAUSE:
            if state is not JobState.PAUSED:
                self.store.set_state(job_id, JobState.PAUSED, f"paused by {by} while {state}; no trainer has it")
            return Ok(detail={"state": JobState.PAUSED})
        if command is JobCommand.RESUME:
            if state is JobState.PAUSED:
                self.store.set_state(job_id, JobState.QUEUED, f"resumed by {by}; waits for a trainer")
            return Ok(detail={"state": JobState.QUEUED})
        if command is JobCommand.SET and spec is not None:
            self.store.set_spec(job_id, spec, f"set {_args(spec.to_dict(), job['spec'])} by {by}")
            return Ok(detail={"state": state, "spec": spec.to_dict()})
        what = {
            JobCommand.EVAL: "be evaluated (busctl job eval scores the weights of a running job)",
            JobCommand.MODEL: "send its current weights (busctl job model without --current: a succeeded job's)",
            JobCommand.ADOPT: "adopt a checkpoint",
        }.get(command, JobCommand.CHECKPOINT.value)
        raise BadRequest(f"job {job_id} is {state} on no trainer; only a job a trainer holds can {what}")

    def _restart(self, by: str, job: JobRow) -> Ok:
        """Resume a stopped or failed job: back in the queue, from its last checkpoint."""
        ckpt = job["checkpoint"]
        where = f"from step {ckpt['step']}" if ckpt else "from the start (no checkpoint)"
        self.store.reopen(job["id"], f"resumed by {by} after it {job['state']}, {where}")
        return Ok(detail={"state": JobState.QUEUED, "resume": ckpt})

    # -- trainer reports ----------------------------------------------------------------------------
    def own(self, trainer: str, job_id: str) -> JobRow:
        """The job ``trainer`` holds, or :class:`Forbidden` telling it to abandon the job."""
        job = self.store.get(job_id, events=False)
        if not JobState(job["state"]).holding or job["trainer"] != trainer:
            raise Forbidden(
                f"job {job_id} is not running on {trainer} (state {job['state']}, trainer {job['trainer']}); abandon it"
            )
        return job

    def on_progress(
        self, trainer: str, msg: Progress, sid: str = "", judge: Callable[[str, dict], None] | None = None
    ) -> Ok:
        """Store the report, then ``judge(job, progress)`` it (the router's decisions at an epoch's
        report); the reply repeats the job's unacknowledged commands, so one whose push was lost (the
        trainer reconnected as it was sent) still arrives — at session ``sid`` now — and a command
        the judgement just sent rides on this very reply, ahead of whatever the trainer does next."""
        self.own(trainer, msg.job)
        self.store.set_progress(msg.job, msg.progress, self.lease_s)
        if judge is not None:
            judge(msg.job, msg.progress)
        commands = []
        for seq, p in self.pending.items():
            if p.job == msg.job and p.trainer == trainer:
                p.sid = sid or p.sid
                commands.append({"command": p.command, "args": p.args, "seq": seq})
        return Ok(detail={"stop": msg.job in self.stop_requested, "commands": commands})

    def on_checkpoint(self, trainer: str, msg: Checkpointed) -> Ok:
        self.own(trainer, msg.job)
        record = self.store.add_checkpoint(msg.job, trainer, msg.checkpoint)
        self.store.renew(msg.job, self.lease_s)
        log.info("job %s: checkpoint at step %d (epoch %d) on %s", msg.job, record["step"], record["epoch"], trainer)
        return Ok()

    def on_ack(self, trainer: str, msg: CommandAck, sid: str = "") -> Ok:
        if msg.command not in ADMIN_COMMANDS:
            raise BadRequest(
                f"CommandAck.command {msg.command[:64]!r} is not a job command; one of {', '.join(ADMIN_COMMANDS)}"
            )
        job = self.own(trainer, msg.job)
        pending = self.pending.get(msg.seq)
        if pending is not None and (
            pending.job != msg.job or pending.trainer != trainer or (sid and pending.sid and pending.sid != sid)
        ):
            raise Forbidden(
                f"command {msg.seq} was sent to job {pending.job} on another session; "
                f"this acknowledgement (job {msg.job}) does not settle it"
            )
        sent = self.sent.get(msg.seq)
        if sent is None or sent[:3] != (msg.job, trainer, msg.command):
            # only a command this router sent this job's trainer is acknowledged (and logged): a
            # trainer cannot write events of its own making, nor evict the job's real ones with them.
            # BAD_REQUEST, not FORBIDDEN: a trainer told FORBIDDEN gives its job up (reports.py), and
            # a stale acknowledgement (a router restarted since) is no reason to
            raise BadRequest(
                f"command {msg.seq} ({msg.command}) was not sent to job {msg.job} on {trainer} by this router; "
                "nothing to acknowledge"
            )
        if sent[3]:
            return Ok(detail={"duplicate": True})  # resent after a reconnect: already recorded
        self.sent[msg.seq] = (*sent[:3], True)
        self.pending.pop(msg.seq, None)
        took = f" after {1000 * (time.monotonic() - pending.sent):.0f} ms" if pending else ""
        reason = f"{msg.command} acknowledged by {trainer}{took}" + _evaluation(msg) + _adopted(msg)
        applied = msg.detail.get("set")
        if msg.command == JobCommand.SET and isinstance(applied, dict) and applied:
            # what the trainer applied, checked like an admin's `set`: a trainer changes nothing else
            self.store.set_spec(msg.job, stored_spec(job["spec"]).with_hyper(applied), reason)
        elif msg.state in (JobState.RUNNING, JobState.PAUSED) and msg.state != job["state"]:
            self.store.set_state(msg.job, msg.state, reason)
        else:
            self.store.event(msg.job, reason)
        if pending is not None and not pending.future.done():
            detail = {
                "state": msg.state,
                "trainer": trainer,
                "acked": True,
                "ack_ms": round(1000 * (time.monotonic() - pending.sent), 1),
                **msg.detail,
            }
            pending.future.set_result(
                current_model(msg, detail) if msg.command == JobCommand.MODEL else Ok(detail=detail)
            )
        return Ok()

    def on_result(self, trainer: str, msg: PushResult) -> Ok:
        job = self.store.get(msg.job, events=False)
        if job["state"] == msg.state and job["trainer"] == trainer:
            return Ok(detail={"duplicate": True})  # resent after a reconnect: already stored
        self.own(trainer, msg.job)
        result = self.results.scored(trainer, msg, job)
        self._forget_commands(msg.job, f"job {msg.job} left trainer {trainer} ({msg.state})")
        stop = msg.job in self.stop_requested
        self.stop_requested.discard(msg.job)
        if msg.state == JobState.QUEUED:  # handed back (the trainer is shutting down): not a lost attempt
            why = f"handed back by {trainer}" + (f": {msg.error}" if msg.error else "")
            if stop:
                self.store.finish(msg.job, JobState.STOPPED, f"stop requested; {why}", result=result)
            else:
                self.store.release(msg.job, why, lost=False)
            return Ok()
        if msg.state == JobState.FAILED and msg.result.get("retryable") and stop:  # the stop stands
            self.store.finish(
                msg.job,
                JobState.STOPPED,
                f"stop requested; attempt failed on {trainer}: {msg.error}",
                result=result,
                error=msg.error,
            )
            return Ok()
        if msg.state == JobState.FAILED and msg.result.get("retryable"):  # counted against max_attempts
            state = self.store.release(msg.job, f"attempt failed on {trainer}: {msg.error}", lost=True)
            log.warning("job %s %s after a failed attempt: %s", msg.job, state, msg.error)
            return Ok()
        reasons: dict[str, str] = {
            JobState.SUCCEEDED: f"finished on {trainer}",
            JobState.STOPPED: f"stopped on {trainer}",
            JobState.FAILED: f"failed on {trainer}: {msg.error}",
        }
        reason = reasons.get(msg.state, msg.state)
        result = self.results.keep_model(msg, result)
        self.store.finish(msg.job, msg.state, reason, result=result, error=msg.error)
        log.info("job %s %s: %s", msg.job, msg.state, result or msg.error)
        return Ok()

    def model(self, job_id: str) -> Model:
        """The final weights of a succeeded job, as the router keeps them (:class:`~.job_results.JobResults`)."""
        return self.results.model(self.store.get(job_id, events=False))

    # -- skips (services/router/job_samples.py) ----------------------------------------------------
    def skip(self, by: str, msg: SkipJob, split_size: Callable[[str], int | None]) -> Ok:
        """``busctl job skip`` (:func:`~services.router.job_samples.skip`): the job rewinds, and a trainer
        that holds it gives it up (told at its next report) so that the next attempt resumes without the
        skipped samples."""
        done = job_samples.skip(self.store, by, msg, split_size)
        job = done.job
        if JobState(job["state"]).holding and job["trainer"]:
            self._forget_commands(msg.job, f"job {msg.job} rewound by a skip")
            self.stop_requested.discard(msg.job)
            self.store.release(
                msg.job, f"taken from {job['trainer']} to resume without the skipped samples", lost=False
            )
        log.info("job %s: %s", msg.job, done.reason)
        return done.reply

    def remember_task(self, trainer: str, key: str, task: Task) -> Task:
        """Keep ``task`` as the answer to ``trainer``'s ask ``key`` (one per trainer)."""
        if key:
            self.tasks[trainer] = (key, task)
        return task

    def assigned_again(self, trainer: str, key: str) -> Task | None:
        """The task ``trainer``'s ask ``key`` was given, if this is that ask again and the trainer
        still holds the job (then it is no abandonment and costs no attempt)."""
        given = self.tasks.get(trainer)
        if not key or given is None or given[0] != key:
            return None
        job = self.store.get(given[1].job, events=False)
        if not JobState(job["state"]).holding or job["trainer"] != trainer:
            return None
        log.info("job %s: %s asked again (a resend); same task, no attempt lost", job["id"], trainer)
        return given[1]

    def abandon_all(self, trainer: str) -> None:
        """``trainer`` asks for work, so it holds nothing: whatever it held was lost."""
        for job in self.store.held_by(trainer):
            self._lose(job, f"trainer {trainer} asked for new work; its job was abandoned")

    # -- timers --------------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Renew the leases of connected trainers, take jobs from lapsed ones, time out commands."""
        for seq, p in list(self.pending.items()):
            if now - p.sent > p.timeout_s:
                del self.pending[seq]
                if not p.future.done():
                    p.future.set_exception(
                        Timeout(
                            f"trainer {p.trainer} has not acknowledged {p.command} of job {p.job} within "
                            f"{p.timeout_s:.0f} s; it applies commands between batches (busctl job show "
                            f"{p.job} logs the acknowledgement when it comes)"
                        )
                    )
        if now - self._last_check < LEASE_CHECK_S:
            return
        self._last_check = now
        connected = self.connected()
        wall = time.time()
        renew = []
        for job_id, trainer, expires in self.store.held_leases():
            if trainer in connected:
                if expires - wall < self.lease_s / 2:
                    renew.append(job_id)
            elif expires < wall:
                job = self.store.get(job_id, events=False)
                self._lose(job, f"lease of trainer {trainer} lapsed (not heard from for {self.lease_s:.0f} s)")
        if renew:  # one transaction for all of them, not one commit each
            self.store.renew_many(renew, self.lease_s)

    def _forget_commands(self, job_id: str, why: str) -> None:
        """A job that leaves its trainer takes no more commands there: fail those still waiting, so
        that none is repeated to the job's next attempt."""
        for seq, p in list(self.pending.items()):
            if p.job == job_id:
                del self.pending[seq]
                if not p.future.done():
                    p.future.set_exception(Unavailable(f"{why} before acknowledging {p.command}"))

    def _lose(self, job: JobRow, reason: str) -> None:
        self._forget_commands(job["id"], f"job {job['id']} lost trainer {job['trainer']}")
        if job["id"] in self.stop_requested:
            self.stop_requested.discard(job["id"])
            self.store.finish(job["id"], JobState.STOPPED, f"stop requested; {reason}")
            return
        state = self.store.release(job["id"], reason, lost=True)
        log.warning("job %s %s: %s", job["id"], state, reason)


def _check_adopt(args: dict) -> None:
    """``adopt`` names the checkpoint to load (its record, as the router keeps it) and whose it is."""
    record = args.get("checkpoint")
    if (
        set(args) - {"checkpoint", "from"}
        or not isinstance(record, dict)
        or not all(isinstance(record.get(k), t) for k, t in (("path", str), ("sha256", str), ("step", int)))
    ):
        raise BadRequest("adopt takes {checkpoint: {path, sha256, step, ...}, from: JOB}")


def _adopted(msg: CommandAck) -> str:
    """What an ``adopt`` acknowledgement says it loaded, for the job's events ("" for other commands)."""
    if msg.command != JobCommand.ADOPT:
        return ""
    done = msg.detail.get("adopted")
    if isinstance(done, dict):
        return f": loaded step {done.get('step')} of job {done.get('from')}"
    return f": not loaded: {msg.detail.get('error', 'no detail')}"


def _evaluation(msg: CommandAck) -> str:
    """What an ``eval`` acknowledgement found, for the job's events ("" for other commands)."""
    d = msg.detail
    if msg.command != JobCommand.EVAL:
        return ""
    acc, loss = d.get("test_accuracy"), d.get("test_loss")
    if isinstance(acc, (int, float)) and isinstance(loss, (int, float)):
        return (
            f": step {d.get('step')} scored on {d.get('provider')}: test accuracy {acc:.4f}, "
            f"loss {loss:.4f} on {d.get('test_n')} samples"
        )
    return f": evaluation failed: {d.get('error', 'no result')}"


def _args(args: dict, before: dict | None = None) -> str:
    """``k=v`` pairs of ``args`` (only those that differ from ``before``, when given)."""
    return " ".join(f"{k}={v}" for k, v in args.items() if before is None or before.get(k) != v)

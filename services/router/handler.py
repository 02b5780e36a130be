"""The router's logic: jobs, commands, evaluations, statistics. No sockets here.

The handler is assembled from parts, one module each: its sessions and discovery (``Resolve``,
``ListPeers``) in :mod:`.peers`, what providers are told (revocations, assignments) in :mod:`.grants`,
studies and early stopping in :mod:`.judges`, the models tasks carry in :mod:`.task_models`; the rules
a job lives by (leases, commands) in :mod:`.jobs`.

Identity is the token's subject (``session.subject``; under CURVE also the key's name): job
ownership, leases, pushes, acknowledgements, gang membership and provider grants all key on it.
``Hello.name`` is a label for operators. One process holds a trainer service's or a provider's
subject at a time: a ``Hello`` of the same subject from another process (host id, pid) is refused
UNAVAILABLE while the first one's session lives (a restarted service gets in once its old session
expires). A loader's session (``Hello.caps.loader``, sent by ``RemoteLoader``) holds nothing that
must have one holder: the ranks of one script, or several scripts, share one trainer token, and
such a session may only resolve datasets (:data:`LOADER_REQUESTS`), never take jobs or commands.
A ``reader`` token (what scripts are given) opens nothing but such sessions: it reads its datasets and
can never act as a trainer service (no task, progress, checkpoint, acknowledgement or result).

Each ``Task`` carries its attempt's grant (``Task.grant``): an ``attempt`` token, minted here with the
cluster's signing key, scoped to that job and its dataset (:meth:`RouterHandler.grant_for`). The
attempt's process (a tenant's code) holds that and not its trainer's token; the router opens no
session for it at all (its reports reach the router through its trainer), so it can neither take a
job nor act as its trainer here. A trainer renews the grant of a job it still holds (``RenewGrant``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypedDict

from libbus.constants import STORED_JSON_BYTES, STORED_JSON_DEPTH
from libbus.errors import BadRequest, Forbidden, NotFound, Unavailable
from libbus.jobs.spec import JobSpec, dataset_name
from libbus.jobs.state import REFUSED, JobState
from libbus.security.auth import Claims
from libbus.serve.handler import serves
from libbus.serve.server import Handler, ServerStats, Session
from libbus.wire.messages import (
    ChargeEvaluation,
    Checkpointed,
    CommandAck,
    ControlJob,
    EvaluationCharged,
    EvaluationReport,
    GetJob,
    GetJobLogs,
    GetJobSamples,
    GetModel,
    GetTask,
    Grant,
    JobInfo,
    JobList,
    JobLog,
    JobLogs,
    JobSamples,
    JobSubmitted,
    ListJobs,
    Message,
    Model,
    NoTask,
    Ok,
    Progress,
    PushResult,
    Rendezvous,
    RenewGrant,
    SkipJob,
    Stats,
    StatsReply,
    SubmitJob,
    Task,
)
from libbus.wire.schema import check_stored

from ..importable import TrainerModules
from . import job_samples
from .artifacts import Artifacts
from .eval_budget import EvalBudget
from .gangs import Gangs
from .grants import ProviderGrants
from .jobs import JobControl
from .judges import Judges
from .logs import JobOutput
from .peers import Peers
from .replies import fit_job, fit_list, fit_rows
from .store import JobRow, JobStore, JobView, stored_spec
from .task_models import TaskModels

__all__ = ["RouterHandler", "RouterRow", "RouterStats"]


def _stored(value, what: str) -> None:
    """Peer JSON the router stores and echoes to admins: bounded at the door (libbus/wire/schema.py)."""
    check_stored(value, what, STORED_JSON_DEPTH, STORED_JSON_BYTES)


log = logging.getLogger(__name__)

ADMIN = ("admin",)
TRAINER = ("trainer",)
TRAINER_OR_ADMIN = ("trainer", "admin")
#: What a loader's session may ask the router (services/router/handler.py docstring).
LOADER_REQUESTS = frozenset({"Resolve", "Stats"})


class RouterStats(TypedDict):
    """The router's own figures in its ``Stats`` row and metrics."""

    #: Jobs by state.
    jobs: dict[str, int]
    #: Sessions open by kind (``provider``, ``trainer``, ``loader``, ``admin``).
    peers: dict[str, int]
    #: Refused job state moves by ``"from->to"``, since the start.
    refused_transitions: dict[str, int]


class RouterRow(ServerStats, RouterStats):
    """The router's ``Stats`` row (``role`` ``router`` before it on the wire) and what its metrics read."""


class RouterHandler(Peers, ProviderGrants, Judges, TaskModels, Handler):
    """Registers providers and trainers, resolves datasets, runs the job queue.

    Args:
        store: the job database.
        lease_s: how long a trainer holds a job without being heard from (services/router/jobs.py).
        artifacts: where the final models trainers send with their results are kept.
        task_retry_ms: what ``NoTask`` tells an idle trainer to wait before asking again.
        mint_grant: ``(trainer subject, job, dataset) -> token``: an attempt's grant (None: this router
            holds no signing key, and its tasks carry none; their attempts then read nothing).
    """

    #: Replies wait for :meth:`flush`: a transition is acknowledged once it is on disk.
    group_commit = True

    def __init__(
        self,
        store: JobStore,
        *,
        lease_s: float = 10.0,
        task_retry_ms: int = 1000,
        server_stats: Callable[[], ServerStats] | None = None,
        artifacts: Artifacts | None = None,
        mint_grant: Callable[[str, str, str], str] | None = None,
    ):
        super().__init__()
        self.store = store
        self.mint_grant = mint_grant
        self.artifacts = artifacts
        self.task_retry_ms = task_retry_ms
        self.server_stats = server_stats
        self.init_peers()
        self.jobs = JobControl(store, self._push_to_trainer, self._trainer_names, lease_s=lease_s, artifacts=artifacts)
        self.gangs = Gangs(store, lease_s)
        self.output = JobOutput(store.db)
        #: Each dataset's evaluation budget and noise key, one for all its providers (services/router/eval_budget.py).
        self.eval_budget = EvalBudget(store.db, store.durability)
        #: What each trainer session can import for jobs (its Hello's caps.job_modules): checked at submit.
        self.trainer_modules = TrainerModules()
        self.init_grants()
        self.init_judges()

    # -- scopes -------------------------------------------------------------------------------
    def _check_job_scope(self, session: Session, job_id: str) -> JobRow:
        """An admin's job operation: the token's ``jobs`` scope, and its ``datasets`` scope on the
        job's dataset. Returns the job."""
        session.claims.check_job(job_id)
        job = self.store.get(job_id, events=False)
        session.claims.check_dataset(dataset_name(job["spec"]["dataset"]))
        return job

    # -- dispatch -----------------------------------------------------------------------------
    def handle(self, session: Session, msg: Message) -> Message | Future | None:
        if session.loader and msg.type not in LOADER_REQUESTS:
            raise Forbidden(
                f"{msg.type} comes from a trainer service; this session said Hello as a loader "
                f"(caps.loader), which may only send {', '.join(sorted(LOADER_REQUESTS))}"
            )
        return self.dispatch(session, msg)

    # -- requests (each method marked with the message it serves and who may send it) ------------
    @serves(SubmitJob, *ADMIN)
    def on_SubmitJob(self, session: Session, msg: SubmitJob) -> JobSubmitted:
        spec = JobSpec.from_dict(msg.spec)
        session.claims.check_dataset(dataset_name(spec.dataset))
        # an evaluate task's model, within the submitter's scopes (services/router/task_models.py)
        spec = self.evaluation_spec(spec, msg.frames, session.claims)
        note = self.trainer_modules.check(spec)  # a module no connected trainer can import: refused here
        job = self.store.submit(spec)
        if msg.frames:
            self.keep_upload(job, msg.frames)
        log.info("job %s submitted by %s: %s %s on %s", job, session.subject, spec.model, spec.optimizer, spec.dataset)
        return JobSubmitted(job=job, note=note)

    @serves(ListJobs, *ADMIN)
    def on_ListJobs(self, session: Session, msg: ListJobs) -> JobList:
        # A scoped token sees only the jobs it could ask about one by one.
        claims = session.claims
        jobs = [
            j
            for j in self.store.list(msg.state, msg.limit, msg.offset)
            if claims.allows_job(j["id"]) and claims.allows_dataset(dataset_name(j["spec"]["dataset"]))
        ]
        jobs, note = fit_list(jobs)
        return JobList(jobs=jobs, note=note)

    @serves(GetJob, *ADMIN)
    def on_GetJob(self, session: Session, msg: GetJob) -> JobInfo:
        self._check_job_scope(session, msg.job)
        view: JobView = {**self.store.get(msg.job, limit=msg.events, offset=msg.offset)}
        if msg.progress > 0:
            view["progress_history"] = self.store.progress_history(msg.job, min(msg.progress, 1000))
        view, note = fit_job(view)
        return JobInfo(job=dict(view.items()), note=note)  # the message's JSON object

    @serves(ControlJob, *ADMIN)
    def on_ControlJob(self, session: Session, msg: ControlJob) -> Ok | Future:
        self._check_job_scope(session, msg.job)
        return self.jobs.control(session.subject, msg.job, msg.command, msg.args)

    @serves(GetJobSamples, *ADMIN)
    def on_GetJobSamples(self, session: Session, msg: GetJobSamples) -> JobSamples:
        self._check_job_scope(session, msg.job)
        return job_samples.step_samples(self.store, msg, self._train_size)  # derived from its spec and segments

    @serves(SkipJob, *TRAINER_OR_ADMIN)
    def on_SkipJob(self, session: Session, msg: SkipJob) -> Ok:
        if session.role == "trainer":  # a loss spike's stretch, asked by the trainer holding the job
            session.claims.check_job(msg.job)
            if not msg.spike:
                raise Forbidden("a trainer skips only a loss spike's stretch (SkipJob.spike) of the job it holds")
            self.jobs.own(session.subject, msg.job)
        else:
            self._check_job_scope(session, msg.job)
        return self.jobs.skip(session.subject, msg, self._train_size)

    @serves(GetModel, *ADMIN)
    def on_GetModel(self, session: Session, msg: GetModel) -> Model:
        self._check_job_scope(session, msg.job)
        return self.jobs.model(msg.job)

    @serves(GetTask, *TRAINER)
    def on_GetTask(self, session: Session, msg: GetTask) -> Task | NoTask:
        who = session.subject
        gang_task = self.gangs.task_for(who)  # services/router/gangs.py
        if isinstance(gang_task, Task):
            return self.handed(who, gang_task, stored_spec(gang_task.spec), gang=True)
        if gang_task is not None:
            return gang_task
        again = self.jobs.assigned_again(who, msg.key)
        if again is not None:  # a resend of the ask that was given this job: the same answer
            return again
        self.jobs.abandon_all(who)
        claims = session.claims
        job = self.store.first_queued(
            accept=lambda j: (
                claims.allows_job(j["id"])
                and claims.allows_dataset(dataset_name(j["spec"]["dataset"]))
                and not self.gangs.waiting(j["id"])
            )
        )
        if job is None:
            return NoTask(retry_ms=self.task_retry_ms)
        try:
            spec = stored_spec(job["spec"])  # read from the store: parsed once, typed from here on
        except BadRequest as err:  # a row changed behind the router's back: failed here, sent to no trainer
            log.error("job %s failed: its stored spec cannot be read: %s", job["id"], err)
            self.store.finish(job["id"], JobState.FAILED, f"its stored spec cannot be read: {err}", error=str(err))
            return NoTask(retry_ms=self.task_retry_ms)
        if spec.world_size > 1:
            reply = self.gangs.join(who, job)
            self._push_entitlements()  # a formed gang's providers hear of it before its ranks ask them
            return self.handed(who, reply, spec, gang=True) if isinstance(reply, Task) else reply
        queued = job["id"]
        job = self.store.claim(who, self.jobs.lease_s, accept=lambda j: j["id"] == queued)
        if job is None:  # not on this loop: it was queued a moment ago
            return NoTask(retry_ms=self.task_retry_ms)
        log.info("job %s assigned to %s (%s)", job["id"], who, session.name)
        resume = None if job["checkpoint"] is None else dict(job["checkpoint"].items())  # its JSON object
        task = Task(job=job["id"], spec=job["spec"], resume=resume, attempt=max(0, job["attempts"] - 1))
        return self.jobs.remember_task(who, msg.key, self.handed(who, task, spec))

    def handed(self, trainer: str, task: Task, spec: JobSpec, gang: bool = False) -> Task:
        """``task`` as ``trainer`` gets it (``spec``: its spec, typed): its dataset's providers told (at
        the next tick), its attempt's grant (services/router/handler.py docstring) and the model it
        carries (every rank of a ``gang`` the same)."""
        if not gang:
            self._grant(spec.dataset, trainer)  # a formed gang's providers heard of it as it formed
        task.grant = self.grant_for(trainer, task.job, spec.dataset)
        return self.attach_gang_model(task, spec) if gang else self.attach_model(task, spec)

    def grant_for(self, trainer: str, job: str, dataset: str) -> str:
        """An ``attempt`` token for ``trainer``'s attempt of ``job``: its subject the trainer's (the
        providers' assignments and CURVE keys name it), scoped to the job and its dataset; "" where
        this router cannot mint."""
        if self.mint_grant is None:
            return ""
        return self.mint_grant(trainer, job, dataset)

    @serves(RenewGrant, *TRAINER)
    def on_RenewGrant(self, session: Session, msg: RenewGrant) -> Grant:
        session.claims.check_job(msg.job)
        job = self.store.get(msg.job, events=False)
        gang = job["gang"]
        members = gang["members"] if gang is not None else [job["trainer"]]  # a gang's ranks, or its one trainer
        if not JobState(job["state"]).holding or session.subject not in members:
            raise Forbidden(
                f"job {msg.job} is not running on {session.subject} (state {job['state']}); its attempt's grant "
                "is renewed only for the trainer holding it"
            )
        token = self.grant_for(session.subject, msg.job, stored_spec(job["spec"]).dataset)
        if not token:
            raise Unavailable("this router holds no signing key: it mints no attempt grants")
        return Grant(token=token)

    @serves(Rendezvous, *TRAINER)
    def on_Rendezvous(self, session: Session, msg: Rendezvous) -> Ok:
        session.claims.check_job(msg.job)
        self.jobs.own(session.subject, msg.job)  # rank 0 holds the job
        self.gangs.rendezvous(msg.job, msg.address)
        return Ok()

    @serves(Progress, *TRAINER)
    def on_Progress(self, session: Session, msg: Progress) -> Ok:
        session.claims.check_job(msg.job)
        _stored(msg.progress, "Progress.progress")
        # its new epoch judged now (studies, early stopping): a stop decided here rides on the reply
        return self.jobs.on_progress(session.subject, msg, session.sid, judge=self.judge_report)

    @serves(JobLog, *TRAINER)
    def on_JobLog(self, session: Session, msg: JobLog) -> Ok:
        session.claims.check_job(msg.job)
        self.jobs.own(session.subject, msg.job)  # only the job's trainer adds to its output
        self.output.add(msg.job, msg.attempt, msg.seq, msg.lines)
        return Ok()

    @serves(GetJobLogs, *ADMIN)
    def on_GetJobLogs(self, session: Session, msg: GetJobLogs) -> JobLogs:
        self._check_job_scope(session, msg.job)
        attempt, lines, nxt, dropped, attempts = self.output.read(msg.job, msg.attempt, msg.after, msg.limit)
        return JobLogs(job=msg.job, attempt=attempt, lines=lines, next=nxt, dropped=dropped, attempts=attempts)

    @serves(Checkpointed, *TRAINER)
    def on_Checkpointed(self, session: Session, msg: Checkpointed) -> Ok:
        session.claims.check_job(msg.job)
        _stored(msg.checkpoint, "Checkpointed.checkpoint")
        return self.jobs.on_checkpoint(session.subject, msg)

    @serves(CommandAck, *TRAINER)
    def on_CommandAck(self, session: Session, msg: CommandAck) -> Ok:
        session.claims.check_job(msg.job)
        _stored(msg.detail, "CommandAck.detail")
        return self.jobs.on_ack(session.subject, msg, session.sid)

    @serves(PushResult, *TRAINER)
    def on_PushResult(self, session: Session, msg: PushResult) -> Ok:
        session.claims.check_job(msg.job)
        _stored(msg.result, "PushResult.result")
        _stored(msg.error, "PushResult.error")
        return self.jobs.on_result(session.subject, msg)

    @serves(EvaluationReport, "provider")
    def on_EvaluationReport(self, session: Session, msg: EvaluationReport) -> Ok:
        """A provider's word on an evaluation it released for a job (services/router/scores.py)."""
        if msg.dataset not in session.hello.caps.get("datasets", {}):
            raise Forbidden(f"provider {session.name} does not serve {msg.dataset!r}; its reports on it are not taken")
        _stored(msg.metrics, "EvaluationReport.metrics")
        try:
            job = self.jobs.store.get(msg.job, events=False)
        except NotFound:
            job = None
        return self.jobs.scores.on_report(session.name, msg, job)

    @serves(ChargeEvaluation, "provider")
    def on_ChargeEvaluation(self, session: Session, msg: ChargeEvaluation) -> EvaluationCharged:
        """A provider about to release a score of ``msg.dataset``'s private test split spends one of
        the dataset's evaluations here, where every replica and restart shares them, and learns the
        dataset's noise key (services/router/eval_budget.py)."""
        if msg.per_day < 0:
            raise BadRequest(f"ChargeEvaluation.per_day is {msg.per_day}: 0 (unlimited) or more evaluations a day")
        served = session.hello.caps.get("datasets", {})
        if msg.dataset not in served:
            raise Forbidden(
                f"provider {session.name} did not register {msg.dataset[:128]!r} (its Hello serves "
                f"{', '.join(sorted(served)) or 'nothing'}); only a dataset's providers spend its "
                "evaluations and learn its noise key"
            )
        left = self.eval_budget.charge(msg.dataset, msg.per_day)
        key = self.eval_budget.key(msg.dataset)
        return EvaluationCharged(dataset=msg.dataset, key=key.hex(), left=None if msg.per_day <= 0 else left)

    @serves(Stats, "admin", "trainer")
    def on_Stats(self, session: Session | None, msg: Stats) -> StatsReply:
        """The router's own metrics and those its peers carry on heartbeats, one row per session,
        keyed by its token subject (``"SUBJECT (KIND)"`` when that key is taken: the router's own
        row is ``router`` whoever names itself so); each row says its ``name`` and ``session``.
        An unrestricted admin sees every row; anyone else (a trainer, a scoped admin) the rows of
        its own subject, of providers serving a dataset in its scope (their per-dataset counters
        only for those; a scoped admin's ``datasets`` scope must name it: a ``jobs`` scope alone
        shows no provider), and (a scoped admin) of trainers holding a job inside its scopes. Rows are
        cut, with a note, to fit one reply."""
        services: dict[str, dict] = {"router": {"role": "router", **self.row()}}
        claims = None if session is None else session.claims
        everything = claims is None or (claims.role == "admin" and not claims.scopes)
        holders = set() if everything or claims is None or claims.role != "admin" else self._holders_for(claims)
        for peer in self.peers.values():
            if not peer.heartbeat:
                continue
            stats = peer.stats
            if not everything and claims is not None and peer.subject != claims.sub:
                if peer.role == "provider":
                    # a scoped admin's datasets scope names the providers it sees (a jobs scope alone: none)
                    named = claims.role != "admin" or "datasets" in claims.scopes
                    served = [d for d in peer.hello.caps["datasets"] if named and claims.allows_dataset(d)]
                    if not served:
                        continue
                    stats = {  # every per-dataset row of the peer's: counters, remote reads, pipelines
                        **stats,
                        **{
                            key: {d: v for d, v in stats[key].items() if d in served}
                            for key in ("datasets", "remote_reads", "pipelines")
                            if isinstance(stats.get(key), dict)
                        },
                    }
                elif peer.role != "trainer" or peer.subject not in holders:
                    continue
            key = peer.subject
            for candidate in (key, f"{key} ({peer.kind})", f"{key} ({peer.kind} {peer.sid[:8]})"):
                if candidate not in services:
                    key = candidate
                    break
            services[key] = {**stats, "role": peer.role, "name": peer.name, "session": peer.sid}  # (ours win)
        return StatsReply(services=fit_rows(services))

    def _holders_for(self, claims: Claims) -> set[str]:
        """Subjects of the trainers holding a job inside ``claims``' scopes (a scoped admin's Stats)."""
        return {
            job["trainer"]
            for job in self.store.held_grants_ids()
            if claims.allows_job(job["id"]) and claims.allows_dataset(dataset_name(job["spec"]["dataset"]))
        }

    # -- timers -------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Keep providers' entitlements current; leases and command acknowledgements
        (services/router/jobs.py)."""
        self.tick_grants(now)
        self.jobs.tick(now)
        if self.gangs.tick(self._trainer_names()):  # an elastic gang started: its providers hear of it
            self._push_entitlements()
        self.tick_judges(now)  # studies, early stopping

    def flush(self) -> None:
        """The end of the server's turn: what this turn's replies acknowledge reaches the disk (one
        fsync for all of its transitions; services/router/store_db.py), before they go out."""
        try:
            self.store.durability.sync()
        except Exception:
            self.store.changes += 1  # the turn's writes were undone: assignments are recomputed
            raise

    def row(self) -> RouterRow | RouterStats:
        """The router's ``Stats`` row and metrics: its server's figures, then its own (only its own
        while no server is attached: a handler driven without one)."""
        if self.server_stats is None:
            return self.stats()
        return {**self.server_stats(), **self.stats()}

    def stats(self) -> RouterStats:
        counts: dict[str, int] = {}
        for row in self.store.db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state"):
            counts[row[0]] = row[1]
        return {
            "jobs": counts,
            "peers": {r: len(self.sessions_of(r)) for r in ("provider", "trainer", "loader", "admin")},
            "refused_transitions": dict(REFUSED),
        }

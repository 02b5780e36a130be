"""The router's requests for what it decides on its own: studies (:mod:`.studies`), early stopping
(:mod:`.early_stop`) and evaluation tasks (jobs with ``task = "evaluate"``: the model they score
travels to the trainer with the task). A mixin of :class:`~.handler.RouterHandler`, kept here so
that the handler only wires it in.
"""

from __future__ import annotations

import hashlib
import logging

from libbus.errors import BadRequest, Forbidden, Internal, NotFound
from libbus.jobs.spec import JobSpec, dataset_name
from libbus.jobs.state import JobState
from libbus.security.auth import Claims
from libbus.serve.handler import serves
from libbus.serve.server import Session
from libbus.wire.messages import GetStudy, ListStudies, Ok, StopStudy, StudyInfo, StudyList, SubmitStudy, Task

from .artifacts import Artifacts
from .early_stop import EarlyStopping
from .jobs import UPLOAD, JobControl
from .store import JobStore
from .studies import Studies
from .study_spec import StudySpec

__all__ = ["Decisions", "UPLOAD"]

log = logging.getLogger(__name__)


class Decisions:
    """Studies, early stopping and evaluation tasks for the router's handler (which provides
    ``store``, ``jobs`` (JobControl) and ``artifacts``)."""

    store: JobStore
    jobs: JobControl
    artifacts: Artifacts | None

    def init_decisions(self) -> None:
        self.studies = Studies(self.store, self.jobs.control)
        self.early_stopping = EarlyStopping(self.store, self.jobs.control, self.jobs.stop_requested)

    def tick_decisions(self, now: float) -> None:
        for part in (self.studies, self.early_stopping):
            try:
                part.tick(now)
            except Exception:  # noqa: BLE001 - a bug in a strategy must not take the router down
                log.exception("%s failed; trying again at the next tick", type(part).__name__)

    def judge_report(self, job: str, progress: dict) -> None:
        """A job's progress report: its new epochs are judged at once (a study trial's pruning and
        PBT, a job's early stopping)."""
        history = progress.get("history")
        if not isinstance(history, list):
            return
        try:
            self.studies.on_report(job, len(history))
        except Exception:  # noqa: BLE001 - the report is stored; the next tick judges it again
            log.exception("study report of job %s", job)
        try:
            self.early_stopping.on_report(job, history)
        except Exception:  # noqa: BLE001 - a bug in the rule must not take the router down; the next report judges again
            log.exception("early stopping at a report of job %s", job)

    # -- studies ---------------------------------------------------------------------------------
    @serves(SubmitStudy, "admin")
    def on_SubmitStudy(self, session: Session, msg: SubmitStudy) -> StudyInfo:
        spec = StudySpec.from_dict(msg.spec)  # checked first: the scope is read from the checked [base]
        _check_study_scope(session.claims, spec.base)
        study = self.studies.submit(msg.spec, session.subject)
        return StudyInfo(study=self.studies.show(study))

    @serves(ListStudies, "admin")
    def on_ListStudies(self, session: Session, msg: ListStudies) -> StudyList:
        # a scoped token sees the studies it could ask about one by one
        return StudyList(studies=[s for s in self.studies.list() if _allows_study(session.claims, s["dataset"])])

    @serves(GetStudy, "admin")
    def on_GetStudy(self, session: Session, msg: GetStudy) -> StudyInfo:
        study = self.studies.show(msg.study)
        _check_study_scope(session.claims, study["spec"]["base"])
        return StudyInfo(study=study)

    @serves(StopStudy, "admin")
    def on_StopStudy(self, session: Session, msg: StopStudy) -> Ok:
        _check_study_scope(session.claims, self.studies.show(msg.study)["spec"]["base"])
        return Ok(detail=self.studies.stop(msg.study, session.subject))

    # -- evaluation tasks ------------------------------------------------------------------------
    def evaluation_spec(self, spec: JobSpec, frames: list, claims: Claims) -> JobSpec:
        """Check a job's ``model_from`` before it is queued: a model uploaded with it, a succeeded
        job whose model the router holds, or (a training job only) a job that has not succeeded
        but has a checkpoint: its current weights (:meth:`attach_model` takes its latest checkpoint
        when the job is handed out). An ``evaluate`` task scores a model (and takes its
        architecture); a training job starts from it (``job.initial_model()``; the built-in loop
        loads it). Either way a trainer receives that job's weights, so ``model_from`` passes the
        scope check ``GetModel`` makes (``claims``, the submitter's token: its ``jobs`` scope, and
        its ``datasets`` scope on the job's dataset): a dataset-limited admin cannot have another
        dataset's model sent out."""
        if spec.task != "evaluate" and not spec.model_from:
            if frames:
                raise BadRequest("a model comes with a submission only with model_from = 'upload'")
            return spec
        if frames or spec.model_from == UPLOAD:
            if self.artifacts is None:
                raise BadRequest("this router keeps no models (artifact_dir); it cannot take an uploaded model")
            if spec.model_from != UPLOAD:
                raise BadRequest(f"a model sent with the task needs model_from = {UPLOAD!r}")
            if not frames:
                raise BadRequest("model_from = 'upload' but no model came with the submission")
            return spec
        if spec.task == "evaluate" and self.artifacts is None:
            raise BadRequest("this router keeps no models (artifact_dir); it cannot run evaluation tasks")
        claims.check_job(spec.model_from)
        source = self.store.get(spec.model_from, events=False)
        claims.check_dataset(dataset_name(source["spec"]["dataset"]))
        if _holds_model(source) and self.artifacts is not None:
            if spec.task != "evaluate":
                return spec
            trained = source["spec"]
            return spec.updated(model=trained["model"], model_kwargs=trained["model_kwargs"])
        if spec.task == "evaluate":
            raise BadRequest(
                f"job {spec.model_from} is {source['state']}; an evaluation task scores the model of "
                "a succeeded job the router holds (busctl job model shows whether it does)"
            )
        if source["checkpoint"]:  # its current weights: its latest checkpoint when this job is handed out
            return spec
        if source["state"] == JobState.SUCCEEDED:
            raise BadRequest(
                f"job {spec.model_from} succeeded, but the router holds neither its model nor a checkpoint"
            )
        raise BadRequest(
            f"job {spec.model_from} is {source['state']} and has no checkpoint yet: a job starts from another "
            "job's final model or, before it has one, from its latest checkpoint. Wait for its first "
            f"checkpoint, or ask for one: busctl job checkpoint {spec.model_from}"
        )

    def keep_upload(self, job: str, frames: list) -> None:
        """Keep the model uploaded with evaluation task ``job`` as that job's artifact."""
        frame = frames[0]
        data = bytes(frame.buffer if hasattr(frame, "buffer") else frame)
        if self.artifacts is None:
            raise Internal("this router keeps no models (no artifacts directory)")
        try:
            self.artifacts.put(job, data, hashlib.sha256(data).hexdigest())
        except OSError as err:
            self.store.finish(job, JobState.FAILED, f"the uploaded model could not be kept: {err}", error=str(err))
            raise BadRequest(f"the router could not keep the uploaded model: {err}") from err

    def attach_model(self, task: Task) -> Task:
        """An evaluation task carries the model it scores, a training job with ``model_from`` the
        model it starts from: a succeeded job's final model (its bytes, a payload frame), or the
        latest checkpoint record of a job that has not succeeded (``Task.initial``, taken now, at
        the moment the task is handed out, so it is the freshest). Any other task is returned as
        it is."""
        spec = task.spec
        if spec.get("task") != "evaluate" and not spec.get("model_from"):
            return task
        source = task.job if spec["model_from"] == UPLOAD else spec["model_from"]
        if source != task.job and spec.get("task") != "evaluate":
            try:
                job = self.store.get(source, events=False)
            except NotFound as err:
                self.store.finish(task.job, JobState.FAILED, f"the job it starts from is gone: {err}", error=str(err))
                raise
            if not (_holds_model(job) and self.artifacts is not None):
                return self._attach_checkpoint(task, job)
        if self.artifacts is None:
            raise Internal("this router keeps no models (no artifacts directory)")
        try:
            task.frames = [self.artifacts.get(source)]
        except NotFound as err:
            self.store.finish(task.job, JobState.FAILED, f"the model it names is gone: {err}", error=str(err))
            raise
        return task

    def attach_gang_model(self, task: Task) -> Task:
        """:meth:`attach_model` for a rank of a gang: every rank of one gang starts from the same
        snapshot. The first rank handed its task takes it (the source's latest checkpoint then) and
        the gang keeps it; the other ranks get that one, whatever the source has written since. A
        gang formed again (a new attempt) takes a fresh one, as a single trainer's attempt does."""
        spec = task.spec
        if spec.get("task") == "evaluate" or not spec.get("model_from"):
            return task
        gang = self.store.get(task.job, events=False)["gang"] or {}
        if gang.get("initial"):
            task.initial = gang["initial"]
            return task
        task = self.attach_model(task)
        if task.initial:
            self.store.update_gang(task.job, initial=task.initial)
        return task

    def _attach_checkpoint(self, task: Task, source: dict) -> Task:
        """``task`` starts from ``source``'s latest checkpoint (its model weights only)."""
        record = source["checkpoint"]
        if not record:
            why = f"job {source['id']} ({source['state']}) has no checkpoint any more to start from"
            self.store.finish(task.job, JobState.FAILED, why, error=why)
            raise NotFound(why)
        task.initial = record
        if task.resume is None:  # a fresh start: the weights it begins with (a resumed attempt has its own)
            self.store.event(
                task.job,
                f"starts from the weights of job {source['id']} ({source['state']}): its checkpoint at "
                f"step {record['step']} (sha256 {str(record['sha256'])[:12]}…)",
            )
        return task


def _holds_model(job: dict) -> bool:
    """Whether ``job`` succeeded and the router holds its final model."""
    return job["state"] == JobState.SUCCEEDED and bool((job["result"] or {}).get("model", {}).get("router_path"))


def _allows_study(claims: Claims, dataset) -> bool:
    """Whether a token may see or act on a study whose trials run on ``dataset``: its ``datasets``
    scope covers it, and it has no ``jobs`` scope (a study's trials are jobs made after the token,
    which no ``jobs`` scope can name)."""
    return "jobs" not in claims.scopes and isinstance(dataset, str) and claims.allows_dataset(dataset_name(dataset))


def _check_study_scope(claims: Claims, base: dict) -> None:
    """Raise :class:`Forbidden` unless :func:`_allows_study`, naming the scope that refuses."""
    if "jobs" in claims.scopes:
        raise Forbidden(
            "a token limited to jobs cannot submit or see studies: their trials are new jobs no jobs scope names"
        )
    dataset = base.get("dataset")
    claims.check_dataset(dataset_name(dataset) if isinstance(dataset, str) else "")

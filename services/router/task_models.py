"""The model a task carries: an evaluation task's (``task = "evaluate"``: the model it scores travels
to the trainer with the task), a job's ``model_from`` (the model it starts from: a succeeded job's
final model, or another job's latest checkpoint), a model uploaded with a submission; each checked
against the submitter's scopes before it is queued. A mixin of :class:`~.handler.RouterHandler`.
(What the router decides on its own: :mod:`.judges`.)
"""

from __future__ import annotations

import hashlib

from libbus.errors import BadRequest, Internal, NotFound
from libbus.jobs.spec import JobSpec
from libbus.jobs.state import JobState
from libbus.security.auth import Claims
from libbus.wire.messages import Task

from .artifacts import Artifacts
from .job_results import UPLOAD
from .store import JobRow, JobStore, StoredCheckpoint, stored_spec

__all__ = ["TaskModels"]


class TaskModels:
    """The models tasks carry, for the router's handler (which provides ``store`` and ``artifacts``)."""

    store: JobStore
    artifacts: Artifacts | None

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
        trained = stored_spec(source["spec"])
        claims.check_dataset(trained.dataset)
        if _holds_model(source) and self.artifacts is not None:
            if spec.task != "evaluate":
                return spec
            return spec.updated(model=trained.model, model_kwargs=trained.model_kwargs)
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

    def attach_model(self, task: Task, spec: JobSpec) -> Task:
        """An evaluation task carries the model it scores, a training job with ``model_from`` the
        model it starts from: a succeeded job's final model (its bytes, a payload frame), or the
        latest checkpoint record of a job that has not succeeded (``Task.initial``, taken now, at
        the moment the task is handed out, so it is the freshest). Any other task is returned as
        it is. ``spec`` is the task's, typed."""
        self._attach(task, spec)
        return task

    def _attach(self, task: Task, spec: JobSpec) -> StoredCheckpoint | None:
        """:meth:`attach_model`'s work; returns the checkpoint record the task starts from (None when it
        carries a final model, or nothing)."""
        if spec.task != "evaluate" and not spec.model_from:
            return None
        source = task.job if spec.model_from == UPLOAD else spec.model_from
        if source != task.job and spec.task != "evaluate":
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
        return None

    def attach_gang_model(self, task: Task, spec: JobSpec) -> Task:
        """:meth:`attach_model` for a rank of a gang: every rank of one gang starts from the same
        snapshot. The first rank handed its task takes it (the source's latest checkpoint then) and
        the gang keeps it; the other ranks get that one, whatever the source has written since. A
        gang formed again (a new attempt) takes a fresh one, as a single trainer's attempt does."""
        if spec.task == "evaluate" or not spec.model_from:
            return task
        initial = self.store.gang(task.job).get("initial")  # a rank's task: its job runs on a gang
        if initial is not None:
            task.initial = dict(initial.items())  # the message's JSON object
            return task
        initial = self._attach(task, spec)
        if initial is not None:
            self.store.update_gang(task.job, initial=initial)
        return task

    def _attach_checkpoint(self, task: Task, source: JobRow) -> StoredCheckpoint:
        """``task`` starts from ``source``'s latest checkpoint (its model weights only), which is returned."""
        record = source["checkpoint"]
        if not record:
            why = f"job {source['id']} ({source['state']}) has no checkpoint any more to start from"
            self.store.finish(task.job, JobState.FAILED, why, error=why)
            raise NotFound(why)
        task.initial = dict(record.items())  # the message's JSON object
        if task.resume is None:  # a fresh start: the weights it begins with (a resumed attempt has its own)
            self.store.event(
                task.job,
                f"starts from the weights of job {source['id']} ({source['state']}): its checkpoint at "
                f"step {record['step']} (sha256 {record['sha256'][:12]}…)",
            )
        return record


def _holds_model(job: JobRow) -> bool:
    """Whether ``job`` succeeded and the router holds its final model."""
    return job["state"] == JobState.SUCCEEDED and bool((job["result"] or {}).get("model", {}).get("router_path"))

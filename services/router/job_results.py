"""What a job leaves the router: its result's test scores and its final model.

A trainer's ``PushResult`` says how its attempt ended; :class:`~services.router.jobs.JobControl` decides
where the job goes from there. What is kept of the result is decided here: its test scores are the
providers' reports only (:mod:`services.router.scores`), of the weights the router keeps for the job,
and the final model a succeeded job sends with its result is kept in ``artifact_dir``
(:mod:`services.router.artifacts`) with its weights digest, for ``busctl job model`` after its trainer
has gone. ``busctl job model --current`` gets a running job's weights from its trainer instead
(:func:`current_model`).
"""

from __future__ import annotations

import hashlib
import logging

from libbus.errors import BadRequest, NotFound
from libbus.jobs.state import JobState
from libbus.jobs.weights import weights_digest
from libbus.wire.messages import CommandAck, Message, Model, Ok, PushResult, frame_buffer

from .artifacts import Artifacts
from .scores import TestScores
from .store import JobRow, stored_spec

__all__ = ["UPLOAD", "JobResults", "current_model"]

log = logging.getLogger(__name__)

#: ``model_from`` of an evaluation task whose model came with it (kept as the task's own artifact).
UPLOAD = "upload"


class JobResults:
    """The results and final models the router keeps.

    Args:
        artifacts: where final models sent with a result are kept (None: not kept).
    """

    def __init__(self, artifacts: Artifacts | None):
        self.artifacts = artifacts
        #: Providers' reports of their evaluations: the only source of a job's test score.
        self.scores = TestScores()

    def scored(self, trainer: str, msg: PushResult, job: JobRow) -> dict:
        """``msg.result`` with its test scores: providers' reports only, of the weights the router keeps
        for ``job`` (:class:`~services.router.scores.TestScores`)."""
        return self.scores.result(msg.job, trainer, msg.result, self._kept_weights(job, msg.result))

    def _kept_weights(self, job: JobRow, result: dict) -> str:
        """The sha256 of the weights a test score in ``result`` must be of: the final model the trainer
        sends with it (the router checks its bytes against this sha256 as it keeps them), or, for an
        evaluation task, the model the router handed it; "" when there is none."""
        spec = stored_spec(job["spec"])
        if spec.task == "evaluate":
            source = job["id"] if spec.model_from == UPLOAD else spec.model_from
            if self.artifacts is None:
                return ""
            try:
                return hashlib.sha256(self.artifacts.get(source)).hexdigest()
            except (NotFound, OSError):
                return ""
        model = result.get("model")
        return model["sha256"] if isinstance(model, dict) and isinstance(model.get("sha256"), str) else ""

    def keep_model(self, msg: PushResult, result: dict) -> dict:
        """Keep the final model a succeeded job sent with its result: ``result`` with the model's
        ``router_path`` and weights digest added (``result`` as it is when no model came, or none is kept).

        Raises:
            BadRequest: weights sent without ``result.model.sha256``.
        """
        if not (msg.frames and msg.state == JobState.SUCCEEDED and self.artifacts is not None):
            return result
        model = result.get("model")
        if not isinstance(model, dict) or not isinstance(model.get("sha256"), str):
            raise BadRequest("weights sent without result.model.sha256")
        frame = msg.frames[0]
        stored = self.artifacts.put(msg.job, frame_buffer(frame), model["sha256"])
        # the tensors' own digest: equal for equal weights, whatever job id the file's metadata names
        try:
            digest = {"weights_digest": weights_digest(frame_buffer(frame))}
        except ValueError as err:
            log.warning("job %s: no weights digest of its model: %s", msg.job, err)
            digest = {}
        return {**result, "model": {**model, "router_path": stored, **digest}}

    def model(self, job: JobRow) -> Model:
        """The final weights of a succeeded job, as the router keeps them."""
        job_id = job["id"]
        if job["state"] != JobState.SUCCEEDED:
            raise BadRequest(
                f"job {job_id} is {job['state']}; only a succeeded job has a final model "
                f"(busctl job checkpoint writes one for a running job on its trainer)"
            )
        model = (job["result"] or {}).get("model") or {}
        if self.artifacts is None or "router_path" not in model:
            raise NotFound(
                f"the router holds no model for job {job_id}; its trainer wrote it to {model.get('path', '?')}"
            )
        data = self.artifacts.get(job_id)
        return Model(job=job_id, sha256=model["sha256"], nbytes=len(data), frames=[data])


def current_model(msg: CommandAck, detail: dict) -> Message:
    """The reply to ``busctl job model --current``: the copied weights, or Ok with the trainer's error."""
    if not msg.frames or not isinstance(detail.get("sha256"), str):
        return Ok(detail={"error": "the trainer sent no weights", **detail})
    frame = msg.frames[0]
    data = bytes(frame.buffer if hasattr(frame, "buffer") else frame)
    return Model(
        job=msg.job,
        sha256=detail["sha256"],
        nbytes=len(data),
        frames=[data],
        step=int(detail.get("step", 0)),
        epoch=int(detail.get("epoch", 0)),
    )

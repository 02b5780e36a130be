"""An evaluation task (``task = "evaluate"``, services/router/task_models.py): :func:`run_evaluation`
scores the model that came with it: on ``val`` here, streamed like a training job's validation; on
``test`` by sending the weights to the provider, whose private test split never leaves it. Its result
is stored like a job's. (A running job's own ``busctl job eval``, ``job model --current`` and PBT's
``adopt`` are applied by its attempt, :mod:`.jobapi`.)
"""

from __future__ import annotations

import hashlib
import logging

from safetensors.torch import load as load_safetensors

from libbus.config import Settings
from libbus.connect.client import Identity, pick_provider
from libbus.connect.link import Link
from libbus.errors import BadRequest, BusError
from libbus.jobs.spec import JobSpec
from libbus.jobs.state import JobState
from libbus.loader.remote import RemoteLoader
from libbus.wire.messages import Resolve, Task
from services.models import build_model, dataset_kind, evaluate

from .final_eval import score_saved

__all__ = ["run_evaluation"]

log = logging.getLogger(__name__)


def run_evaluation(
    task: Task, spec: JobSpec, settings: Settings, link: Link, identity: Identity
) -> tuple[JobState, dict, str]:
    """Score the model that came with ``task`` on ``spec.split``; ``(state, result, error)``."""
    try:
        if not task.frames:
            raise BadRequest("the evaluation task came without its model")
        frame = task.frames[0]
        blob = bytes(frame.buffer if hasattr(frame, "buffer") else frame)
        resolved = link.request(Resolve(dataset=spec.dataset), timeout_s=settings.request_timeout_s)
        provider = pick_provider(resolved.providers, identity.host_id)
        result = {
            "split": spec.split,
            "model_from": spec.model_from,
            "model_sha256": hashlib.sha256(blob).hexdigest(),
            "provider": provider["name"],
        }
        if spec.split == "test":  # as a job's final evaluation: rate limits and provider restarts are waited out
            ev = score_saved(
                blob, task.job, spec, provider, link=link, identity=identity, settings=settings, check=lambda: None
            )
            result.update(test_loss=ev.loss, test_accuracy=ev.accuracy, test_n=ev.n)
        else:
            model = build_model(spec.model, resolved.info, spec.model_kwargs, allowed=settings.job_modules)
            try:
                model.load_state_dict(load_safetensors(blob))
            except (RuntimeError, ValueError) as err:
                raise BadRequest(f"the model does not fit {spec.model} on {spec.dataset}: {err}") from err
            val = RemoteLoader(
                spec.dataset,
                split="val",
                shuffle=False,
                rank=0,
                world_size=1,
                provider=resolved.providers,
                token=identity.token,
                batch_size=spec.batch_size,
                timeout_s=settings.request_timeout_s,
                retries=settings.request_retries,
                name=identity.name,
                host_id=identity.host_id,
                curve=identity.curve,
                provider_wait_s=settings.provider_wait_s,
                shm=False,
            )
            try:
                loss, accuracy, n = evaluate(model, val, dataset_kind(resolved.info))
            finally:
                val.close()
            result.update(val_loss=loss, val_accuracy=accuracy, val_n=n)
    except BusError as err:
        log.error("evaluation task %s failed: %s", task.job, err)
        return JobState.FAILED, {"retryable": False}, f"{type(err).__name__}: {err}"
    log.info("evaluation task %s: %s", task.job, result)
    return JobState.SUCCEEDED, result, ""

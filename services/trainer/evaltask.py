"""What a trainer does for the router's decisions beyond training (services/router/decisions.py):

- :func:`run_evaluation`: an evaluation task (``task = "evaluate"``) scores the model that came with
  it: on ``val`` here, streamed like a training job's validation; on ``test`` by sending the weights
  to the provider, whose private test split never leaves it. Its result is stored like a job's.
- :func:`adopt_checkpoint`: population-based training's exploit step: load another job's
  checkpoint (weights and optimizer state) into a running task.
- :func:`current_weights`: ``busctl job model --current``: the weights now, between two steps.
- :func:`evaluate_now`: ``busctl job eval``: the weights now, scored in the background.
"""

from __future__ import annotations

import hashlib
import logging

from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from libbus.config import Settings
from libbus.connect.client import Identity
from libbus.connect.link import Link
from libbus.errors import BadRequest, BusError
from libbus.jobs.spec import JobSpec
from libbus.jobs.state import JobState
from libbus.loader.remote import RemoteLoader, pick_provider
from libbus.wire.messages import Resolve, Task
from services.models import build_model, dataset_kind, evaluate

from .checkpoint import CheckpointError, model_metadata, read_checkpoint, restore_checkpoint
from .evaluation import snapshot
from .final_eval import model_spec, score_saved
from .optim import apply_hyper

__all__ = ["run_evaluation", "adopt_checkpoint", "current_weights", "evaluate_now"]

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


def adopt_checkpoint(run, args: dict) -> dict:
    """Load the checkpoint ``args["checkpoint"]`` (another job's) into ``run`` (a TaskRun): its model
    and optimizer state, then this job's hyper-parameters again. The data position stays this
    job's. Raises :class:`BadRequest` when it cannot be read here or does not fit."""
    if run.gang is not None:
        raise BadRequest("adopt is not supported for a gang (world_size > 1)")
    record = args.get("checkpoint") or {}
    try:
        data = read_checkpoint(record, run.settings.checkpoint_dir)
        restored = restore_checkpoint(data, record, run.model, run.optimizer)
    except CheckpointError as err:
        raise BadRequest(f"cannot adopt {record.get('path')}: {err}") from err
    apply_hyper(run.optimizer, run.spec)
    log.info("job %s: adopted the checkpoint of %s at step %d", run.job, args.get("from"), restored.step)
    return {"from": args.get("from"), "step": restored.step, "sha256": record.get("sha256")}


def current_weights(run) -> tuple[dict, bytes]:
    """The task's weights now (a copy taken between two steps) as safetensors bytes, with their
    sha256, step and epoch."""
    state, copy_ms = snapshot(run.model)
    data = save_safetensors(
        {k: v.contiguous() for k, v in state.items()}, metadata=model_metadata(run.job, run.spec, run.step)
    )
    detail = {
        "sha256": hashlib.sha256(data).hexdigest(),
        "step": run.step,
        "epoch": run.train.epoch + 1,
        "copy_ms": round(copy_ms, 3),
        "bytes": len(data),
    }
    return detail, data


def evaluate_now(run, done) -> None:
    """``busctl job eval``: copy the weights of ``run`` (a TaskRun) here, between batches; score them
    in the background (:class:`.evaluation.LiveEvaluations`), calling ``done`` with the result."""
    run.evaluations.start(
        run.model,
        model_spec(run.spec),
        run.spec.dataset,
        run.provider,
        step=run.step,
        epoch=run.train.epoch + 1,
        done=done,
    )

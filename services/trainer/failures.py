"""What a trainer says when a job fails: the exception's type and message, with a hint where one
helps the user fix the job (every exception a job raises ends that job, never the trainer)."""

from __future__ import annotations

import os
import sys
import traceback

from libbus.errors import BusError
from libbus.jobs.spec import JobSpec
from libbus.jobs.state import JobState

__all__ = ["describe_failure", "deterministic", "failed_attempt", "own_code_failure"]

#: The errors of a peer that did not answer or is gone: the attempt is retried (elsewhere).
RETRYABLE_CODES = ("TIMEOUT", "UNAVAILABLE", "NOT_FOUND")


def deterministic(err: BaseException) -> bool:
    """A RuntimeError the job's own spec causes (not a broken collective)."""
    text = str(err).lower()
    return any(
        k in text
        for k in ("out of memory", "negative dimension", "invalid device ordinal", "shapes cannot be multiplied")
    )


def describe_failure(err: BaseException, spec: JobSpec | None) -> str:
    """``Type: message`` of a job's failure, with a hint where one helps the user fix the job."""
    text = str(err).strip() or repr(err)
    hint = ""
    lowered = text.lower()
    if "out of memory" in lowered:
        hint = "CUDA out of memory: lower batch_size" + (f" (now {spec.batch_size})" if spec else "")
    elif spec is not None and (
        "negative dimension" in lowered or "must be positive" in lowered or "non-positive" in lowered
    ):
        bad = [
            k
            for k, v in spec.model_kwargs.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0
        ]
        hint = "; ".join(f"model_kwargs.{k} must be positive (got {spec.model_kwargs[k]})" for k in bad)
    elif "invalid device" in lowered or "device ordinal" in lowered:
        hint = f"device {spec.device!r} does not exist on this trainer" if spec else ""
    elif spec is not None and ":" in spec.model and isinstance(err, Exception) and not isinstance(err, BusError):
        hint = f"the model factory {spec.model} raised"
    out = f"{type(err).__name__}: {text[:2000]}"
    return f"{out} (hint: {hint})" if hint else out


def failed_attempt(err: BaseException, spec: JobSpec | None) -> tuple[JobState, dict, str]:
    """How an attempt that raised ``err`` ends: failed, with the error and a hint; retryable only
    when a peer did not answer or is gone (a provider, the router, a rank of the gang that never
    came or left), since a model, a spec or a device that fails here fails on the next trainer too."""
    retryable = isinstance(err, BusError) and err.code in RETRYABLE_CODES
    return JobState.FAILED, {"retryable": retryable}, describe_failure(err, spec)


def own_code_failure(err: BaseException, entrypoint: str, job: str, step: int, checkpoint_step: int | None) -> str:
    """What the user needs when an entrypoint job's own code raised: where (the step, and the
    innermost frame of the traceback in the entrypoint's own package or module, with its source
    line), where the whole traceback is, and what to do next. ``""`` when no frame of the traceback
    is the job's own (the error came from batchbus or a library it called: :func:`describe_failure`
    says it all)."""
    frame = _own_frame(err, entrypoint)
    if frame is None:
        return ""
    source = f": {frame.line.strip()}" if frame.line else ""
    start = f"its last checkpoint, step {checkpoint_step}" if checkpoint_step else "the start: no checkpoint yet"
    return (
        f"raised by the job's own code at step {step}, {_shown_path(frame.filename)}:{frame.lineno} in "
        f"{frame.name}{source}; the whole traceback: busctl job logs {job}; fix the code where the trainers "
        f"import it, then busctl job resume {job} (it goes on from {start}) or submit it again"
    )


def _own_frame(err: BaseException, entrypoint: str) -> traceback.FrameSummary | None:
    """The innermost frame of ``err``'s traceback in the entrypoint's own files: its top package's
    folder (``mylab`` of ``mylab.train:main``), or its module's file when it is a single module."""
    top = entrypoint.partition(":")[0].partition(".")[0]
    module = sys.modules.get(top)
    path = getattr(module, "__file__", None)
    if not path:
        return None
    own = os.path.dirname(os.path.abspath(path)) if path.endswith("__init__.py") else os.path.abspath(path)
    mine = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if os.path.abspath(f.filename) == own or os.path.abspath(f.filename).startswith(own + os.sep)
    ]
    return mine[-1] if mine else None


def _shown_path(filename: str) -> str:
    """A frame's file as the user knows it: relative to the current folder when under it."""
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith("..") else rel

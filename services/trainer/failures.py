"""What a trainer says when a job fails: the exception's type and message, with a hint where one
helps the user fix the job (every exception a job raises ends that job, never the trainer)."""

from __future__ import annotations

from libbus.errors import BusError
from libbus.jobs.spec import JobSpec
from libbus.jobs.state import JobState

__all__ = ["describe_failure", "deterministic", "failed_attempt"]

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

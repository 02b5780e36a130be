"""A failed job's reason: the exception's type and message, with a hint the user can act on."""

from __future__ import annotations

import torch

from libbus.errors import BadRequest, NotFound, PeerTimeout
from libbus.jobs.spec import JobSpec
from services.trainer.attempt.gang import GangError
from services.trainer.failures import describe_failure, deterministic, failed_attempt


def test_hints_name_the_field_to_change():
    spec = JobSpec.from_dict({"dataset": "mnist", "model": "mlp", "model_kwargs": {"hidden": -1}, "batch_size": 512})
    try:
        torch.nn.Linear(4, -1)
    except RuntimeError as err:
        text = describe_failure(err, spec)
    assert text.startswith("RuntimeError: ") and "(hint: model_kwargs.hidden must be positive (got -1))" in text
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")  # no GPU here to fill
    assert describe_failure(oom, spec).endswith("(hint: CUDA out of memory: lower batch_size (now 512))")
    assert deterministic(oom)
    device = JobSpec.from_dict({"dataset": "mnist", "device": "cuda:7"})
    assert "device 'cuda:7' does not exist" in describe_failure(
        RuntimeError("CUDA error: invalid device ordinal"), device
    )
    factory = JobSpec.from_dict({"dataset": "mnist", "model": "my.models:build"})
    assert (
        describe_failure(ValueError("no"), factory) == "ValueError: no (hint: the model factory my.models:build raised)"
    )
    assert (
        describe_failure(PeerTimeout("provider p1 did not answer"), spec) == "PeerTimeout: provider p1 did not answer"
    )
    assert not deterministic(RuntimeError("Connection closed by peer [127.0.0.1]:29500"))


def test_only_a_peer_that_is_gone_makes_an_attempt_retryable():
    """A gang whose ranks never met (its rendezvous timed out: the other trainer died), a provider that
    did not answer, a dataset no provider serves now: retried. A spec, a model or the function's own
    error: failed for good (it fails the same on the next trainer)."""
    gone = [
        GangError("rank 0 of 2 of job j1 could not meet its gang: timeout"),
        PeerTimeout("no answer"),
        NotFound("x"),
    ]
    assert all(failed_attempt(err, None)[1]["retryable"] for err in gone)
    for err in (BadRequest("lr must be positive"), ValueError("boom"), RuntimeError("shapes cannot be multiplied")):
        state, result, error = failed_attempt(err, None)
        assert state == "failed" and not result["retryable"] and error.startswith(type(err).__name__)

"""A job's test score is recorded only for the model the router keeps.

The job's code runs in its attempt, beside the final scoring: it could write other weights over the
saved file before the scoring reads it, or have other bytes scored than it hands back. The attempt
reads the final model once, checks it is what ``job.save_model`` wrote, scores those bytes and hands
the same bytes to its trainer; the router records a provider's score only where the weights scored
(their sha256, as the provider reports it) are the model it keeps. Against a real router, provider
and trainer; the hostile jobs are tests/support/entrypoints.py's.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from cli.tables import result_lines
from libbus.wire.messages import EvaluationReport, GetJob, GetTask, PushResult, SubmitJob, Task
from services.router import scores as router_scores
from tests.support import wait_job

EVALUATOR = "tests.support.evaluators:linear"


def _run(admin, entrypoint: str) -> dict:
    spec = {"dataset": "mnist", "entrypoint": entrypoint, "evaluator": EVALUATOR, "max_attempts": 1}
    return wait_job(admin, admin.request(SubmitJob(spec=spec)).job, timeout=120)


@pytest.mark.timeout(300)
def test_a_job_gets_no_score_for_weights_other_than_those_the_router_keeps(
    router, start_provider, entry_trainer, client_for
):
    start_provider("mnist=mock://mnist?n=300", evaluator_modules=["tests.support.evaluators"])
    admin = client_for(router.endpoint, role="admin", timeout_s=10)

    # other weights written over the saved file before the scoring: the attempt fails, nothing is scored
    swapped = _run(admin, "tests.support.entrypoints:swaps_model_after_save")
    assert swapped["state"] == "failed", swapped
    assert "changed after job.save_model wrote it" in swapped["error"], swapped["error"]
    assert not any(k.startswith("test_") for k in swapped["result"] or {}), swapped["result"]

    # other bytes scored than handed back: the job succeeds, its model is kept, no score is recorded
    other = _run(admin, "tests.support.entrypoints:scores_other_weights")
    assert other["state"] == "succeeded", other["error"]
    result, model = other["result"], other["result"]["model"]
    kept = Path(model["router_path"]).read_bytes()
    assert hashlib.sha256(kept).hexdigest() == model["sha256"]
    assert "test_accuracy" not in result and "test_sha256" not in result, result
    assert "are not the model kept for the job" in result["test_unrecorded"], result

    # a job that has its own model scored gets the score, of the bytes the router keeps
    honest = _run(admin, "tests.support.entrypoints:linear_classifier")
    assert honest["state"] == "succeeded", honest["error"]
    result = honest["result"]
    kept = Path(result["model"]["router_path"]).read_bytes()
    assert result["test_sha256"] == hashlib.sha256(kept).hexdigest() == result["model"]["sha256"], result
    assert 0.0 <= result["test_accuracy"] <= 1.0 and "test_unrecorded" not in result, result


def test_a_report_of_other_weights_is_not_recorded_for_a_trainers_result(router, client_for, make_token):
    """A trainer token that holds a job pushes a model with a score a provider reported for other bytes."""
    admin = client_for(router.endpoint, role="admin", timeout_s=10)
    mallory = client_for(router.endpoint, token=make_token("trainer", sub="mallory"), timeout_s=10)
    job = admin.request(SubmitJob(spec={"dataset": "mnist", "model": "mlp", "epochs": 1})).job
    assert isinstance(task := mallory.request(GetTask(key="k1")), Task) and task.job == job
    scores = router_scores.TestScores()
    report = EvaluationReport(
        job=job, dataset="mnist", subject="mallory", split="test", loss=0.1, accuracy=0.99, n=100, sha256="a" * 64
    )
    row = admin.request(GetJob(job=job)).job
    assert scores.on_report("prov", report, row).detail["recorded"]
    claim = {"test_accuracy": 0.99, "test_loss": 0.1, "model": {"sha256": "b" * 64}}
    kept = scores.result(job, "mallory", claim, "b" * 64)
    assert "test_accuracy" not in kept and "not the model kept" in kept["test_unrecorded"], kept
    assert scores.on_report("prov", report, row).detail["recorded"]
    assert scores.result(job, "mallory", claim, "a" * 64)["test_accuracy"] == 0.99
    # no model in the result: a score is of no kept weights
    assert scores.on_report("prov", report, row).detail["recorded"]
    assert "test_accuracy" not in scores.result(job, "mallory", {"test_accuracy": 0.99}, "")
    assert "test score not recorded: the weights scored" in "\n".join(result_lines(kept))  # busctl job show
    # a trainer cannot set the router's note itself
    mallory.request(PushResult(job=job, state="succeeded", result={"test_unrecorded": "", "val_accuracy": 0.5}))
    assert "test_unrecorded" not in admin.request(GetJob(job=job)).job["result"]

"""The job API refuses a wrong call (services/trainer/attempt/jobapi.py) with a ``BadRequest`` that says what is
wrong, before it counts a step, a report or a checkpoint; the function may catch it and go on.
Run as a real entrypoint job (tests/support/entrypoints.py:misuse) on a real trainer."""

from __future__ import annotations

from libbus.wire.messages import GetJobLogs, SubmitJob
from tests.support import wait_job


def test_each_wrong_call_is_refused_saying_what_is_wrong_and_counts_nothing(
    router, start_provider, entry_trainer, client_for
):
    start_provider("mnist=mock://mnist?n=96")
    admin = client_for(router.endpoint, role="admin")
    spec = {"dataset": "mnist", "entrypoint": "tests.support.entrypoints:misuse", "batch_size": 16, "max_attempts": 1}
    info = wait_job(admin, admin.request(SubmitJob(spec=spec)).job, timeout=120)
    assert info["state"] == "succeeded", info.get("error")
    assert info["result"]["step"] == 1 and info["result"]["samples"] == 3  # only the one good step counted
    lines = admin.request(GetJobLogs(job=info["id"])).lines
    refused = [line for line in lines if line.startswith("refused: ")]
    assert len(refused) == 9, lines

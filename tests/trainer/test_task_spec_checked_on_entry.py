"""A trainer parses a task's spec once, as the task enters it: a malformed one (what a broken or hostile
router could send; the router itself fails a job whose stored spec it cannot read) fails its job in one
line, and no attempt's process starts. A real router and the trainer's own link, on loopback."""

from __future__ import annotations

import logging
import threading

from libbus.wire.messages import GetJob, GetTask, SubmitJob, Task
from services.trainer.service.app import TrainerService


def test_a_malformed_task_fails_its_job_in_one_line_and_starts_no_attempt(router, make_settings, client_for, caplog):
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={"dataset": "mnist", "model": "mlp"})).job
    trainer = TrainerService(make_settings(router=router.endpoint, name="trainer-entry"))
    trainer.link.start()
    try:
        assert trainer.link.wait_connected(30), "trainer did not register with the router"
        task = trainer.link.request(GetTask(key="k"), timeout_s=10)
        assert isinstance(task, Task) and task.job == job
        task.spec = {**task.spec, "batch_size": "many"}  # changed on its way in
        with caplog.at_level(logging.INFO, logger="services.trainer"):
            assert trainer._run_task(task, threading.Event())  # the trainer can take its next task
    finally:
        trainer.link.close()
    info = admin.request(GetJob(job=job)).job
    assert info["state"] == "failed", info
    assert info["error"] == "BadRequest: job field 'batch_size' must be int, got 'many'"
    assert trainer.tasks == {"failed": 1}
    assert f"job {job} failed before it started" in caplog.text, caplog.text
    assert f"job {job}: attempt" not in caplog.text and "Traceback" not in caplog.text  # no attempt ran

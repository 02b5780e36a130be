"""The trainer service's own process and its attempts' (services/trainer/service/app.py, attempt.py, child.py):
the trainer only relays, so it starts without torch; an attempt, forked from the fork server, runs
with the trainer's ``torch_threads``."""

from __future__ import annotations

import subprocess
import sys

from libbus.wire.messages import GetJobLogs, SubmitJob
from tests.support import wait_job
from tests.support.busctl import REPO


def test_a_trainer_starts_without_torch():
    """Torch is imported where jobs run (the fork server, each attempt), never in the trainer that
    relays for them: its start-up is a fraction of a second and it holds no torch in memory (seen:
    1.0 s of import and its few hundred MB, before the trainer's one torch call moved to the attempt)."""
    probe = "import sys, cli.app, services.trainer.service.app, services.process, services.credentials; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "the trainer's start-up imports torch"


def test_an_attempt_runs_with_the_trainers_torch_threads(router, start_provider, make_settings, client_for):
    """``torch_threads`` (BATCHBUS_TORCH_THREADS) is the trainer's setting for its jobs' torch: it was
    applied in the trainer's own process, which trains nothing, so attempts ran with torch's default."""
    import threading

    from services.trainer.service.app import TrainerService

    start_provider("mnist=mock://mnist?n=96")
    service = TrainerService(
        make_settings(
            router=router.endpoint, name="trainer-t", job_modules=["tests.support.entrypoints"], torch_threads=1
        )
    )
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    try:
        admin = client_for(router.endpoint, role="admin")
        spec = {"dataset": "mnist", "entrypoint": "tests.support.entrypoints:threads", "max_attempts": 1}
        info = wait_job(admin, admin.request(SubmitJob(spec=spec)).job, timeout=120)
        assert info["state"] == "succeeded", info.get("error")
        lines = admin.request(GetJobLogs(job=info["id"])).lines
        assert "torch threads 1" in lines, lines
    finally:
        stop.set()
        thread.join(30)

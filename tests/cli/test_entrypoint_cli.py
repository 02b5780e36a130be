"""busctl on an entrypoint job (cli/tables.py, cli/watch.py): its history holds the metrics its
function reports, by its own names, not the built-in loop's three; its spec's built-in fields mean
nothing to it. Found porting docs/jobs.md's example as a new user: `busctl job show` of a job that
reports only val_accuracy ended in "unexpected KeyError: 'val_loss' (a bug: please report it)"."""

from __future__ import annotations

import os

from libbus.wire.messages import GetJob, SubmitJob
from tests.support import wait_job
from tests.support.busctl import REPO, busctl


def test_show_and_watch_an_entrypoint_job_that_reports_its_own_metrics(
    router, start_provider, entry_trainer, client_for, state_dir
):
    start_provider("mnist=mock://mnist?n=96")
    admin = client_for(router.endpoint, role="admin")
    spec = {"dataset": "mnist", "entrypoint": "tests.support.entrypoints:parabola", "params": {"x": 0.5, "epochs": 2}}
    info = wait_job(admin, admin.request(SubmitJob(spec=spec)).job, timeout=120)
    assert info["state"] == "succeeded", info.get("error")
    env = {
        **os.environ,
        "BATCHBUS_STATE_DIR": str(state_dir),
        "BATCHBUS_ROUTER": router.endpoint,
        "PYTHONPATH": str(REPO),
    }
    shown = busctl("job", "show", info["id"], env={**env, "COLUMNS": "200"}, check=False)
    assert shown.returncode == 0 and "a bug" not in shown.stderr, shown.stderr
    assert "epoch 1: train loss 0.5000 val loss 1.0400" in shown.stdout and "val loss 0.5400" in shown.stdout, (
        shown.stdout
    )
    assert "entrypoint=tests.support.entrypoints:parabola" in shown.stdout
    assert "model=" not in shown.stdout and "lr=" not in shown.stdout, shown.stdout  # the built-in loop's fields
    watched = busctl("job", "watch", info["id"], env={**env, "COLUMNS": "200"}, check=False)
    assert watched.returncode == 0 and "a bug" not in watched.stderr, watched.stderr
    assert "epoch 2: train loss 0.5000  val loss 0.5400" in watched.stdout, watched.stdout


def test_submit_epochs_of_an_entrypoint_job_is_its_params_epochs(router, client_for, state_dir):
    # the README's one-machine line: `--epochs 1` reaches the function as job.params["epochs"]
    env = {
        **os.environ,
        "BATCHBUS_STATE_DIR": str(state_dir),
        "BATCHBUS_ROUTER": router.endpoint,
        "PYTHONPATH": str(REPO),
    }
    entry = ["--dataset", "mnist", "--entrypoint", "tests.support.entrypoints:parabola"]
    job = busctl("submit", *entry, "--epochs", "1", env=env).stdout.strip()
    spec = client_for(router.endpoint, role="admin").request(GetJob(job=job)).job["spec"]
    assert spec["params"] == {"epochs": 1}, spec
    clash = busctl("submit", *entry, "--epochs", "1", "--param", "epochs=3", env=env, check=False)
    assert clash.returncode == 2 and "disagree" in clash.stderr and "Traceback" not in clash.stderr, clash.stderr

"""Trainers killed at every boundary of a job, and jobs that cannot run, with real processes.

A router, a provider and `busctl start trainer` subprocesses on one SQLite file (the durable tests'
cluster). Trainers are killed with SIGKILL at exact points (tests/killpoint.py): mid-epoch, right
after an epoch's last step (checkpoint_every divides the epoch), at the start of validation, during
the provider-side test evaluation, and just before and just after PushResult; one job three times
in a row. Every job must end ``succeeded`` with the weights and history of an uninterrupted run,
each epoch's samples trained exactly once (the audit). A job whose model cannot be built fails
with the reason and a hint, costs one attempt, and leaves its trainer working.
"""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
import torch

from libbus.errors import BadRequest, Unavailable
from services.trainer.attempt.audit import effective_epochs
from tests.support.busctl import REPO
from tests.support.jobs import SPEC, JobCluster, alone_fixture, final_weights, plain_fixture, plain_trainer  # noqa: F401 - the alone and plain fixtures

# 600 samples / 16 = 38 steps an epoch: a checkpoint at steps 19 (mid-epoch) and 38 (its last step)
JOB = {**SPEC, "epochs": 2, "checkpoint_every": 19, "evaluate": True, "max_attempts": 5}


class KillCluster(JobCluster):
    def __init__(self, state):
        super().__init__(state)
        # a loaded machine must not lapse a live trainer's lease: only the kills end attempts here
        # (a trainer restarted under its name abandons its job at once). The heartbeats stay the job
        # cluster's (10 silent ones of 250 ms): the router admits a trainer restarted under its name only
        # once the killed one's session has expired, and every kill here waits for that.
        self.env.update(
            BATCHBUS_LEASE_S="20",
            # a job's model may be tests.killpoint:raising_model: importable, and allowed by the trainers' operator
            PYTHONPATH=str(REPO),
            BATCHBUS_JOB_MODULES="tests.killpoint",
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = KillCluster(tmp_path_factory.mktemp("survive"))
    try:
        cluster.start_router()
        cluster.start_provider()
        cluster.provider_endpoint = cluster.endpoint_of("provider")
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def reference(cluster) -> dict:
    """The uninterrupted run every interrupted one must equal."""
    plain_trainer(cluster)
    info = cluster.wait_end(cluster.submit(**JOB), timeout=120)
    assert info["state"] == "succeeded", info["error"]
    assert len(info["result"]["history"]) == 2
    return info


@pytest.fixture
def stop_after(cluster):
    """Names of trainers this test starts: stopped (SIGTERM) when it ends, pass or fail, so none
    takes the next test's job."""
    names: list[str] = []
    yield names
    for name in names:
        proc = cluster.procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for name in names:
        proc = cluster.procs.get(name)
        if proc is None:  # (the test ended before it started this one)
            continue
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def assert_same_run(info: dict, ref: dict) -> None:
    assert info["state"] == "succeeded", info["error"]
    ours, theirs = final_weights(info), final_weights(ref)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6)
    assert len(info["result"]["history"]) == len(ref["result"]["history"])
    for ours_epoch, ref_epoch in zip(info["result"]["history"], ref["result"]["history"]):
        assert ours_epoch == pytest.approx(ref_epoch, rel=1e-5)
    for key in ("val_loss", "val_accuracy", "test_loss", "test_accuracy", "test_n", "step"):
        assert info["result"][key] == pytest.approx(ref["result"][key], rel=1e-5), key


def assert_exactly_once(cluster: JobCluster, job: str, train_digests, epochs: int = 2) -> None:
    seen = effective_epochs(cluster.audit, job)
    assert sorted(seen) == list(range(epochs))
    for epoch, got in seen.items():
        assert got == train_digests, (
            f"epoch {epoch}: {sum((got - train_digests).values())} extra, "
            f"{sum((train_digests - got).values())} missing samples"
        )


def wait_killed(proc: subprocess.Popen, timeout: float = 120) -> None:
    proc.wait(timeout)
    assert proc.returncode == -signal.SIGKILL, f"expected a SIGKILL, exited {proc.returncode}"


def test_a_bad_job_fails_with_a_hint_and_the_trainer_takes_the_next(cluster, plain):
    bad = cluster.submit(**{**JOB, "model_kwargs": {"hidden": -1}, "max_attempts": 5})
    raising = cluster.submit(**{**JOB, "model": "tests.killpoint:raising_model"})
    exiting = cluster.submit(**{**JOB, "model": "tests.killpoint:exiting_model", "max_attempts": 5})
    good = cluster.submit(**{**JOB, "epochs": 1, "evaluate": False})
    info = cluster.wait_end(bad, timeout=60)
    assert info["state"] == "failed" and info["attempts"] == 1, info
    # a job may not choose what a trainer imports: pydoc.pipepager(info, cmd) would run a shell command.
    # The trainer (connected: it ran a job) told the router it allows tests.killpoint only: refused at submit
    # (one queued before any trainer connected is refused by the trainer: test_entrypoints)
    marker = cluster.state / "pwned"
    with pytest.raises(BadRequest, match=r"model 'pydoc:pipepager': no connected trainer can import module 'pydoc'"):
        cluster.submit(**{**JOB, "model": "pydoc:pipepager", "model_kwargs": {"cmd": f"touch {marker}"}})
    assert "RuntimeError" in info["error"] and "model_kwargs.hidden must be positive" in info["error"], info["error"]
    info = cluster.wait_end(raising, timeout=60)
    assert info["state"] == "failed" and info["attempts"] == 1
    assert "ValueError: this factory always fails" in info["error"] and "factory" in info["error"]
    info = cluster.wait_end(exiting, timeout=60)  # sys.exit in a job's code ends that job, not the trainer
    assert info["state"] == "failed" and info["attempts"] == 1 and "SystemExit: 3" in info["error"], info
    assert cluster.wait_end(good, timeout=120)["state"] == "succeeded"
    assert not marker.exists()
    assert cluster.procs[plain].poll() is None, "the trainer died of a bad job"
    with pytest.raises(BadRequest, match="max_attempts must be at most 10"):
        cluster.submit(**{**JOB, "max_attempts": 1000})


@pytest.mark.timeout(300)
def test_killed_mid_epoch_after_the_last_step_and_after_validation_in_a_row(
    cluster, reference, alone, train_digests, stop_after
):
    """Three kills of one job, each at the first checkpoint of its new attempt: step 19 (mid-epoch),
    step 38 (the epoch's last step, before its validation: the next attempt validates it) and the
    epoch-end checkpoint after validation (cursor (1, 0), with the epoch's record)."""
    stop_after.append("k")
    job = cluster.submit(**JOB)
    for _ in range(3):
        wait_killed(cluster.start_killed_at("k", "checkpoint"))
    cluster.start_trainer("k")
    info = cluster.wait_end(job, timeout=120)
    assert_same_run(info, reference)
    assert info["attempts"] == 4
    steps = [(c["step"], c["epoch"]) for c in info["checkpoints"]]
    # at the last step (cursor (0, 600): epoch 0 done) and after its validation (cursor (1, 0))
    assert steps[:3] == [(19, 0), (38, 0), (38, 1)], steps
    assert_exactly_once(cluster, job, train_digests)


POINTS = [("validation", 1), ("validation", 2), ("test_eval", 1), ("push_before", 1), ("push_after", 1)]


@pytest.mark.timeout(300)
def test_killed_at_each_boundary_every_job_ends_as_if_uninterrupted(
    cluster, reference, alone, train_digests, stop_after
):
    """One job per kill point, all at once (each trainer dies on its first job, at its point):
    at the start of epoch 1's and epoch 2's validation (the last checkpoint was at the epoch's
    last step), during the provider-side test evaluation, before and after PushResult."""
    jobs = [cluster.submit(**JOB) for _ in POINTS]
    procs = []
    for point, nth in POINTS:
        name = f"kp-{point}-{nth}"
        stop_after.append(name)
        procs.append((name, cluster.start_killed_at(name, point, nth)))
    for name, proc in procs:
        wait_killed(proc)
        cluster.start_trainer(name)  # as systemd restarts it
    infos = [cluster.wait_end(job, timeout=180) for job in jobs]
    for job, info in zip(jobs, infos):
        assert_same_run(info, reference)
        assert_exactly_once(cluster, job, train_digests)
    # killed after the router stored its result, one job needed no second attempt
    assert sorted(i["attempts"] for i in infos) == [1, 2, 2, 2, 2]


def test_a_one_epoch_job_checkpointed_at_its_last_step_resumes_to_success(cluster, alone, stop_after):
    stop_after.append("one")
    job = cluster.submit(**{**JOB, "epochs": 1, "checkpoint_every": 38, "evaluate": False})
    wait_killed(cluster.start_killed_at("one", "checkpoint"))
    cluster.start_trainer("one")
    info = cluster.wait_end(job, timeout=120)
    assert info["state"] == "succeeded", info["error"]
    assert [h["epoch"] for h in info["result"]["history"]] == [1]


def test_commands_are_applied_after_a_router_restart(cluster, plain):
    """Command ids carry the router's epoch: the restarted router's first command is not taken
    for one the trainer already applied (it used to time out, silently ignored). Last in the module:
    it kills the module's router."""
    job = cluster.submit(**{**JOB, "epochs": 200, "evaluate": False})
    cluster.wait(job, lambda i: i["state"] == "running" and (i["progress"] or {}).get("step", 0) >= 1, timeout=120)
    assert cluster.control(job, "pause")["acked"]
    router = cluster.procs["router"]
    router.send_signal(signal.SIGKILL)
    router.wait(10)
    cluster.start_router(bind=cluster.endpoint)
    deadline = time.monotonic() + 30
    while True:  # the trainer says Hello again within a heartbeat or two
        try:
            detail = cluster.control(job, "resume")
            break
        except Unavailable:
            assert time.monotonic() < deadline, "the trainer never came back to the restarted router"
            time.sleep(0.2)
    assert detail["acked"] and detail["state"] == "running"
    assert cluster.control(job, "checkpoint")["acked"]
    cluster.control(job, "stop")
    assert cluster.wait_end(job, timeout=60)["state"] == "stopped"

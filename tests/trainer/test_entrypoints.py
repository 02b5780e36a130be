"""Entrypoint jobs: the user's training function runs as a job, each attempt in a process of its own.

A router, a provider and `busctl start trainer` subprocesses on one SQLite file. A function with its
own loss (tests/support/entrypoints.py, written from docs/jobs.md) is killed with its trainer at two
checkpoints mid-epoch and ends with the weights of an uninterrupted run; what it printed is in
`busctl job logs`. Functions that segfault, hang or exit fail their own attempt only, with how they
ended and their last lines; the trainer takes the next job. A module the trainer's operator does not
allow is refused at submit while the trainer is connected, and by the trainer (naming the setting,
importing nothing) when it was queued before.
"""

from __future__ import annotations

import signal
import time

import pytest
import torch

from libbus.errors import BadRequest
from tests.support.jobs import EntryCluster, alone_fixture, final_weights, plain_fixture, plain_trainer  # noqa: F401 - the alone and plain fixtures
from tests.support.memcg import memory_cgroup

#: 320 of mock://mnist?n=600's train samples: 20 steps of 16 an epoch; checkpoints every 7 steps and at each report
JOB = {
    "dataset": "mnist",
    "entrypoint": "tests.support.entrypoints:custom_loss",
    "params": {"lr": 0.05, "epochs": 1, "seed": 3},
    "batch_size": 16,
    "shuffle": "full",
    "seed": 5,
    "evaluate": False,
    "checkpoint_every": 7,
    "train_range": [0, 320],
    "max_attempts": 5,
}


#: Each test waits for whole jobs on a cluster of processes, with its own timeouts and the cluster's
#: logs when one runs out: pytest's own limit (120 s) must not cut that short.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = EntryCluster(tmp_path_factory.mktemp("entry"))
    try:
        cluster.start_router()
        cluster.start_provider()
        yield cluster
    finally:
        cluster.close()


def _stop(cluster: EntryCluster, name: str) -> None:
    cluster.procs[name].send_signal(signal.SIGTERM)
    cluster.procs[name].wait(30)


@pytest.fixture(scope="module")
def reference(cluster) -> dict:
    plain_trainer(cluster)
    info = cluster.wait_end(cluster.submit_spec(JOB), timeout=180)
    assert info["state"] == "succeeded", info["error"]
    return info


def test_a_module_the_trainer_does_not_allow_runs_nothing(cluster, alone, tmp_path):
    """Queued while no trainer was connected (the router could not check it), the trainer refuses it
    and imports nothing; submitted while one is, the router refuses it at once."""
    marker = tmp_path / "ran"
    entry = cluster.submit_spec({**JOB, "entrypoint": "tests.killpoint:raising_model", "max_attempts": 1})
    piped_spec = {**JOB, "entrypoint": "", "params": {}, "model": "pydoc:pipepager"}
    piped = cluster.submit_spec({**piped_spec, "model_kwargs": {"cmd": f"id > {marker}"}})
    plain_trainer(cluster)
    refused = cluster.wait_end(entry, timeout=120)
    assert "not in this trainer's job_modules (tests.support.entrypoints)" in refused["error"], refused["error"]
    assert "BATCHBUS_JOB_MODULES" in refused["error"]
    # what to list: a new user who lists the package's name alone learns it takes a trailing "."
    assert "the operator lists 'tests.killpoint', or 'tests.' for every module" in refused["error"]
    info = cluster.wait_end(piped, timeout=120)
    assert info["state"] == "failed" and "job_modules" in info["error"], info["error"]
    time.sleep(0.5)
    assert not marker.exists()
    # the trainer connected has told the router what it allows: the same jobs are refused at submit
    for spec, module in (
        (JOB | {"entrypoint": "tests.killpoint:raising_model"}, "tests.killpoint"),
        (piped_spec, "pydoc"),
    ):
        with pytest.raises(BadRequest) as at_submit:
            cluster.submit_spec(spec)
        said = str(at_submit.value)
        assert f"no connected trainer can import module {module!r}" in said, said
        assert "allow tests.support.entrypoints (not allowed)" in said and "BATCHBUS_JOB_MODULES" in said, said


def test_commands_apply_at_the_functions_calls(cluster, plain):
    """set, pause, resume, checkpoint and stop on an entrypoint job, then resume from its checkpoint."""
    spec = {**JOB, "entrypoint": "tests.support.entrypoints:counter", "params": {"steps": 400, "delta": 1}}
    job = cluster.submit_spec(spec)
    cluster.wait(job, lambda i: (i.get("progress") or {}).get("step", 0) >= 5)
    assert cluster.control(job, "set", delta=2)["spec"]["params"]["delta"] == 2
    assert cluster.control(job, "pause")["state"] == "paused"
    paused = cluster.wait(job, lambda i: i["progress"]["state"] == "paused")["progress"]["step"]
    while_paused = cluster.later_reports(job, 3)["progress"]  # three reports made while paused
    assert (while_paused["state"], while_paused["step"]) == ("paused", paused)  # no step while paused
    cluster.control(job, "resume")
    # a checkpoint asked at once may be applied at the very call that took the resume, still at the
    # paused step: ask once a report shows a step taken since
    cluster.wait(job, lambda i: i["progress"]["step"] > paused)
    record = cluster.control(job, "checkpoint")["checkpoint"]
    assert record["step"] > paused and record["path"].endswith(".safetensors")
    cluster.control(job, "stop")
    stopped = cluster.wait_end(job)
    assert stopped["state"] == "stopped", stopped["error"]
    at = stopped["checkpoint"]["step"]
    assert at >= record["step"]
    cluster.control(job, "resume")  # queued again: the next attempt restores the stopped one's state
    info = cluster.wait_end(job, timeout=120)
    assert info["state"] == "succeeded", info["error"]
    logs = cluster.busctl("job", "logs", job).stdout
    assert f"counter starts at n={at} " in logs, logs
    weights = final_weights(info)
    assert int(weights["n"]) == 400
    assert float(weights["total"]) > 400  # delta 2 from the set on


def test_a_function_with_its_own_loss_killed_twice_mid_epoch_ends_as_if_uninterrupted(cluster, reference, alone):
    job = cluster.submit_spec(JOB)
    # the trainer dies right after its attempt's first checkpoint (steps 7, 14) reached the router, twice; each
    # time it is restarted under its name, as systemd restarts it: the router gives the job back at once (not
    # after the 20 s lease; a lapsed lease and another trainer: tests/system/test_jobs_durable.py)
    for _ in range(2):
        proc = cluster.start_killed_at("k", "entry_checkpoint")
        assert proc.wait(180) == -signal.SIGKILL, cluster.logs()
    cluster.start_trainer("k")
    try:
        info = cluster.wait_end(job, timeout=180)
    finally:
        _stop(cluster, "k")
    assert info["state"] == "succeeded", info["error"]
    assert info["result"]["history"] == reference["result"]["history"]
    ours, theirs = final_weights(info), final_weights(reference)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    # what the function printed, attempt by attempt: the last one resumed at step 14, mid-epoch 1
    logs = cluster.busctl("job", "logs", job).stdout
    assert "attempt 2: epoch 0 from sample 224" in logs, logs
    assert "epoch 1: val accuracy" in logs
    first = cluster.busctl("job", "logs", job, "--attempt", "0").stdout
    assert "attempt 0: epoch 0 from sample 0" in first, first


def test_a_trainer_killed_right_after_the_router_took_a_checkpoint_resumes_from_it(cluster, alone):
    """The trainer dies after the router stored checkpoint 1 but before its answer reached the attempt;
    the attempt dies with it, but not at once, and meanwhile writes more. None of them may delete the
    one the router holds (the record in flight counts as held): the next attempt resumes from it
    instead of starting over."""
    job = cluster.submit_spec(
        {**JOB, "entrypoint": "tests.support.entrypoints:checkpoints_fast", "params": {"steps": 300}}
    )
    proc = cluster.start_killed_at("quick", "entry_checkpoint")  # dies as checkpoint 1 reaches the router
    assert proc.wait(180) == -signal.SIGKILL, cluster.logs()
    held = cluster.job(job)["checkpoints"][-1]
    assert held["step"] == 1, held
    cluster.start_trainer("quick")  # restarted under its name: the job is given back at once
    try:
        info = cluster.wait_end(job, timeout=180)
    finally:
        _stop(cluster, "quick")
    assert info["state"] == "succeeded", info["error"]
    logs = cluster.busctl("job", "logs", job).stdout
    assert "cannot resume" not in logs and "attempt 1 starts at n=1 step 1" in logs, logs
    assert info["progress"]["resumed_from"]["step"] == 1


def _fails_alone(cluster: EntryCluster, entrypoint: str) -> dict:
    job = cluster.submit_spec({**JOB, "entrypoint": entrypoint, "max_attempts": 1})
    return cluster.wait_end(job, timeout=120)


def test_attempts_that_crash_hang_or_exit_fail_alone_and_the_trainer_goes_on(cluster, alone):
    cluster.start("sturdy", "trainer", env={"BATCHBUS_ATTEMPT_SILENCE_S": "6"})  # the hang is found in 6 s
    try:
        crashed = _fails_alone(cluster, "tests.support.entrypoints:segfault")
        assert crashed["state"] == "failed"
        assert "killed by SIGSEGV" in crashed["error"] and "native code" in crashed["error"], crashed["error"]
        assert "about to read address 0" in crashed["error"]  # its last lines
        hung = _fails_alone(cluster, "tests.support.entrypoints:hang")
        assert hung["state"] == "failed" and "hung" in hung["error"] and "waiting forever" in hung["error"]
        shown = cluster.busctl("job", "logs", hung["id"]).stdout  # what it printed, escapes shown, not sent
        assert "waiting forever \\x1b[2J" in shown and "\x1b" not in shown, shown
        assert "WARNING user.job: stuck before step 1" in shown, shown  # the function's log record, as logged
        exited = _fails_alone(cluster, "tests.support.entrypoints:exits")
        assert exited["state"] == "failed" and "SystemExit: 3" in exited["error"], exited["error"]
        # a failure in the job's own code names the step and the user's own line, and says what to do next
        assert "raised by the job's own code at step 0, tests/support/entrypoints.py:" in exited["error"], exited
        assert "in exits: sys.exit(3)" in exited["error"] and "no checkpoint yet" in exited["error"], exited["error"]
        assert f"busctl job logs {exited['id']}" in exited["error"] and "busctl job resume" in exited["error"]
        # the same trainer, alive, takes the next job and trains it
        assert cluster.procs["sturdy"].poll() is None
        ok = cluster.wait_end(cluster.submit_spec({**JOB, "params": {**JOB["params"], "epochs": 1}}), timeout=180)
        assert ok["state"] == "succeeded", ok["error"]
        assert [r["epoch"] for r in ok["result"]["history"]] == [1] and 0 <= ok["result"]["val_accuracy"] <= 1
    finally:
        _stop(cluster, "sturdy")


def test_an_attempt_that_exhausts_memory_is_killed_alone(cluster, alone):
    """The trainer and its attempts in a memory cgroup of 1.5 GiB: the out-of-memory killer takes
    the attempt (it offers itself first), the trainer says so and takes the next job."""
    with memory_cgroup(1536 << 20) as group:
        proc = cluster.start_trainer("bounded")
        try:
            (group / "cgroup.procs").write_text(str(proc.pid))
            info = _fails_alone(cluster, "tests.support.entrypoints:hog")
            assert info["state"] == "failed" and "killed by SIGKILL" in info["error"], info["error"]
            assert "out-of-memory killer" in info["error"] and "allocating" in info["error"]
            assert proc.poll() is None
            after = _fails_alone(cluster, "tests.support.entrypoints:exits")  # it takes the next job
            assert "SystemExit: 3" in after["error"]
        finally:
            _stop(cluster, "bounded")

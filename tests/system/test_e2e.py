"""The whole system as a user runs it: three `busctl start` processes on loopback, jobs submitted and
followed with `busctl`, a real CNN trained on batches pulled from the provider."""

import json
import time

import pytest

from tests.support import Cluster, busctl


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("cluster")
    cluster = Cluster(state, {"BATCHBUS_HEARTBEAT_MS": "200"})
    env = cluster.env
    cluster.busctl("token", "secret", str(state / "secret"))
    try:
        cluster.start_router()
        cluster.start(
            "provider",
            "provider",
            "--bind",
            "tcp://127.0.0.1:0",
            "--dataset",
            "mnist=mock://mnist?n=3000",
            ready=True,
            named=False,
        )
        cluster.endpoint_of("provider")
        cluster.start_trainer("trainer-1")
        procs = list(cluster.procs.values())
        yield env, procs, cluster
    finally:
        codes = cluster.close(timeout=30)
    # SIGTERM drains and exits 0, as systemd expects, and leaves no shared memory behind
    assert codes == [0, 0, 0], f"exit codes {codes}; logs in {state}"
    assert not [seg.name for seg in cluster.leaked]


def job_state(job: str, env: dict) -> dict:
    return json.loads(busctl("job", "show", job, "--json", env=env, check=True).stdout)


def wait_state(cluster: Cluster, job: str, states: set, timeout: float) -> dict:
    """The job as `busctl job show --json` prints it, once it is in one of ``states``. The wait polls the
    router through the cluster's admin client: a `busctl` process per poll (its start-up ~0.4 s of CPU, twice
    a second) took a core from the training it waited for."""
    deadline = time.monotonic() + timeout
    while True:
        info = cluster.job(job)
        if info["state"] in states:
            break
        assert time.monotonic() < deadline, f"job {job} stuck in {info['state']}: {info.get('error')}"
        time.sleep(0.2)
    info = job_state(job, cluster.env)
    assert info["state"] in states, info  # (a state it reached is where busctl finds it: each of these stays)
    return info


def test_a_submitted_job_trains_and_scores_on_the_private_split(cluster):
    env, procs, bus = cluster
    job = busctl(
        "submit",
        "--dataset",
        "remote://mnist",
        "--model",
        "cnn",
        "--epochs",
        "2",
        "--batch-size",
        "64",
        "--lr",
        "0.002",
        "--optimizer",
        "adam",
        "--seed",
        "1",
        env=env,
        check=True,
    ).stdout.strip()
    info = wait_state(bus, job, {"succeeded", "failed", "stopped"}, timeout=240)
    assert info["state"] == "succeeded", info.get("error")
    result = info["result"]
    assert result["test_accuracy"] >= 0.90 and result["test_n"] == 600
    assert len(result["history"]) == 2 and result["samples_per_s"] > 0
    assert [e["state"] for e in info["events"]] == ["queued", "running", "succeeded"]
    listed = json.loads(busctl("jobs", "--json", env=env, check=True).stdout)
    assert job in {j["id"] for j in listed}
    peers = json.loads(busctl("peers", "--json", env=env, check=True).stdout)
    assert {"provider", "trainer", "admin"} <= {p["role"] for p in peers}
    services = json.loads(busctl("queues", "--json", env=env, check=True).stdout)
    provider_stats = next(s for s in services.values() if s["role"] == "provider")
    assert provider_stats["datasets"]["mnist"]["samples"] >= 2 * 3000  # every batch came from the provider
    # same host: the train and val batches went through the trainer's shared-memory rings
    assert provider_stats["datasets"]["mnist"]["shm_batches"] == provider_stats["datasets"]["mnist"]["batches"]
    assert result["transport"] == "shm"


def test_stop_ends_a_running_job_promptly(cluster, tmp_path):
    env, procs, bus = cluster
    spec = tmp_path / "long.toml"
    spec.write_text('[job]\ndataset = "mnist"\nmodel = "mlp"\nepochs = 200\nevaluate = false\n')
    job = busctl("submit", str(spec), env=env, check=True).stdout.strip()
    wait_state(bus, job, {"running"}, timeout=60)
    assert json.loads(busctl("job", "stop", job, "--json", env=env, check=True).stdout)["state"] in (
        "stopping",
        "stopped",
    )
    # stopped within the wait (mid-epoch: a command is acknowledged between steps), long before the
    # 200 epochs could end; the bound is loose because `busctl job show` itself is slow on a loaded machine
    info = wait_state(bus, job, {"stopped", "succeeded", "failed"}, timeout=30)
    assert info["state"] == "stopped", info

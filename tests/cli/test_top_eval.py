"""`busctl job eval` and `busctl top` against real services: a router, a provider and a trainer on
loopback TCP (in this process, on their own threads), busctl as a subprocess, and `busctl top`
under tmux as a terminal would run it.

One job (an MLP on mock://mnist) runs through it all: scored by the provider while it trains, shown
by `top` (once, as JSON, and live under tmux), paused, scored again and checked against the weights
of a checkpoint of that very step, resumed, and stopped. The job is far longer than the test (it cannot end
on its own while a loaded machine is slow to draw `top`): the test ends it, so nothing here races its length.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import zmq
from rich.console import Console
from safetensors.torch import save as save_safetensors

from cli.top import render
from libbus.connect.client import Client, Identity
from libbus.security.auth import issue_token
from libbus.wire.messages import ControlJob, GetJob, Stats, SubmitJob
from services.provider.evaluator import evaluate_weights
from services.provider.sources import open_source
from services.trainer.attempt.checkpoint import checkpoint_model
from tests.support import BUSCTL, REPO, busctl, wait_job
from tests.support.busctl import interruptible, sigint_state

DATASET = "mock://mnist?n=2000"
SPEC = {
    "dataset": "mnist",
    "model": "mlp",
    "model_kwargs": {"hidden": 32},
    "epochs": 1000,
    "batch_size": 16,
    "optimizer": "adam",
    "lr": 0.003,
    "seed": 3,
    "evaluate": False,
}


@pytest.fixture
def cluster(router, start_provider, make_settings, state_dir, secret):
    """Provider ``prov-top`` and trainer ``trainer-top`` on the router; an admin client; busctl's env."""
    from services.trainer.service.app import TrainerService

    start_provider(f"mnist={DATASET}", name="prov-top", assigned_only=True)
    trainer = TrainerService(
        make_settings(router=router.endpoint, name="trainer-top", progress_interval_s=0.2, torch_threads=1)
    )
    stop = threading.Event()
    thread = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
    thread.start()
    token = issue_token(secret, sub="test-admin", role="admin", audience="batchbus", ttl_s=600)
    admin = Client(router.endpoint, Identity(role="admin", name="test-admin", token=token), timeout_s=10, retries=0)
    env = {
        **os.environ,
        "BATCHBUS_STATE_DIR": str(state_dir),
        "BATCHBUS_ROUTER": router.endpoint,
        "PYTHONPATH": str(REPO),
        "COLUMNS": "200",
    }
    yield admin, env
    admin.close()
    stop.set()
    thread.join(15)
    assert not thread.is_alive(), "trainer did not stop within 15 s"


def _wait(admin: Client, job: str, until, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = admin.request(GetJob(job=job)).job
        if until(info):
            return info
        assert info["state"] not in ("succeeded", "failed", "stopped"), f"job ended {info['state']}: {info}"
        assert time.monotonic() < deadline, f"job {job} stuck in {info['state']}"
        time.sleep(0.05)


def _evaluations(row: dict) -> int:
    return sum(int(d.get("evaluations", 0)) for d in (row.get("datasets") or {}).values())


def _until_stats(admin: Client, name: str, check, what: str, timeout: float = 60) -> dict:
    """The Stats row of the service ``name`` once ``check(row)``."""
    deadline = time.monotonic() + timeout
    while True:
        rows = [r for r in admin.request(Stats()).services.values() if r.get("name") == name]
        if rows and check(rows[0]):
            return rows[0]
        assert time.monotonic() < deadline, f"{name}: never {what}: {rows}"
        time.sleep(0.05)


def _tmux_top(env: dict, tmp_path) -> str:
    """Run `busctl top` in a detached 160x60 tmux session until it draws; the screen it shows, after Ctrl-C."""
    session = f"bbtop{os.getpid()}"
    sock = str(tmp_path / "tmux.sock")
    cmd = " ".join([*BUSCTL, "top", "--interval", "0.5"]) + f" 2>{tmp_path / 'top.err'}; echo TOP-EXIT=$?; sleep 30"
    tmux = ["tmux", "-S", sock]
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", session, "-x", "160", "-y", "60", "-c", str(REPO), cmd],
        env=env,
        check=True,
        timeout=10,
    )
    try:
        # Ctrl-C once top draws its frames (a loaded machine may take seconds to import and connect;
        # a Ctrl-C before the first frame is an interrupted start, exit 130, not how top ends)
        deadline = time.monotonic() + 30
        while True:
            live = subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True, check=True, timeout=10
            ).stdout
            if "trainer-top" in live or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        time.sleep(1.5)  # a few more frames, so that rates are drawn
        live = subprocess.run(
            [*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True, check=True, timeout=10
        ).stdout
        subprocess.run([*tmux, "send-keys", "-t", session, "C-c"], check=True, timeout=10)
        deadline = time.monotonic() + 20
        while True:
            after = subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True, check=True, timeout=10
            ).stdout
            if "TOP-EXIT=" in after or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        subprocess.run([*tmux, "kill-server"], timeout=10)
    assert "TOP-EXIT=0" in after, f"busctl top did not end with 0 on Ctrl-C:\n{after}"
    assert "Traceback" not in after + (tmp_path / "top.err").read_text()
    return live


def test_eval_and_top_on_a_running_job(cluster, tmp_path):
    admin, env = cluster
    job = admin.request(SubmitJob(spec=SPEC)).job
    _wait(admin, job, lambda j: j["state"] == "running" and (j.get("progress") or {}).get("step", 0) >= 1)

    # scored mid-training: the step it was taken at, a test-split score, the copy time
    out = busctl("job", "eval", job, "--json", env=env, check=True)
    running = json.loads(out.stdout)
    source = open_source(DATASET)
    info = source.info()
    n_test = info["splits"]["test"]["num_samples"]
    steps = SPEC["epochs"] * -(-info["splits"]["train"]["num_samples"] // SPEC["batch_size"])
    assert running["acked"] and running["trainer"] == "trainer-top" and running["provider"] == "prov-top"
    assert 1 <= running["step"] <= steps and 1 <= running["epoch"] <= SPEC["epochs"]
    assert running["test_n"] == n_test and 0.0 <= running["test_accuracy"] <= 1.0 and running["test_loss"] > 0
    assert isinstance(running["copy_ms"], float) and running["copy_ms"] >= 0

    # the same, for a human: one line with the accuracy, the step and the pause
    human = busctl("job", "eval", job, env=env, check=True).stdout
    assert f"{job}: step " in human and "test accuracy" in human and "training paused" in human

    # top, live under tmux while the job trains (and ended by Ctrl-C with no traceback)
    assert shutil.which("tmux"), "this test runs busctl top under tmux: apt-get install tmux"
    screen = _tmux_top(env, tmp_path)
    for shown in ("providers", "prov-top", "trainers", "trainer-top", job, "mnist", "running"):
        assert shown in screen, f"{shown!r} not on the screen:\n{screen}"

    # paused: nothing trains between the evaluation and a checkpoint, so both are of one step
    admin.request(ControlJob(job=job, command="pause"))
    # top reads the providers' rows the router holds from their heartbeats: wait for one sent since both
    # evaluations, not a row from before them
    _until_stats(admin, "prov-top", lambda row: _evaluations(row) >= 2, "both evaluations counted")
    frame = json.loads(busctl("top", "--once", "--json", "--interval", "0.3", env=env, check=True).stdout)
    [trainer] = frame["trainers"]
    assert trainer["name"] == "trainer-top" and trainer["job"] == job and trainer["state"] == "paused"
    assert 1 <= trainer["epoch"] <= SPEC["epochs"] and trainer["step"] >= running["step"]
    [provider] = frame["providers"]
    assert provider["name"] == "prov-top" and provider["datasets"] == ["mnist"] and provider["samples"] > 0
    assert provider["evaluations"] >= 2
    assert [j["id"] for j in frame["jobs"]] == [job] and 0 < frame["jobs"][0]["fraction"] < 1
    text = busctl("top", "--once", "--interval", "0.3", env=env, check=True).stdout
    for shown in ("prov-top", "trainer-top", job, "paused", f"{trainer['epoch']}/{SPEC['epochs']}"):
        assert shown in text, f"{shown!r} not in:\n{text}"

    paused = admin.request(ControlJob(job=job, command="eval"), timeout_s=120).detail
    ckpt = admin.request(ControlJob(job=job, command="checkpoint")).detail["checkpoint"]
    assert paused["state"] == "paused" and paused["step"] == ckpt["step"]
    # the weights of that step (the model in the job's checkpointed state), scored here on the test split
    weights = checkpoint_model(Path(ckpt["path"]).read_bytes(), ckpt)
    loss, acc, n = evaluate_weights(
        source, "test", {"name": "mlp", "kwargs": SPEC["model_kwargs"]}, save_safetensors(weights), info
    )
    assert (paused["test_accuracy"], paused["test_n"]) == (acc, n)
    assert paused["test_loss"] == pytest.approx(loss, rel=1e-6)

    admin.request(ControlJob(job=job, command="resume"))
    _wait(admin, job, lambda j: j["state"] == "running" and (j.get("progress") or {}).get("step", 0) > paused["step"])
    admin.request(ControlJob(job=job, command="stop"))
    final = wait_job(admin, job, timeout=120)
    assert final["state"] == "stopped", final.get("error")
    evals = [e["reason"] for e in final["events"] if e["reason"].startswith("eval acknowledged")]
    assert len(evals) == 3 and all("test accuracy" in r for r in evals)
    assert f"step {paused['step']} scored on prov-top" in evals[-1]

    # a job that is not running: one line, no traceback
    ended = busctl("job", "eval", job, env=env, check=False)
    assert ended.returncode == 1 and "already ended (stopped)" in ended.stderr
    assert "Traceback" not in ended.stderr and len(ended.stderr.strip().splitlines()) == 1


def test_eval_of_a_queued_job_is_refused(router, state_dir):
    """No trainer holds it: a clear error at once, not a wait for an acknowledgement."""
    env = {
        **os.environ,
        "BATCHBUS_STATE_DIR": str(state_dir),
        "BATCHBUS_ROUTER": router.endpoint,
        "PYTHONPATH": str(REPO),
    }
    job = busctl("submit", "--dataset", "mnist", "--model", "mlp", env=env, check=True).stdout.strip()
    out = busctl("job", "eval", job, env=env, check=False)
    assert out.returncode == 1 and f"job {job} is queued on no trainer" in out.stderr
    assert "Traceback" not in out.stderr


def test_router_down_is_one_line(state_dir):
    """top and job eval with no router answering: one clear line and a non-zero exit."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(0)  # the address now has no one behind it
    env = {
        **os.environ,
        "BATCHBUS_STATE_DIR": str(state_dir),
        "BATCHBUS_ROUTER": f"tcp://127.0.0.1:{port}",
        "PYTHONPATH": str(REPO),
    }
    procs = [
        subprocess.Popen([*BUSCTL, *args], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for args in (("top", "--once"), ("job", "eval", "j1"))
    ]
    for proc in procs:  # side by side: each waits out the Hello timeout
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0 and "Traceback" not in err
        assert err.startswith("error: ") and "did not answer" in err, err
        assert len(err.strip().splitlines()) == 1


def test_render_is_pure():
    """A frame from two snapshots, read without a terminal: rates from the difference, bars, stages."""

    def snapshot(at: float, samples: int) -> dict:
        return {
            "at": at,
            "endpoint": "tcp://head:5555",
            "services": {
                "router": {"jobs": {"running": 1, "queued": 1}, "peers": {"provider": 1, "trainer": 1}},
                "p1": {
                    "datasets": {"mnist": {"samples": samples, "batches": samples // 10}},
                    "counters": {"error_FORBIDDEN": 2},
                    "refused": {"unassigned": 1},
                    "sessions": 2,
                    "pipelines": {
                        "aug": {"requests": {"size": 1, "capacity": 8}, "stages": [{"name": "flip", "type": "random"}]}
                    },
                },
                "t1": {"job": "j1", "tasks": {}},
            },
            "peers": [{"name": "p1", "role": "provider", "datasets": ["mnist"]}, {"name": "t1", "role": "trainer"}],
            "jobs": [
                {
                    "id": "j1",
                    "state": "running",
                    "trainer": "t1",
                    "spec": {"dataset": "mnist", "model": "mlp", "epochs": 4},
                    "progress": {
                        "epoch": 1,
                        "epochs": 4,
                        "step": 150,
                        "steps_per_epoch": 100,
                        "loss": 0.25,
                        "samples": 2400,
                        "samples_per_s": 800.0,
                        "data_wait_pct": 3.5,
                        "data_wait_slowest": "p1",
                        "transport": "shm",
                    },
                },
                {
                    "id": "j2",
                    "state": "queued",
                    "trainer": None,
                    "spec": {"dataset": "mnist", "model": "cnn", "epochs": 1},
                },
                {  # an entrypoint job: its spec's model is the unused default
                    "id": "j3",
                    "state": "queued",
                    "trainer": None,
                    "spec": {"dataset": "mnist", "model": "cnn", "epochs": 1, "entrypoint": "mylab.train:main"},
                },
            ],
        }

    console = Console(file=io.StringIO(), width=200, record=True)
    console.print(render(snapshot(12.0, 3000), snapshot(10.0, 1000)))
    text = console.export_text()
    assert "1000" in text.split("p1", 1)[1].splitlines()[0]  # (3000 - 1000) samples / 2 s
    assert "FORBIDDEN 2, unassigned 1" in text
    assert "t1" in text and "2/4" in text and "0.2500" in text and "3.5% (p1)" in text and "shm" in text
    assert "38%" in text and "150/400" in text  # 150 of 4 x 100 steps
    assert "j2" in text and "queued" in text and "p1: pipeline aug" in text and "flip" in text
    assert "mylab.train:main" in text.split("j3", 1)[1].splitlines()[0]  # what it runs, not the default model
    first = Console(file=io.StringIO(), width=200, record=True)
    first.print(render(snapshot(12.0, 3000), None))  # no previous snapshot: no rate yet
    row = first.export_text().split("p1", 1)[1].splitlines()[0]
    assert "3000" in row and "1000" not in row


def test_live_top_says_when_the_router_stops_answering_and_ends_on_ctrl_c(make_settings, state_dir, secret):
    """A router that stops answering while top runs is said under the last frame; Ctrl-C exits 0."""
    from services.router.app import RouterService

    settings = make_settings(bind="tcp://127.0.0.1:0")
    service = RouterService(settings)
    endpoint = service.start()
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    env = {
        **os.environ,
        "BATCHBUS_STATE_DIR": str(state_dir),
        "BATCHBUS_ROUTER": endpoint,
        "BATCHBUS_REQUEST_TIMEOUT_S": "1",
        "PYTHONPATH": str(REPO),
        "COLUMNS": "200",
    }
    proc = subprocess.Popen(
        [*BUSCTL, "top", "--interval", "0.3"],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    try:
        token = issue_token(secret, sub="test-admin", role="admin", audience="batchbus", ttl_s=600)
        with Client(endpoint, Identity(role="admin", name="test-admin", token=token), timeout_s=10) as admin:
            deadline = time.monotonic() + 30
            while admin.request(Stats()).services["router"]["peers"].get("admin", 0) < 2:  # top's and ours
                assert proc.poll() is None and time.monotonic() < deadline, "busctl top never connected"
                time.sleep(0.1)
        time.sleep(1.0)  # a refresh or two with the router there
        stop.set()
        thread.join(10)
        time.sleep(3.0)  # a refresh or two find no router
        taken = sigint_state(proc.pid)
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"busctl top went on after Ctrl-C (SIGINT there: {taken})") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "batchbus top" in out and "router not answering" in out and "Traceback" not in out + err

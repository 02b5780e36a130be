"""Jobs that survive failures, with real processes: `busctl start` router, provider and trainers as
subprocesses on one SQLite file, killed with SIGKILL (trainer, router, provider) or SIGTERM
(trainer) mid-job.

Every job here trains an MLP on mock://mnist?n=600 (shuffle full). Trainers run with an audit
directory: each batch they train on is logged as per-sample digests of the bytes they received, so
a test can check that the final model saw every training sample exactly once per epoch, whatever
died on the way (services/trainer/attempt/audit.py replays resumed attempts).
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from libbus.errors import BadRequest
from libbus.order.epochs import Cursor
from services.trainer.attempt.audit import effective_epochs
from services.trainer.attempt.checkpoint import load_state
from tests.support import busctl
from tests.support.jobs import SPEC, JobCluster, final_weights


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = JobCluster(tmp_path_factory.mktemp("durable"))
    try:
        cluster.start_router()
        cluster.start_provider()
        cluster.start_trainer("t1")  # trainers start alongside: two are up, one job each
        cluster.start_trainer("t2")
        cluster.provider_endpoint = cluster.endpoint_of("provider")
        yield cluster
    finally:
        cluster.close()


def assert_exactly_once(cluster: JobCluster, job: str, train_digests: Counter) -> None:
    epochs = effective_epochs(cluster.audit, job)
    assert sorted(epochs) == list(range(SPEC["epochs"]))
    for epoch, seen in epochs.items():
        assert seen == train_digests, (
            f"epoch {epoch}: {sum((seen - train_digests).values())} extra, "
            f"{sum((train_digests - seen).values())} missing samples"
        )


def pause_then_resume(cluster: JobCluster, job: str, trainer: str) -> dict:
    """Pause as soon as the job trains (acknowledged within a second; no batch trained while
    paused), checkpoint there — mid-epoch, whatever this machine's speed — and resume. Returns the
    checkpoint's record."""
    cluster.wait(job, lambda i: i["state"] == "running" and (i["progress"] or {}).get("step", 0) >= 1)
    detail = cluster.control(job, "pause")
    assert detail["state"] == "paused" and detail["trainer"] == trainer
    assert cluster.job(job)["state"] == "paused"
    before = cluster.trained_batches(job, trainer)
    ckpt = cluster.control(job, "checkpoint")["checkpoint"]
    cluster.later_reports(job, 3)  # its attempt went on through three reports, paused
    assert cluster.trained_batches(job, trainer) == before == ckpt["step"], "a paused trainer kept training"
    detail = cluster.control(job, "resume")
    assert detail["state"] == "running"
    return ckpt


def resumed_from(cluster: JobCluster, job: str, trainer: str) -> int:
    (path,) = cluster.audit.glob(f"{job}.{trainer}.*.jsonl")
    return json.loads(path.read_bytes().splitlines()[0])["resumed_from_step"]


def audit_stamps(cluster: JobCluster, job: str) -> list[float]:
    """When each batch of ``job`` audited so far was trained (whole lines only: a file is being written)."""
    return [
        json.loads(line)["t"]
        for p in cluster.audit.glob(f"{job}.*.jsonl")
        for line in p.read_bytes().splitlines(keepends=True)[1:]
        if line.endswith(b"\n")
    ]


def test_trainer_killed_mid_epoch_another_resumes_exactly(cluster, train_digests):
    reference = cluster.submit()  # the uninterrupted run, on one trainer
    job = cluster.submit()  # the run to interrupt, on the other
    watch = cluster.spawn(
        "watch",
        "job",
        "watch",
        job,
        env={"COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    victim = cluster.wait(job, lambda i: i["state"] == "running")["trainer"]
    pause_then_resume(cluster, job, victim)
    cluster.procs[victim].send_signal(signal.SIGKILL)  # mid-epoch, between checkpoints
    cluster.procs[victim].wait(10)
    cluster.start_trainer("t3")  # two trainers again for the next tests
    ref = cluster.wait_end(reference)
    assert ref["state"] == "succeeded", ref["error"]
    info = cluster.wait_end(job)
    assert info["state"] == "succeeded", info["error"]
    heir = info["trainer"]
    assert heir != victim and info["attempts"] == 2 and info["failures"] == 1
    reasons = [e["reason"] for e in info["events"]]
    assert any(f"lease of trainer {victim} lapsed" in r for r in reasons), reasons
    assert any(r.startswith(f"assigned to {heir} (resumes from step") for r in reasons), reasons
    assert any(r.startswith(f"pause acknowledged by {victim}") for r in reasons), reasons
    # the heir continued from the last checkpoint, not from scratch; the model equals the uninterrupted one
    assert resumed_from(cluster, job, heir) > 0
    ours, theirs = final_weights(info), final_weights(ref)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6)
    for ours_epoch, ref_epoch in zip(info["result"]["history"], ref["result"]["history"], strict=True):
        assert ours_epoch == pytest.approx(ref_epoch, rel=1e-5)
    assert_exactly_once(cluster, job, train_digests)
    assert_exactly_once(cluster, reference, train_digests)
    # `busctl job watch` followed it through the pause and the trainer's death to the end
    shown, _ = watch.communicate(timeout=30)
    assert watch.returncode == 0, shown
    assert "epoch 3: train loss" in shown and "data wait" in shown and f"job {job} succeeded" in shown, shown
    # the model comes home: the router kept a copy, `busctl job model` downloads it
    out = cluster.state / "downloaded.safetensors"
    printed = cluster.busctl("job", "model", job, "-o", str(out)).stdout
    assert info["result"]["model"]["sha256"] in printed
    assert out.read_bytes() == Path(info["result"]["model"]["path"]).read_bytes()


def test_router_killed_mid_job_training_goes_on(cluster, train_digests):
    job = cluster.submit(batch_size=8)
    cluster.wait(job, lambda i: i["state"] == "running" and (i["progress"] or {}).get("step", 0) >= 1)
    before = cluster.job(job)
    router = cluster.procs["router"]
    router.send_signal(signal.SIGKILL)
    router.wait(10)
    killed = time.time()
    # a batch trained while no router runs (the audit files are flushed at each batch), then it is back
    deadline = time.monotonic() + 60
    while not any(killed < t for t in audit_stamps(cluster, job)):
        assert time.monotonic() < deadline, f"nothing trained after the router was killed\n{cluster.logs()}"
        time.sleep(0.05)
    cluster.start_router(bind=cluster.endpoint)  # same address, same SQLite file
    restarted = time.time()
    info = cluster.wait_end(job)
    assert info["state"] == "succeeded", info["error"]
    # the trainer trained while the router was down, and kept the job (no requeue)
    assert any(killed < t < restarted for t in audit_stamps(cluster, job))
    assert [e["state"] for e in info["events"]] == ["queued", "running", "succeeded"]
    assert info["events"][:2] == before["events"][:2] and info["attempts"] == 1
    # reports made while it was down were buffered and delivered: no checkpoint record is missing
    steps = [c["step"] for c in info["checkpoints"]]
    every = SPEC["checkpoint_every"]
    assert set(range(every, info["result"]["step"] + 1, every)) <= set(steps)
    assert_exactly_once(cluster, job, train_digests)


def test_commands_from_the_cli_are_acknowledged(cluster):
    job = cluster.submit(epochs=100)
    info = cluster.wait(job, lambda i: i["state"] == "running" and (i["progress"] or {}).get("step", 0) >= 1)
    trainer = info["trainer"]
    env = {**cluster.env}
    out = busctl("job", "pause", job, env=env, check=True).stdout
    assert out.startswith(f"{job}: paused (acknowledged by {trainer} in ")
    assert int(out.split(" in ")[1].split()[0]) < 1000
    before = cluster.trained_batches(job, trainer)
    out = busctl("job", "checkpoint", job, env=env, check=True).stdout
    ckpt = cluster.job(job)["checkpoint"]
    shown = Cursor.of_checkpoint(ckpt).shown()  # epochs counted from 1, as every display counts them
    assert f"checkpoint step {ckpt['step']} ({shown}): {ckpt['path']} sha256 {ckpt['sha256']}" in out
    assert cluster.trained_batches(job, trainer) == before
    assert hashlib.sha256(Path(ckpt["path"]).read_bytes()).hexdigest() == ckpt["sha256"]
    assert ckpt["step"] == before  # taken exactly where training paused
    with pytest.raises(BadRequest, match="lr must be positive"):
        cluster.control(job, "set", lr=-1.0)
    detail = json.loads(
        busctl("job", "set", job, "lr=0.0005", "weight_decay=0.01", "--json", env=env, check=True).stdout
    )
    assert detail["acked"] and detail["spec"]["lr"] == 0.0005
    assert cluster.control(job, "resume")["state"] == "running"
    cluster.wait(job, lambda i: (i["progress"] or {}).get("step", 0) > ckpt["step"] + 2)
    cluster.control(job, "pause")  # (a running trainer prunes old checkpoints)
    after = cluster.control(job, "checkpoint")["checkpoint"]
    groups = load_state(after, str(Path(after["path"]).parent)).state["optimizer"]["param_groups"]
    assert {(g["lr"], g["weight_decay"]) for g in groups} == {(0.0005, 0.01)}  # the optimizer has it
    assert "stopping" in busctl("job", "stop", job, env=env, check=True).stdout
    info = cluster.wait_end(job)
    assert info["state"] == "stopped" and info["spec"]["lr"] == 0.0005
    shown = busctl("job", "show", job, "--progress", "1000", env=env, check=True).stdout
    assert " paused   epoch " in shown  # the progress history has the paused reports
    for word in (
        "pause acknowledged by",
        "checkpoint acknowledged by",
        "set lr=0.0005 weight_decay=0.01",
        "resume acknowledged by",
        "stop acknowledged by",
        "stopped on",
    ):
        assert word in shown, shown
    # a stopped job resumes from the checkpoint its trainer wrote as it stopped
    resumed = info["result"]["checkpoint"]["step"]
    assert cluster.control(job, "resume")["resume"]["step"] == resumed
    # training again (a batch past the checkpoint): commands apply between batches, not while the
    # attempt still sets up, so only now is a stop acknowledged at once
    cluster.wait(job, lambda i: i["state"] == "running" and (i["progress"] or {}).get("step", 0) > resumed)
    assert cluster.control(job, "stop")["acked"]
    assert cluster.wait_end(job)["state"] == "stopped"


def test_sigterm_hands_the_job_back_and_another_trainer_finishes(cluster, train_digests):
    job = cluster.submit()
    info = cluster.wait(job, lambda i: i["state"] == "running")
    first = info["trainer"]
    pause_then_resume(cluster, job, first)
    cluster.procs[first].send_signal(signal.SIGTERM)
    assert cluster.procs[first].wait(20) == 0  # drains and exits 0, as systemd expects
    info = cluster.wait_end(job)  # the other trainer, idle until now, finishes it
    heir = info["trainer"]
    assert info["state"] == "succeeded" and heir != first, info["error"]
    back = next(e for e in info["events"] if "handed back" in e["reason"])
    assert back["state"] == "queued" and back["reason"].startswith(f"handed back by {first}")
    assert info["failures"] == 0  # a hand-back is not a lost attempt
    last = [c for c in info["checkpoints"] if c["trainer"] == first][-1]  # written as it stopped
    assert last["step"] > 0 and resumed_from(cluster, job, heir) == last["step"]
    assert_exactly_once(cluster, job, train_digests)


def test_provider_killed_mid_job_the_attempt_is_retried_from_its_checkpoint(cluster, train_digests):
    # each attempt without a provider fails after provider_wait_s (2 s); a provider process starting on a
    # loaded machine can take longer than a few of those, so this job may use more than the default 3 attempts
    job = cluster.submit(batch_size=8, max_attempts=8)
    cluster.wait(job, lambda i: (i["checkpoint"] or {}).get("step", 0) >= SPEC["checkpoint_every"])
    provider = cluster.procs["provider"]
    provider.send_signal(signal.SIGKILL)
    provider.wait(10)
    # nothing serves mnist for longer than provider_wait_s: the attempt fails, retryable
    cluster.wait(job, lambda i: i["failures"] >= 1)
    cluster.start_provider(bind=cluster.provider_endpoint)  # back, same data
    cluster.endpoint_of("provider")
    info = cluster.wait_end(job)
    assert info["state"] == "succeeded", info["error"]
    # the trainer's loader gave up on the dead provider: a retryable failure, counted, and the next
    # attempt resumed from the last checkpoint
    reasons = [e["reason"] for e in info["events"]]
    # (later attempts may also have found no provider yet)
    assert info["failures"] >= 1 and any(r.startswith("attempt failed on") and "PeerTimeout" in r for r in reasons), (
        reasons
    )
    assert any("(resumes from step" in r for r in reasons), reasons
    assert_exactly_once(cluster, job, train_digests)

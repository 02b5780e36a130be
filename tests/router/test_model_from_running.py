"""``model_from`` naming a job that has not succeeded ("a running job's current weights"):
the new job starts from the model weights of that job's latest checkpoint, taken when the new job is
handed out; only the weights (not its optimizer or data position). Refused at submission while the
job has no checkpoint, and outside the submitter's scope; a checkpoint changed since it was recorded,
or weights that do not fit, fail the attempt (not retried)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors

from libbus.errors import BadRequest, Forbidden
from libbus.wire.messages import ControlJob, GetJob, GetModel, SubmitJob
from services.trainer.attempt.checkpoint import checkpoint_model
from tests.support import wait_job

ENTRY = "tests.support.entrypoints"


@contextmanager
def second_trainer(make_settings, router, name: str = "trainer-2", **flags) -> Iterator[None]:
    """Another trainer (sharing the test's ``checkpoint_dir`` unless ``flags`` say otherwise), for
    the job that starts from one the first trainer holds."""
    from services.trainer.service.app import TrainerService

    service = TrainerService(make_settings(router=router.endpoint, name=name, job_modules=[ENTRY], **flags))
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive(), "trainer-2 did not stop within 30 s"


def _until(admin, job: str, check: Callable[[dict], bool], what: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = admin.request(GetJob(job=job)).job
        if check(info):
            return info
        assert time.monotonic() < deadline, f"job {job} ({info['state']}): never {what}"
        time.sleep(0.1)


def _stepped(info: dict) -> bool:
    return info["state"] == "running" and ((info["progress"] or {}).get("step") or 0) > 0


def _checkpointed(admin, job: str) -> dict:
    """Ask ``job`` for a checkpoint now (the one of its current step); its record once the router holds it."""
    written = admin.request(ControlJob(job=job, command="checkpoint")).detail["checkpoint"]
    _until(admin, job, lambda j: (j["checkpoint"] or {}).get("sha256") == written["sha256"], "recorded it")
    return written


def _model(admin, job: str) -> dict[str, torch.Tensor]:
    return load_safetensors(bytes(admin.request(GetModel(job=job)).frames[0]))


def _started_from(info: dict) -> int:
    """The source checkpoint's step, as the job's events say it started from it."""
    found = [m for e in info["events"] if (m := re.search(r"its checkpoint at step (\d+)", e["reason"]))]
    assert len(found) == 1, info["events"]
    return int(found[0].group(1))


def test_a_built_in_job_starts_from_a_paused_jobs_checkpointed_weights(
    router, start_provider, entry_trainer, make_settings, client_for, make_token, tmp_path
):
    start_provider("other=mock://mnist?n=96", "mnist=mock://mnist?n=96")
    admin = client_for(router.endpoint, role="admin")
    base = {
        "dataset": "other",
        "model": "mlp",
        "model_kwargs": {"hidden": 8},
        "evaluate": False,
        "optimizer": "sgd",
        "momentum": 0.0,
        "batch_size": 16,
    }
    source = admin.request(SubmitJob(spec={**base, "seed": 1, "epochs": 10000})).job
    _until(admin, source, _stepped, "trained a step")
    admin.request(ControlJob(job=source, command="pause"))
    record = _checkpointed(admin, source)  # paused: its latest checkpoint stays this one
    assert admin.request(GetJob(job=source)).job["state"] == "paused"
    weights = checkpoint_model(Path(record["path"]).read_bytes(), record)  # the model in the job's state

    with second_trainer(make_settings, router):
        # another seed (other initial weights), an lr that moves nothing: it ends where it started
        target = admin.request(SubmitJob(spec={**base, "seed": 9, "epochs": 1, "lr": 1e-30, "model_from": source}))
        info = wait_job(admin, target.job, timeout=60)
        assert info["state"] == "succeeded", info["error"]
        assert _started_from(info) == record["step"]
        ours = _model(admin, target.job)
        assert sorted(ours) == sorted(weights)
        for name, tensor in weights.items():
            assert torch.equal(ours[name], tensor), name
        # its own order from step 0: one epoch of 96 samples in batches of 16, none of the source's steps
        assert info["progress"]["step"] == 6

        # weights that do not fit the new job's model: it fails, saying so, and is not retried
        wide = admin.request(SubmitJob(spec={**base, "model_kwargs": {"hidden": 16}, "model_from": source})).job
        info = wait_job(admin, wide, timeout=60)
        assert info["state"] == "failed" and "does not fit this job's model" in info["error"], info["error"]
        assert info["attempts"] == 1

        # a checkpoint changed since the router recorded it: the attempt fails naming the sha256
        data = bytearray(Path(record["path"]).read_bytes())
        data[-1] ^= 0xFF
        Path(record["path"]).write_bytes(bytes(data))
        tampered = admin.request(SubmitJob(spec={**base, "model_from": source})).job
        info = wait_job(admin, tampered, timeout=60)
        assert info["state"] == "failed" and "sha256" in info["error"], info["error"]
        assert info["attempts"] == 1

    # a trainer that cannot read the checkpoint (a checkpoint_dir of its own): the attempt fails saying why
    with second_trainer(make_settings, router, checkpoint_dir=str(tmp_path / "elsewhere")):
        info = wait_job(admin, admin.request(SubmitJob(spec={**base, "max_attempts": 1, "model_from": source})).job, 60)
    assert info["state"] == "failed" and "checkpoint_dir" in info["error"], info["error"]

    # an admin limited to another dataset may not start from this one's weights
    scoped = client_for(router.endpoint, role="admin", token=make_token("admin", datasets=["mnist"]))
    with pytest.raises(Forbidden, match="other"):
        scoped.request(SubmitJob(spec={**base, "dataset": "mnist", "model_from": source}))
    admin.request(ControlJob(job=source, command="stop"))


def test_an_entrypoint_job_starts_from_a_running_jobs_state_and_from_a_stopped_one(
    router, start_provider, entry_trainer, make_settings, client_for
):
    start_provider("other=mock://mnist?n=64")
    admin = client_for(router.endpoint, role="admin")
    spec = {"dataset": "other", "entrypoint": f"{ENTRY}:counting", "evaluate": False, "params": {"sleep": 0.05}}
    source = admin.request(SubmitJob(spec=spec)).job
    _until(admin, source, _stepped, "made a step")
    record = _checkpointed(admin, source)  # it checkpoints only when asked: this stays its latest
    start = {"dataset": "other", "entrypoint": f"{ENTRY}:constant", "evaluate": False, "model_from": source}

    with second_trainer(make_settings, router):
        info = wait_job(admin, admin.request(SubmitJob(spec=start)).job, timeout=60)
        assert info["state"] == "succeeded", info["error"]
        assert _started_from(info) == record["step"] >= 1
        # counting's weight is its step count at the checkpoint; constant adds one
        assert _model(admin, info["id"])["w"].tolist() == [record["step"] + 1.0] * 3
        assert admin.request(GetJob(job=source)).job["state"] == "running"  # the source trains on meanwhile

        # stopped past that checkpoint (a report shows a later step), it checkpoints once more: a job
        # starts from those, its last weights
        _until(admin, source, lambda j: (j["progress"] or {}).get("step", 0) > record["step"], "stepped on")
        admin.request(ControlJob(job=source, command="stop"))
        stopped = wait_job(admin, source, timeout=30)
        assert stopped["state"] == "stopped" and stopped["checkpoint"]["step"] > record["step"]
        info = wait_job(admin, admin.request(SubmitJob(spec=start)).job, timeout=60)
        assert info["state"] == "succeeded", info["error"]
        assert _model(admin, info["id"])["w"].tolist() == [stopped["checkpoint"]["step"] + 1.0] * 3


def test_a_job_without_a_checkpoint_is_no_source_yet(router, client_for):
    admin = client_for(router.endpoint, role="admin")
    queued = admin.request(SubmitJob(spec={"dataset": "other", "model": "mlp"})).job  # no trainer: stays queued
    with pytest.raises(BadRequest, match=f"no checkpoint yet.*busctl job checkpoint {queued}"):
        admin.request(SubmitJob(spec={"dataset": "other", "model": "mlp", "model_from": queued}))
    # an evaluation scores a finished model only
    with pytest.raises(BadRequest, match="succeeded job"):
        admin.request(SubmitJob(spec={"task": "evaluate", "dataset": "other", "model_from": queued, "split": "val"}))


def test_a_state_without_model_weights_is_no_source(router, start_provider, entry_trainer, client_for):
    start_provider("other=mock://mnist?n=64")
    admin = client_for(router.endpoint, role="admin")
    spec = {"dataset": "other", "entrypoint": f"{ENTRY}:pbt_member", "evaluate": False}
    source = admin.request(SubmitJob(spec={**spec, "params": {"epochs": 10000, "rate": 1.0}})).job
    _until(admin, source, lambda j: j["checkpoint"] is not None, "checkpointed")  # at each report
    admin.request(ControlJob(job=source, command="stop"))
    assert wait_job(admin, source, timeout=30)["state"] == "stopped"
    start = {"dataset": "other", "entrypoint": f"{ENTRY}:constant", "evaluate": False, "model_from": source}
    info = wait_job(admin, admin.request(SubmitJob(spec=start)).job, timeout=60)
    assert info["state"] == "failed" and "'model' entry" in info["error"], info["error"]
    assert info["attempts"] == 1  # not retried: the next attempt would read the same file


def test_every_rank_of_a_gang_starts_from_one_snapshot_of_a_paused_job(
    router, start_provider, entry_trainer, make_settings, client_for
):
    start_provider("other=mock://mnist?n=96")
    admin = client_for(router.endpoint, role="admin")
    base = {"dataset": "other", "model": "mlp", "model_kwargs": {"hidden": 8}, "evaluate": False, "batch_size": 16}
    source = admin.request(SubmitJob(spec={**base, "seed": 1, "epochs": 10000, "optimizer": "sgd"})).job
    _until(admin, source, _stepped, "trained a step")
    admin.request(ControlJob(job=source, command="pause"))
    record = _checkpointed(admin, source)
    weights = checkpoint_model(Path(record["path"]).read_bytes(), record)  # the model in the job's state
    with second_trainer(make_settings, router, "trainer-2"), second_trainer(make_settings, router, "trainer-3"):
        # a gang of two, another seed, an lr that moves nothing: both ranks end where the snapshot began
        spec = {**base, "seed": 9, "epochs": 1, "lr": 1e-30, "optimizer": "sgd", "world_size": 2}
        gang = admin.request(SubmitJob(spec={**spec, "model_from": source})).job
        info = wait_job(admin, gang, timeout=120)
        assert info["state"] == "succeeded", info["error"]
        assert _started_from(info) == record["step"]  # one snapshot taken, for the first rank handed its task
        ours = _model(admin, gang)
        assert sorted(ours) == sorted(weights)
        for name, tensor in weights.items():
            assert torch.equal(ours[name], tensor), name

"""Checkpoints on disk (services/trainer/attempt/checkpoint.py) and the job store's leases and retries."""

import hashlib
import random
import sqlite3
import threading
import time

import numpy as np
import orjson
import pytest
import torch
from safetensors.torch import save as save_safetensors
from torch import nn

from libbus.errors import BadRequest
from libbus.jobs.spec import JobSpec
from libbus.order.epochs import Cursor
from libbus.wire.messages import Checkpointed, Ok, Progress
from services.router.store import JobStore
from services.trainer.attempt.builtin import restore_into
from services.trainer.attempt.checkpoint import (
    FORMAT,
    CheckpointError,
    checkpoint_model,
    load_state,
    prune,
    rng_state,
    save_model,
    save_state,
    set_rng_state,
)
from services.trainer.reports import Reporter


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Dropout(0.3), nn.Linear(5, 3))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _step(model, optimizer) -> None:
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def _save(directory, step: int, model, optimizer, cursor: dict | None = None, extra: dict | None = None) -> dict:
    """A checkpoint as the built-in loop's job API writes it: its state is the model and optimizer."""
    return save_state(
        directory,
        step=step,
        epoch=(cursor or {}).get("epoch", 0),
        state={"model": model, "optimizer": optimizer},
        cursors={"train": cursor or {}},
        extra=extra or {},
    )


def test_a_checkpoint_restores_training_exactly(tmp_path):
    model, optimizer = _model_and_optimizer(1)
    for _ in range(3):
        _step(model, optimizer)
    cursor = {"epoch": 1, "position": 40, "n": 100}
    record = _save(tmp_path, 3, model, optimizer, cursor, {"history": [{"epoch": 1, "val_loss": 0.5}]})
    assert record["step"] == 3 and record["cursor"] == cursor and not list(tmp_path.glob(".*.tmp"))
    # the uninterrupted run goes on; random draws included (dropout, numpy, python)
    for _ in range(2):
        _step(model, optimizer)
    expected = ({k: v.clone() for k, v in model.state_dict().items()}, np.random.rand(), random.random())

    other, other_opt = _model_and_optimizer(99)  # another process, another init
    restored = load_state(record, str(tmp_path))
    other.load_state_dict(restored.state["model"])
    other_opt.load_state_dict(restored.state["optimizer"])
    set_rng_state(*restored.rng)
    assert (restored.step, restored.epoch, restored.cursors) == (3, 1, {"train": cursor})
    assert restored.extra["history"] == [{"epoch": 1, "val_loss": 0.5}]
    for _ in range(2):
        _step(other, other_opt)
    for name, value in expected[0].items():
        torch.testing.assert_close(other.state_dict()[name], value, rtol=0, atol=0)
    assert (np.random.rand(), random.random()) == expected[1:]


def test_a_checkpoint_the_built_in_loop_wrote_before_the_job_api_resumes_the_same(tmp_path):
    """A trainer upgraded while a built-in job waits on an old checkpoint (format batchbus-checkpoint-1,
    its model as ``model.*`` tensors, its optimizer as ``optim.*`` and JSON) resumes it exactly."""
    model, optimizer = _model_and_optimizer(4)
    for _ in range(3):
        _step(model, optimizer)
    optim = optimizer.state_dict()
    tensors = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    plain: dict = {}
    for param, entries in optim["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{param}.{key}"] = value.contiguous()
            else:
                plain.setdefault(str(param), {})[key] = value
    rng_tensors, rng_meta = rng_state()
    cursor = {"epoch": 0, "position": 24}
    meta = {
        "batchbus": FORMAT,
        "step": "3",
        "epoch": "0",
        "cursor": orjson.dumps(cursor).decode(),
        "optim": orjson.dumps({"param_groups": optim["param_groups"], "state": plain}).decode(),
        "rng": orjson.dumps(rng_meta).decode(),
        "extra": orjson.dumps({"history": []}).decode(),
    }
    data = save_safetensors({**tensors, **rng_tensors}, metadata=meta)
    path = tmp_path / "step-000000003.safetensors"
    path.write_bytes(data)
    record = {"path": str(path), "sha256": hashlib.sha256(data).hexdigest(), "step": 3}
    _step(model, optimizer)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    restored = load_state(record, str(tmp_path))
    assert restored.cursors == {"train": cursor} and restored.step == 3
    other, other_opt = _model_and_optimizer(98)
    other.load_state_dict(restored.state["model"])
    other_opt.load_state_dict(restored.state["optimizer"])
    set_rng_state(*restored.rng)
    _step(other, other_opt)
    for name, value in expected.items():
        torch.testing.assert_close(other.state_dict()[name], value, rtol=0, atol=0)
    assert checkpoint_model(data, record).keys() == model.state_dict().keys()


def test_only_the_last_checkpoints_are_kept_and_the_model_is_plain_safetensors(tmp_path):
    from safetensors.torch import load_file

    model, optimizer = _model_and_optimizer(2)
    for step in (10, 20, 30, 40):
        _save(tmp_path, step, model, optimizer)
    # the router last heard of step 20 (later records still wait for it): 20 stays
    assert [p.name for p in prune(tmp_path, {20})] == ["step-000000010.safetensors"]
    assert [p.name for p in prune(tmp_path, {40})] == ["step-000000020.safetensors"]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-000000030.safetensors",
        "step-000000040.safetensors",
    ]
    out = save_model(tmp_path, model, {"job": "j1"})
    assert load_file(out["path"]).keys() == model.state_dict().keys()


def test_a_changed_missing_or_foreign_checkpoint_is_refused(tmp_path):
    model, optimizer = _model_and_optimizer(3)
    record = _save(tmp_path, 1, model, optimizer)
    path = tmp_path / "step-000000001.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="sha256"):
        load_state(record, str(tmp_path))
    path.unlink()
    with pytest.raises(CheckpointError, match="cannot be read here"):
        load_state(record, str(tmp_path))
    # safetensors, but not a batchbus checkpoint (a model file handed over as one)
    foreign = save_safetensors({"w": torch.zeros(2)}, metadata={"batchbus": "something-else"})
    path.write_bytes(foreign)
    with pytest.raises(CheckpointError, match="not a batchbus checkpoint"):
        load_state({**record, "sha256": hashlib.sha256(foreign).hexdigest()}, str(tmp_path))
    path.write_bytes(data)
    # the built-in loop refuses a state that does not fit its model, naming it
    bigger = nn.Sequential(nn.Linear(6, 7))
    with pytest.raises(BadRequest, match="does not fit"):
        restore_into(bigger, torch.optim.Adam(bigger.parameters()), load_state(record, str(tmp_path)).state)
    # a record (it comes over the wire) naming a file outside this trainer's checkpoint_dir
    with pytest.raises(CheckpointError, match="not under this trainer's checkpoint_dir"):
        load_state({**record, "path": str(tmp_path / ".." / "elsewhere.safetensors")}, str(tmp_path))


def test_leases_lapse_into_the_queue_until_max_attempts_fails_the_job(tmp_path):
    store = JobStore(str(tmp_path / "jobs.db"))
    job = store.submit(JobSpec.from_dict({"dataset": "a", "max_attempts": 2}))
    claimed = store.claim("t1", lease_s=5)
    assert claimed["lease_expires"] > time.time() + 4 and claimed["checkpoint"] is None
    record = {"path": "/x/step-1", "sha256": "ab", "step": 7, "epoch": 0, "cursor": {"position": 56}}
    store.add_checkpoint(job, "t1", record)
    with pytest.raises(BadRequest, match="'step'"):
        store.add_checkpoint(job, "t1", {**record, "step": "7"})
    assert store.release(job, "lease lapsed", lost=True) == "queued"
    again = store.claim("t2", lease_s=5)
    assert again["checkpoint"]["step"] == 7 and again["failures"] == 1  # resumes from it
    assert store.get(job)["events"][-1]["reason"] == "assigned to t2 (resumes from step 7, in epoch 1)"  # from 1
    assert Cursor.of_checkpoint({"epoch": 2, "cursor": {"position": 0}}).shown() == "after epoch 2"  # a boundary
    assert store.release(job, "handed back", lost=False) == "queued"  # a hand-back is free
    store.claim("t3", lease_s=5)
    assert store.release(job, "lease lapsed again", lost=True) == "failed"
    info = store.get(job)
    assert info["state"] == "failed" and "gave up after 2 lost attempt(s)" in info["events"][-1]["reason"]
    store.reopen(job, "resumed by admin")
    assert store.get(job)["failures"] == 0 and store.get(job)["state"] == "queued"
    store.close()


def test_an_old_database_gets_the_new_columns(tmp_path):
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE jobs (id TEXT PRIMARY KEY, spec TEXT NOT NULL, state TEXT NOT NULL, "
        "priority INTEGER NOT NULL DEFAULT 0, trainer TEXT, attempts INTEGER NOT NULL DEFAULT 0, "
        "created REAL NOT NULL, updated REAL NOT NULL, progress TEXT, result TEXT, error TEXT);"
        "INSERT INTO jobs VALUES ('j1', '{\"dataset\": \"a\"}', 'queued', 0, NULL, 0, 1, 1, NULL, "
        "NULL, NULL);"
    )
    db.close()
    store = JobStore(str(path))
    assert store.claim("t1", lease_s=5)["id"] == "j1"
    assert store.get("j1")["failures"] == 0
    store.close()


def test_the_router_keeps_a_model_only_if_its_bytes_match_and_names_no_other_path(tmp_path):
    import hashlib

    from libbus.errors import NotFound
    from services.router.artifacts import Artifacts

    artifacts = Artifacts(str(tmp_path))
    data = b"weights"
    with pytest.raises(BadRequest, match="sha256"):
        artifacts.put("j0123456789", data, hashlib.sha256(b"other").hexdigest())
    with pytest.raises(NotFound):
        artifacts.get("j0123456789")
    artifacts.put("j0123456789", data, hashlib.sha256(data).hexdigest())
    assert artifacts.get("j0123456789") == data
    with pytest.raises(NotFound):
        artifacts.get("../../etc/passwd")


class _SlowLink:
    """The reporter's way to the router, as the trainer relays it: each request waits until ``go`` is set,
    as a delivery behind a loaded trainer does; what was sent is recorded, a checkpoint record with
    whether its file was there as it was sent."""

    def __init__(self, directory):
        self.directory = directory
        self.go = threading.Event()
        self.sent = []
        self.fatal = None

    def request(self, msg, timeout_s=10.0):
        if isinstance(msg, Checkpointed):
            name = msg.checkpoint["path"].rsplit("/", 1)[-1]
            self.sent.append((msg.checkpoint["step"], (self.directory / name).exists()))
        assert self.go.wait(60), "the test never let the delivery through"
        return Ok()


def test_a_checkpoint_record_waiting_to_be_sent_keeps_its_file(tmp_path):
    """A job checkpointing every few ms gets ahead of its reports: records wait behind a slow delivery.
    Pruning keeps the files of the records waiting to be sent, under the reporter's lock: every record
    the router takes names a file that is there (a trainer killed right after the router took one whose
    file was gone left its job nothing to resume from); once the router has a later one, they go."""
    model, optimizer = _model_and_optimizer(2)
    link = _SlowLink(tmp_path)
    reporter = Reporter(link, "j1", timeout_s=5.0)  # type: ignore[arg-type]  # a Link in all it uses
    try:
        reporter.put(Progress(job="j1", progress={"step": 0}))  # first in line, delivered slowly
        for step in (1, 2, 3, 4):
            record = _save(tmp_path, step, model, optimizer)
            reporter.put(Checkpointed(job="j1", checkpoint=dict(record)))
            reporter.prune_checkpoints(lambda held: prune(tmp_path, held))
        assert len(list(tmp_path.glob("step-*"))) == 4  # every record still waits: every file stays
        link.go.set()
        assert reporter.flush(60)
        assert link.sent == [(1, True), (2, True), (3, True), (4, True)]
        assert reporter.checkpoint_step == 4
        reporter.prune_checkpoints(lambda held: prune(tmp_path, held))
        assert sorted(p.name for p in tmp_path.glob("step-*")) == [
            "step-000000003.safetensors",
            "step-000000004.safetensors",
        ]
    finally:
        link.go.set()
        reporter.close()

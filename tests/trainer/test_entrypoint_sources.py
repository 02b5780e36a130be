"""What an entrypoint job starts from and reads: ``model_from`` (another job's model, within the
submitter's scope) as ``job.initial_model()`` — and for a built-in job, its first weights — and
``train_range`` (a record range of the train split, every sample of it once per epoch, none outside)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors

from libbus.errors import Forbidden
from libbus.wire.messages import GetModel, SubmitJob
from tests.support import wait_job

N = 48


@pytest.fixture
def ids(start_provider, tmp_path_factory):
    d = tmp_path_factory.mktemp("ids")
    for split, n in (("train", N), ("val", 6), ("test", 5)):
        i = np.arange(n)
        np.save(d / f"{split}_x.npy", np.stack([i, i % 3], axis=1).astype(np.float32))
        np.save(d / f"{split}_y.npy", (i % 2).astype(np.int64))
    return start_provider(f"ids=file://{d}", "other=mock://mnist?n=100")


def _model(admin, job: str) -> dict[str, torch.Tensor]:
    return load_safetensors(bytes(admin.request(GetModel(job=job)).frames[0]))


def test_train_range_reads_its_records_once_per_epoch_and_none_outside(router, ids, entry_trainer, client_for):
    admin = client_for(router.endpoint, role="admin")
    spec = {
        "dataset": "ids",
        "entrypoint": "tests.support.entrypoints:ids_seen",
        "train_range": [8, 40],
        "evaluate": False,
        "seed": 2,
    }
    info = wait_job(admin, admin.request(SubmitJob(spec=spec)).job, timeout=120)
    assert info["state"] == "succeeded", info["error"]
    seen = _model(admin, info["id"])
    for epoch in ("epoch0", "epoch1"):
        assert sorted(seen[epoch].tolist()) == list(range(8, 40))
    assert seen["epoch0"].tolist() != seen["epoch1"].tolist()  # shuffled anew each epoch


def test_a_job_starts_from_another_jobs_model_within_its_scope(router, ids, entry_trainer, client_for, make_token):
    admin = client_for(router.endpoint, role="admin")
    base = {"dataset": "ids", "entrypoint": "tests.support.entrypoints:constant", "evaluate": False}
    first = wait_job(admin, admin.request(SubmitJob(spec={**base, "params": {"value": 2.0}})).job, timeout=120)
    assert first["state"] == "succeeded", first["error"]
    second = wait_job(admin, admin.request(SubmitJob(spec={**base, "model_from": first["id"]})).job, timeout=120)
    assert second["state"] == "succeeded", second["error"]
    assert _model(admin, second["id"])["w"].tolist() == [3.0, 3.0, 3.0]
    # an admin limited to another dataset may not start from this one's model
    scoped = client_for(router.endpoint, role="admin", token=make_token("admin", datasets=["other"]))
    with pytest.raises(Forbidden):
        scoped.request(SubmitJob(spec={**base, "dataset": "other", "model_from": first["id"]}))


def test_a_built_in_job_starts_from_another_jobs_weights(router, ids, entry_trainer, client_for):
    admin = client_for(router.endpoint, role="admin")
    base = {
        "dataset": "other",
        "model": "mlp",
        "model_kwargs": {"hidden": 8},
        "epochs": 1,
        "evaluate": False,
        "optimizer": "sgd",
        "momentum": 0.0,
    }
    first = wait_job(admin, admin.request(SubmitJob(spec={**base, "seed": 1})).job, timeout=120)
    assert first["state"] == "succeeded", first["error"]
    # another seed (other initial weights), an lr that moves nothing: it ends where the first ended
    second = wait_job(
        admin,
        admin.request(SubmitJob(spec={**base, "seed": 9, "lr": 1e-30, "model_from": first["id"]})).job,
        timeout=120,
    )
    assert second["state"] == "succeeded", second["error"]
    ours, theirs = _model(admin, second["id"]), _model(admin, first["id"])
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


def test_an_entrypoint_jobs_model_is_scored_by_the_providers_evaluator(
    router, start_provider, entry_trainer, client_for
):
    """The function's own model, scored on the private test split by an evaluator the
    provider's operator installed; the score the router records is the provider's."""
    provider = start_provider("mnist=mock://mnist?n=600", evaluator_modules=["tests.support.evaluators"])
    admin = client_for(router.endpoint, role="admin", timeout_s=10)
    spec = {
        "dataset": "mnist",
        "entrypoint": "tests.support.entrypoints:linear_classifier",
        "evaluator": "tests.support.evaluators:linear",
        "batch_size": 32,
    }
    info = wait_job(admin, admin.request(SubmitJob(spec=spec)).job, timeout=120)
    assert info["state"] == "succeeded", info["error"]
    result = info["result"]
    assert result["test_provider"] == provider.service.name and result["test_n"] == 120
    assert result["test_accuracy"] > 0.5 and 0 <= result["test_metrics"]["top2"] <= 1
    assert provider.service.handler.served["mnist"]["evaluations"] == 1

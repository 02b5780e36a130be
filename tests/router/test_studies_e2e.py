"""Studies, early stopping, evaluation tasks and current models on a real router, provider and
trainer (threads, loopback sockets, SQLite): what a user sees through the admin messages."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch
from safetensors.torch import load as load_safetensors

from libbus.errors import BadRequest
from libbus.wire.messages import ControlJob, GetJob, GetStudy, ListJobs, Model, StopStudy, SubmitJob, SubmitStudy
from services.models import build_model, evaluate
from services.provider.sources import open_source
from tests.support import Cluster, wait_job, wait_study

BASE = {
    "dataset": "mnist",
    "model": "mlp",
    "model_kwargs": {"hidden": 32},
    "epochs": 2,
    "batch_size": 100,
    "evaluate": False,
    "optimizer": "sgd",
}


def test_study_runs_trials_as_jobs_and_names_the_best(router, provider, trainer, client_for):
    admin = client_for(router.endpoint, role="admin")
    raw = {
        "base": BASE,
        "space": {"lr": {"log_uniform": [1e-3, 0.5]}},
        "study": {"trials": 3, "concurrent": 2, "sampler": "random", "pruner": "median", "seed": 3},
    }
    study = admin.request(SubmitStudy(spec=raw)).study["id"]
    info = wait_study(admin, study)
    assert info["state"] == "complete"
    assert len(info["trials"]) == 3
    jobs = {j["id"]: j for j in admin.request(ListJobs()).jobs}
    for t in info["trials"]:
        assert t["state"] in ("complete", "pruned")
        job = jobs[t["job"]]  # an ordinary job, named after its trial, with the sampled parameters
        assert job["spec"]["name"] == f"{study}/{t['number']}"
        assert job["spec"]["lr"] == pytest.approx(t["params"]["lr"])
        if t["state"] == "complete":
            assert job["state"] == "succeeded"
            assert t["value"] == pytest.approx(job["result"]["val_accuracy"])
            assert sorted(t["reports"]) == ["1", "2"]  # the objective at each epoch
    done = [t for t in info["trials"] if t["state"] == "complete"]
    assert info["best"]["value"] == max(t["value"] for t in done)


def test_a_stopped_study_stops_its_running_trial_and_starts_no_more(router, provider, trainer, client_for):
    admin = client_for(router.endpoint, role="admin")
    raw = {
        "base": {**BASE, "epochs": 50},
        "space": {"lr": {"choice": [0.01, 0.02]}},
        "study": {"trials": 4, "concurrent": 1, "sampler": "random"},
    }
    study = admin.request(SubmitStudy(spec=raw)).study["id"]
    deadline = time.monotonic() + 30
    while True:  # wait until the first trial trains
        t0 = admin.request(GetStudy(study=study)).study["trials"][0]
        if admin.request(GetJob(job=t0["job"])).job["state"] == "running":
            break
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert admin.request(StopStudy(study=study)).detail["state"] == "stopped"
    info = wait_study(admin, study)
    assert info["state"] == "stopped"
    assert [t["state"] for t in info["trials"]] == ["stopped"]
    assert wait_job(admin, t0["job"], 20)["state"] == "stopped"
    with pytest.raises(BadRequest, match="already ended"):
        admin.request(StopStudy(study=study))


def test_bad_study_files_are_refused_and_the_router_serves_on(router, client_for):
    admin = client_for(router.endpoint, role="admin")
    bad = [
        ({"base": BASE, "space": {}}, "empty"),
        ({"base": BASE, "space": {"lr": {"uniform": [0.1, 0.01]}}}, "low < high"),
        ({"base": BASE, "space": {"lr": {"uniform": [0.01, 0.1]}}, "study": {"sampler": "bayes"}}, "sampler"),
        ({"base": BASE, "space": {"dataset": {"choice": ["a"]}}}, "cannot vary|not a job field"),
        ({"space": {"lr": {"uniform": [0.01, 0.1]}}}, r"\[base\]"),
        ({"base": BASE, "space": {"lr": {"uniform": [0.01, 0.1]}}, "study": {"sampler": "grid"}}, "grid"),
    ]
    for spec, match in bad:
        with pytest.raises(BadRequest, match=match):
            admin.request(SubmitStudy(spec=spec))
    assert admin.request(ListJobs()).jobs == []  # nothing was queued for a refused study


def test_early_stopping_stops_a_job_that_stopped_improving(router, provider, trainer, client_for):
    admin = client_for(router.endpoint, role="admin")
    # lr so small the loss cannot improve by min_delta: epoch 1 stays the best, and epoch 3 is the
    # second in a row without an improvement; the router decides at that epoch's report and the
    # trainer, waiting for that report's answer, trains no epoch past it (however loaded the machine)
    spec = {**BASE, "epochs": 40, "lr": 1e-9, "patience": 2, "min_delta": 0.5}
    job = admin.request(SubmitJob(spec=spec)).job
    info = wait_job(admin, job, 60)
    assert info["state"] == "stopped"
    decided = [e["reason"] for e in info["events"] if e["reason"].startswith("early stopping")]
    assert len(decided) == 1 and decided[0].startswith(
        "early stopping on val_loss at epoch 3: no improvement by more than 0.5 for 2 epoch(s) (patience 2); best "
    ), decided
    assert decided[0].endswith(" at epoch 1")
    assert [r["epoch"] for r in info["result"]["history"]] == [1, 2, 3]
    # no step of epoch 4 was trained: the stop's checkpoint is the one of epoch 3's end
    assert info["checkpoint"]["step"] == 3 * info["progress"]["steps_per_epoch"], (info["checkpoint"], info["progress"])


def _local_score(state: dict, split: str) -> tuple[float, float]:
    source = open_source("mock://mnist?n=600")
    info = {
        "sample_shape": list(source.sample_shape),
        "num_classes": source.num_classes,
        "kind": "image",
        "dtype": str(source.dtype),
    }
    model = build_model("mlp", info, {"hidden": 32})
    model.load_state_dict(state)
    n = source.num_samples(split)
    import numpy as np

    x, y = source.read(split, np.arange(n))
    loss, acc, _ = evaluate(model, [(torch.from_numpy(x), torch.from_numpy(y))])
    return loss, acc


def test_evaluation_tasks_match_a_local_scoring(router, provider, trainer, client_for, tmp_path):
    admin = client_for(router.endpoint, role="admin")
    trained = admin.request(SubmitJob(spec={**BASE, "epochs": 1, "lr": 0.05})).job
    assert wait_job(admin, trained, 60)["state"] == "succeeded"
    from libbus.wire.messages import GetModel

    blob = bytes(admin.request(GetModel(job=trained)).frames[0])
    state = load_safetensors(blob)
    for split in ("val", "test"):
        job = admin.request(
            SubmitJob(
                spec={"task": "evaluate", "dataset": "mnist", "model_from": trained, "split": split, "evaluate": False}
            )
        ).job
        result = wait_job(admin, job, 60)["result"]
        loss, acc = _local_score(state, split)
        assert result[f"{split}_accuracy"] == pytest.approx(acc, abs=1e-6)
        assert result[f"{split}_loss"] == pytest.approx(loss, rel=1e-4)
        assert result["model_sha256"] == hashlib.sha256(blob).hexdigest()
    # the same weights uploaded as a file: the task keeps them and scores them alike
    job = admin.request(
        SubmitJob(
            spec={
                "task": "evaluate",
                "dataset": "mnist",
                "model_from": "upload",
                "model": "mlp",
                "model_kwargs": {"hidden": 32},
                "split": "test",
                "evaluate": False,
            },
            frames=[blob],
        )
    ).job
    assert wait_job(admin, job, 60)["result"]["test_accuracy"] == pytest.approx(
        _local_score(state, "test")[1], abs=1e-6
    )
    with pytest.raises(BadRequest, match="succeeded job"):  # an evaluation task made no model to score
        admin.request(SubmitJob(spec={"task": "evaluate", "dataset": "mnist", "model_from": job, "split": "val"}))


def test_current_model_of_a_running_job(router, provider, trainer, client_for):
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={**BASE, "epochs": 200, "lr": 0.01})).job
    deadline = time.monotonic() + 30
    while (admin.request(GetJob(job=job)).job.get("progress") or {}).get("step", 0) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    reply = admin.request(ControlJob(job=job, command="model"), timeout_s=30)
    assert isinstance(reply, Model)
    data = bytes(reply.frames[0])
    assert hashlib.sha256(data).hexdigest() == reply.sha256 and reply.step >= 2
    assert set(load_safetensors(data)) == set(
        build_model("mlp", {"sample_shape": [1, 28, 28], "num_classes": 10}, {"hidden": 32}).state_dict()
    )
    admin.request(ControlJob(job=job, command="stop"))
    assert wait_job(admin, job, 30)["state"] == "stopped"


def test_pbt_member_adopts_a_better_members_checkpoint_and_explores(router, provider, trainer, client_for):
    """One trainer: trial 0 (lr 0.1) trains first; trial 1 (lr 1e-6) is the bottom member at the first
    epoch the router sees it report, copies trial 0's checkpoint through an `adopt` command and
    continues with its lr explored."""
    admin = client_for(router.endpoint, role="admin")
    raw = {
        "base": {**BASE, "epochs": 4, "batch_size": 25, "momentum": 0.0},
        "space": {"lr": {"choice": [1e-6, 0.1]}},
        "study": {"strategy": "pbt", "trials": 2, "concurrent": 2, "sampler": "grid", "seed": 0, "perturb": [2.0]},
    }
    info = wait_study(admin, admin.request(SubmitStudy(spec=raw)).study["id"])
    good, bad = info["trials"]
    events = [e["reason"] for e in admin.request(GetJob(job=bad["job"])).job["events"]]
    assert (good["params"]["lr"], good["state"], bad["state"]) == (0.1, "complete", "complete"), (info, events)
    assert any(r.startswith("pbt exploit at epoch ") and f"job {good['job']}" in r for r in events), events
    assert any(
        r.startswith("adopt acknowledged") and f"of job {good['job']}" in r and ": loaded step " in r for r in events
    ), "\n".join(events)
    # explore: the donor's lr doubled, which for a choice is the next value up (0.1 is the last one)
    assert any(r.startswith("pbt explore: lr 1e-06 -> 0.1") for r in events), events
    job = admin.request(GetJob(job=bad["job"])).job
    assert job["spec"]["lr"] == 0.1 == bad["params"]["lr"]  # applied live through `set`
    # with the good member's weights its second epoch scores like it, not like lr 1e-6 would
    assert bad["value"] > bad["reports"]["1"] + 0.2, (bad, events)


def test_a_router_killed_mid_study_comes_back_and_completes_it(tmp_path):
    """Real processes (`busctl start` router, provider, trainer): the router is killed -9 once a
    trial has ended and started again on its address; the study goes on from its rows."""
    cluster = Cluster(tmp_path, {"BATCHBUS_PROGRESS_INTERVAL_S": "0.5", "BATCHBUS_LEASE_S": "10"})
    killed = []
    try:
        endpoint = cluster.start_router()
        cluster.start("provider", "provider", "--dataset", "mnist=mock://mnist?n=600")
        cluster.start_trainer("trainer-0")
        raw = {
            "base": {**BASE, "epochs": 3},
            "space": {"lr": {"log_uniform": [1e-4, 0.3]}},
            "study": {"trials": 4, "concurrent": 1, "sampler": "random", "pruner": "asha", "seed": 2},
        }
        study = cluster.admin.request(SubmitStudy(spec=raw)).study["id"]
        deadline = time.monotonic() + 120
        while (info := cluster.admin.request(GetStudy(study=study)).study)["state"] == "running":
            assert time.monotonic() < deadline, f"study {study} did not finish\n{cluster.logs()}"
            if not killed and any(t["state"] in ("pruned", "complete") for t in info["trials"]):
                cluster.procs["router"].kill()
                cluster.procs["router"].wait()
                cluster.start_router(endpoint)
                killed.append(len(info["trials"]))
            time.sleep(0.5)
        assert killed, "the study ended before the router could be killed"
        assert info["state"] == "complete"
        assert [t["number"] for t in info["trials"]] == [0, 1, 2, 3]
        assert all(t["state"] in ("complete", "pruned") for t in info["trials"])
        jobs = [j for j in cluster.admin.request(ListJobs()).jobs if j["spec"]["name"].startswith(info["id"])]
        assert sorted(j["id"] for j in jobs) == sorted(t["job"] for t in info["trials"])  # one job per trial
    finally:
        cluster.close()

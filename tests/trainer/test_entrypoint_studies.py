"""Studies and early stopping on entrypoint jobs (router, provider and trainer services on threads,
each attempt in a child process): sampled values arrive in ``job.params``, and the pruner and early
stopping decide at the epoch's ``job.report``, deterministically."""

from __future__ import annotations

import pytest

from libbus.errors import BadRequest
from libbus.jobs.spec import JobSpec
from libbus.wire.messages import GetJob, ListJobs, SubmitJob, SubmitStudy
from services.router.early_stop import stop_epoch
from tests.support import wait_job, wait_study

BASE = {
    "dataset": "mnist",
    "entrypoint": "tests.support.entrypoints:parabola",
    "params": {"epochs": 4},
    "evaluate": False,
}


def test_a_study_of_eight_trials_over_an_entrypoint_prunes_and_names_the_best(
    router, provider, entry_trainer, client_for
):
    admin = client_for(router.endpoint, role="admin")
    raw = {
        "base": BASE,
        "space": {"params": {"x": {"uniform": [0.0, 1.0]}}},
        "study": {
            "trials": 8,
            "concurrent": 1,
            "sampler": "random",
            "pruner": "median",
            "seed": 4,
            "objective": "val_loss",
        },
    }
    study = admin.request(SubmitStudy(spec=raw)).study["id"]
    info = wait_study(admin, study, timeout=300)
    assert info["state"] == "complete"
    states = [t["state"] for t in info["trials"]]
    assert len(states) == 8 and "pruned" in states, states
    jobs = {j["id"]: j for j in admin.request(ListJobs(limit=100)).jobs}
    for t in info["trials"]:  # the sampled value is the function's job.params["x"]
        assert jobs[t["job"]]["spec"]["params"] == {"epochs": 4, "x": pytest.approx(t["params"]["params.x"])}
        if t["state"] == "pruned":  # stopped at the report the pruner judged: fewer than 4 epochs
            assert len(t["reports"]) < 4
    done = [t for t in info["trials"] if t["state"] == "complete"]
    best = min(done, key=lambda t: t["value"])
    assert info["best"]["number"] == best["number"]
    assert best["value"] == pytest.approx((best["params"]["params.x"] - 0.3) ** 2 + 0.25)


def test_early_stopping_ends_an_entrypoint_job_at_the_epoch_it_judged(router, provider, entry_trainer, client_for):
    admin = client_for(router.endpoint, role="admin")
    spec = {**BASE, "params": {"epochs": 12, "x": 5.0}, "patience": 2, "min_delta": 0.5}
    job = admin.request(SubmitJob(spec=spec)).job
    info = wait_job(admin, job, timeout=120)
    history = info["result"]["history"]
    # the rule, applied to the records the function reported, names the epoch; the job ended right there
    found = stop_epoch(history, JobSpec.from_dict(spec))
    assert found is not None and len(history) == found[0] < 12, history
    events = [e["reason"] for e in admin.request(GetJob(job=job)).job["events"]]
    assert any(f"early stopping on val_loss at epoch {found[0]}" in e for e in events), events


def test_a_study_space_names_params_only_of_an_entrypoint(router, client_for):
    admin = client_for(router.endpoint, role="admin")
    raw = {"base": {**BASE, "entrypoint": ""}, "space": {"params": {"x": {"uniform": [0.0, 1.0]}}}}
    with pytest.raises(BadRequest, match="params are an entrypoint's"):
        admin.request(SubmitStudy(spec={**raw, "study": {"trials": 2}}))


def test_pbt_over_an_entrypoint_adopts_a_better_members_state_through_checkpoint_and_restore(
    router, provider, entry_trainer, client_for
):
    """One trainer: trial 0 (rate 2) trains first; trial 1 (rate 0.5) is the bottom member at its first
    report, takes trial 0's latest state (its attempt ends there and the next restores it) and goes on
    with its rate explored."""
    admin = client_for(router.endpoint, role="admin")
    raw = {
        "base": {**BASE, "entrypoint": "tests.support.entrypoints:pbt_member", "params": {"epochs": 4}},
        "space": {"params": {"rate": {"choice": [0.5, 2.0]}}},
        "study": {
            "strategy": "pbt",
            "trials": 2,
            "concurrent": 2,
            "sampler": "grid",
            "seed": 0,
            "perturb": [2.0],
            "objective": "val_loss",
        },
    }
    info = wait_study(admin, admin.request(SubmitStudy(spec=raw)).study["id"], timeout=240)
    events_of = {
        t["number"]: [e["reason"] for e in admin.request(GetJob(job=t["job"])).job["events"]] for t in info["trials"]
    }
    bad = next(t for t in info["trials"] if any(r.startswith("pbt exploit") for r in events_of[t["number"]]))
    good = next(t for t in info["trials"] if t is not bad)
    assert (good["state"], bad["state"]) == ("complete", "complete"), info
    events = events_of[bad["number"]]
    assert any(r.startswith("pbt exploit at epoch 1") and f"job {good['job']}" in r for r in events), events
    assert any(r.startswith("pbt explore: params.rate 0.5 -> 2") for r in events), events
    job = admin.request(GetJob(job=bad["job"])).job
    assert job["spec"]["params"]["rate"] == 2.0
    # its second attempt began from trial 0's last state (w = 8 after 4 epochs of 2), at its own epoch 1
    history = job["result"]["history"]
    assert [r["epoch"] for r in history] == [1, 2, 3, 4]
    assert history[1]["val_loss"] == pytest.approx((8 + 2 - 20) ** 2)

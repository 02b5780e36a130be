"""Studies without sockets: the study file's checks, PBT's and early stopping's decisions, and the
executor (services/router/studies.py) driven over a real job database by hand-made trainer reports,
through a router restart."""

from __future__ import annotations

import math
import random
import time

import pytest

from libbus.errors import BadRequest, Unavailable
from libbus.jobs.spec import JobSpec
from services.router.early_stop import should_stop, stop_epoch
from services.router.pbt import decide, explore
from services.router.store import JobStore
from services.router.studies import Studies
from services.router.study_spec import Param, StudySpec, trial_spec

BASE = {"dataset": "mnist", "model": "mlp", "epochs": 4}
SPACE = {"lr": {"log_uniform": [1e-4, 1e-1]}}


def study(**settings) -> dict:
    return {"base": BASE, "space": SPACE, "study": settings}


@pytest.mark.parametrize(
    "raw, match",
    [
        ("not a table", "object"),
        ({"base": BASE}, r"\[space\] is empty"),
        ({"base": BASE, "space": {}}, r"\[space\] is empty"),
        ({"space": SPACE}, r"\[base\] is missing"),
        ({"base": {"model": "mlp"}, "space": SPACE}, r"\[base\]: job spec needs 'dataset'"),
        ({"base": BASE, "space": SPACE, "extra": {}}, "unknown table"),
        ({"base": BASE, "space": {"lr": {"normal": [0, 1]}}}, "unknown kind 'normal'"),
        ({"base": BASE, "space": {"lr": {"uniform": [1]}}}, r"\[low, high\]"),
        ({"base": BASE, "space": {"lr": {"log_uniform": [0, 1]}}}, "low > 0"),
        ({"base": BASE, "space": {"lr": {"uniform": [-1, 1]}}}, "does not make a valid job"),
        ({"base": BASE, "space": {"epochs": {"int": [1, 2.5]}}}, "whole bounds"),
        ({"base": BASE, "space": {"batch_size": {"uniform": [16, 64]}}}, "draws floats, but batch_size is int"),
        ({"base": BASE, "space": {"batch_size": {"choice": [32, 32]}}}, "twice"),
        ({"base": BASE, "space": {"colour": {"choice": ["red"]}}}, "not a job field"),
        ({"base": BASE, "space": {"dataset": {"choice": ["cifar"]}}}, "not a job field"),
        (study(sampler="bayes"), "sampler 'bayes' is unknown; expected one of random, grid, tpe"),
        (study(pruner="hyperband"), "pruner 'hyperband' is unknown"),
        (study(trials=0), "trials must be"),
        (study(trials="many"), "trials must be int"),
        (study(objective="accuracy"), "validation metric"),
        (study(sampler="grid"), "grid needs every"),
        (
            {"base": BASE, "space": {"lr": {"choice": [0.1, 0.2]}}, "study": {"sampler": "grid", "trials": 3}},
            "grid has 2 point",
        ),
        (study(colour=1), "unknown key"),
        (study(strategy="pbt", trials=4, concurrent=4, pruner="asha"), "leave pruner at none"),
        (study(strategy="pbt", trials=4, concurrent=2), "must equal trials"),
        (
            {
                "base": BASE,
                "space": {"batch_size": {"choice": [8, 16]}},
                "study": {"strategy": "pbt", "trials": 2, "concurrent": 2},
            },
            "hyper-parameters",
        ),
    ],
)
def test_a_wrong_study_is_refused_naming_what_is_wrong(raw, match):
    with pytest.raises(BadRequest, match=match):
        StudySpec.from_dict(raw)


def test_a_study_round_trips_and_knows_its_direction():
    spec = StudySpec.from_dict(
        study(objective="val_loss", sampler="grid", trials=2) | {"space": {"lr": {"choice": [0.1, 0.01]}}}
    )
    assert not spec.maximize
    assert StudySpec.from_dict(spec.to_dict()) == spec
    assert StudySpec.from_dict(study()).maximize  # val_accuracy by default


def test_a_trial_is_its_base_with_the_sampled_values_typed_and_checked():
    elastic = {"dataset": "mnist", "elastic": True, "min_world_size": 1, "max_world_size": 2}
    spec = StudySpec.from_dict({"base": elastic, "space": {"max_world_size": {"choice": [2, 4]}}})
    trial = trial_spec(spec.base, {"max_world_size": 4}, name="s1/0")
    # an elastic job's world_size is its max_world_size: it follows the sampled one
    assert (trial.world_size, trial.max_world_size, trial.name, trial.dataset) == (4, 4, "s1/0", "mnist")
    entry = {"dataset": "mnist", "entrypoint": "pkg.train:main", "params": {"lr": 0.1, "epochs": 3}}
    spec = StudySpec.from_dict({"base": entry, "space": {"params.lr": {"uniform": [0.01, 0.5]}}})
    assert trial_spec(spec.base, {"params.lr": 0.2}).params == {"lr": 0.2, "epochs": 3}  # the others kept
    assert spec.base.planned_epochs() == 3  # an entrypoint's epochs are its params' (the last ASHA rung)
    with pytest.raises(BadRequest, match="lr must be positive"):  # a combination no bound showed
        trial_spec(StudySpec.from_dict(study()).base, {"lr": -1.0})


def test_pbt_copies_a_top_member_into_a_bottom_one_only():
    scores = {0: 0.9, 1: 0.5, 2: 0.7, 3: 0.8}
    rng = random.Random(0)
    assert decide(1, 2, scores, interval=1, quantile=0.25, maximize=True, rng=rng) == 0
    assert decide(2, 2, scores, interval=1, quantile=0.25, maximize=True, rng=rng) is None  # middle: keeps going
    assert decide(0, 2, scores, interval=1, quantile=0.25, maximize=True, rng=rng) is None
    assert decide(0, 2, scores, interval=1, quantile=0.25, maximize=False, rng=rng) == 1  # losses: lower wins
    assert decide(1, 3, scores, interval=2, quantile=0.25, maximize=True, rng=rng) is None  # not at an interval
    assert decide(1, 2, {1: 0.5}, interval=1, quantile=0.25, maximize=True, rng=rng) is None  # alone


def test_pbt_explores_inside_the_space():
    space = {
        "lr": Param("lr", "log_uniform", (1e-3, 0.1)),
        "batch_size": Param("batch_size", "choice", (16, 32)),
        "momentum": Param("momentum", "choice", (0.5, 0.9, 0.99)),
    }
    out = explore({"lr": 0.09, "batch_size": 32, "momentum": 0.9}, space, [2.0], random.Random(1))
    assert out == {"lr": 0.1, "momentum": 0.99}  # clipped to the range; batch_size cannot change live
    assert explore({"lr": 0.01}, space, [0.5], random.Random(1)) == {"lr": 0.005}


@pytest.mark.parametrize(
    "values, patience, min_delta, maximize, stop",
    [
        ([1.0, 0.9, 0.8], 2, 0.0, False, False),
        ([1.0, 0.9, 0.9, 0.95], 2, 0.0, False, True),
        ([1.0, 0.95, 0.92], 2, 0.1, False, True),  # improving, but by less than min_delta
        ([0.5, 0.6, 0.6], 2, 0.0, True, False),
        ([0.5, 0.6, 0.6, 0.59], 2, 0.0, True, True),
        ([1.0, 0.5], 0, 0.0, False, False),  # patience 0: never
        ([float("nan")] * 3, 2, 0.0, False, True),  # diverged from the start
    ],
)
def test_early_stopping_decision(values, patience, min_delta, maximize, stop):
    assert (should_stop(values, patience=patience, min_delta=min_delta, maximize=maximize) is not None) == stop


def test_early_stopping_stops_at_the_first_epoch_out_of_patience_however_the_history_arrives():
    losses = [1.0, 0.8, 0.85, 0.7, 0.75, 0.72, 0.9]  # epoch 4 is the best; 5 and 6 do not beat it
    history = [{"epoch": e, "val_loss": v} for e, v in enumerate(losses, 1)]
    spec = JobSpec.from_dict({"dataset": "mnist", "patience": 2, "min_delta": 0.0})
    assert stop_epoch(history, spec)[0] == 6
    # the same answer from the whole history, or judged on from any epoch found not to stop it
    assert {stop_epoch(history, spec, after)[0] for after in range(6)} == {6}
    assert stop_epoch(history[:5], spec) is None
    # an epoch without the monitored metric changes nothing; a maximised metric counts up
    gappy = history[:4] + [{"epoch": 5}] + history[4:]
    assert stop_epoch(gappy, spec)[0] == 7
    accuracy = [{"epoch": e, "val_accuracy": v} for e, v in enumerate([0.5, 0.6, 0.6, 0.59], 1)]
    assert stop_epoch(accuracy, JobSpec.from_dict({"dataset": "mnist", "patience": 2, "monitor": "val_accuracy"})) == (
        4,
        "no improvement by more than 0 for 2 epoch(s) (patience 2); best 0.6000 at epoch 2",
    )


class FakeTrainers:
    """Stands in for trainers: claims the queued jobs and reports epochs whose score is the lr
    times the epoch, stopping when the router's stop command came."""

    def __init__(self, store: JobStore, score=lambda spec, epoch: min(1.0, spec["lr"] * 10 * epoch)):
        self.store = store
        self.score = score
        self.stops: list[str] = []
        self.refuse = False

    def control(self, by: str, job: str, command: str, args: dict):
        if self.refuse:
            raise Unavailable("trainer gone for a moment")
        assert command == "stop"
        self.stops.append(job)

    def epoch(self) -> None:
        while self.store.claim("t", 10):
            pass
        for job in self.store.held():
            if job["id"] in self.stops:
                self.store.finish(job["id"], "stopped", "stopped")
                continue
            history = (job["progress"] or {}).get("history", [])
            e = len(history) + 1
            history = history + [{"epoch": e, "val_accuracy": self.score(job["spec"], e)}]
            progress = {"history": history, "step": 10 * e, "steps_per_epoch": 10}
            if e == job["spec"]["epochs"]:
                self.store.finish(
                    job["id"], "succeeded", "done", result={**progress, "val_accuracy": history[-1]["val_accuracy"]}
                )
            else:
                self.store.set_progress(job["id"], progress, 10)


def test_asha_prunes_trials_and_a_restarted_router_finishes_the_study(tmp_path):
    store = JobStore(str(tmp_path / "jobs.db"))
    trainers = FakeTrainers(store)
    studies = Studies(store, trainers.control)
    sid = studies.submit(
        StudySpec.from_dict(study(trials=8, concurrent=2, sampler="random", pruner="asha", seed=1)), "admin"
    )
    assert [t["state"] for t in studies.show(sid)["trials"]] == ["running", "running"]
    for n in range(100):
        trainers.epoch()
        trainers.refuse = n == 3  # a stop that cannot be sent is sent at a later tick
        studies._last = 0
        studies.tick(time.time())
        if n == 6:  # the router restarts: a new executor over the same database
            studies = Studies(store, trainers.control)
        if studies.show(sid)["state"] != "running":
            break
    info = studies.show(sid)
    states = [t["state"] for t in info["trials"]]
    assert info["state"] == "complete" and len(states) == 8
    assert set(states) <= {"complete", "pruned"} and "pruned" in states
    for t in info["trials"]:
        job = store.get(t["job"])
        assert job["state"] == ("succeeded" if t["state"] == "complete" else "stopped")
        assert t["epochs"] == (4 if t["state"] == "complete" else len(t["reports"]))
    done = [t for t in info["trials"] if t["state"] == "complete"]
    assert info["best"]["value"] == max(t["value"] for t in done)
    assert info["epochs_trained"] < info["epochs_budget"] == 32
    assert len({t["job"] for t in info["trials"]}) == 8  # no trial got a second job across the restart
    # what ASHA ranks trials by (the rungs each passed) survives a rebuild, as Optuna recorded it
    rebuilt = Studies(store, trainers.control)._load(sid, studies.store.get(sid))
    for t, frozen in zip(info["trials"], rebuilt.study.trials):
        stored = studies.store.trials(sid)[t["number"]]["attrs"]
        assert "completed_rung_0" in stored
        assert {k: v for k, v in frozen.system_attrs.items() if k.startswith("completed_rung")} == stored


def _curve(spec: dict, epoch: int) -> float:
    """A learning curve: best near lr 0.03 with high momentum, rising with the epochs."""
    quality = math.exp(-((math.log10(spec["lr"]) + 1.5) ** 2) / 0.8) * (0.5 + 0.5 * spec["momentum"])
    return 0.1 + 0.85 * (1 - math.exp(-(0.3 + 2 * quality) * epoch)) * (0.3 + 0.7 * quality)


@pytest.mark.parametrize("seed", range(5))
def test_asha_trains_at_most_half_the_epochs_and_finds_a_top_trial(tmp_path, seed):
    """The target: a 12-trial TPE + ASHA study on two trainers trains at most half the epochs
    of running every trial to the end (Optuna's own asynchronous halving trained up to 72% here), and
    its best trial is among the three best of the twelve configurations it tried."""
    store = JobStore(str(tmp_path / "jobs.db"))
    trainers = FakeTrainers(store, _curve)
    studies = Studies(store, trainers.control)
    raw = {
        "base": {**BASE, "epochs": 6},
        "space": {"lr": {"log_uniform": [1e-4, 0.3]}, "momentum": {"uniform": [0.0, 0.95]}},
        "study": {"trials": 12, "concurrent": 2, "sampler": "tpe", "pruner": "asha", "reduction_factor": 3},
    }
    raw["study"]["seed"] = seed
    sid = studies.submit(StudySpec.from_dict(raw), "admin")
    for _ in range(200):
        trainers.epoch()
        studies._last = 0
        studies.tick(time.time())
        if studies.show(sid)["state"] != "running":
            break
    info = studies.show(sid)
    assert info["state"] == "complete" and len(info["trials"]) == 12
    assert info["epochs_trained"] <= info["epochs_budget"] / 2 == 36
    finals = sorted((_curve({**BASE, **t["params"]}, 6) for t in info["trials"]), reverse=True)
    assert info["best"]["value"] >= finals[2]


def test_a_stopped_study_stops_its_trials(tmp_path):
    store = JobStore(str(tmp_path / "jobs.db"))
    trainers = FakeTrainers(store)
    studies = Studies(store, trainers.control)
    sid = studies.submit(StudySpec.from_dict(study(trials=5, concurrent=2)), "admin")
    trainers.epoch()
    studies.stop(sid, "admin")
    with pytest.raises(BadRequest, match="already ended"):
        studies.stop(sid, "admin")
    for _ in range(3):
        trainers.epoch()
        studies._last = 0
        studies.tick(time.time())
    info = studies.show(sid)
    assert info["state"] == "stopped"
    assert [t["state"] for t in info["trials"]] == ["stopped", "stopped"]


def test_a_trial_whose_job_cannot_be_made_fails_alone(tmp_path):
    """A trial row whose parameters no longer make a valid job (written by another version, say)
    fails that trial; the study goes on with the next."""
    store = JobStore(str(tmp_path / "jobs.db"))
    trainers = FakeTrainers(store)
    studies = Studies(store, trainers.control)
    sid = studies.submit(StudySpec.from_dict(study(trials=3, concurrent=1, sampler="random")), "admin")
    studies.store.add_trial(sid, 1, {"lr": -1.0})  # as if asked before a restart, its job not yet made
    studies = Studies(store, trainers.control)
    for _ in range(12):
        trainers.epoch()
        studies._last = 0
        studies.tick(time.time())
    info = studies.show(sid)
    assert [t["state"] for t in info["trials"]][1] == "failed" and info["trials"][1]["job"] is None
    assert info["state"] == "complete" and len(info["trials"]) == 3

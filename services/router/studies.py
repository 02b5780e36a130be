"""Studies: the router runs hyper-parameter searches, with Optuna deciding and the router executing.

Optuna's ask-and-tell interface samples each trial's parameters and judges each epoch's validation
report (its pruners); the router does the rest with what a job already has: a trial is an ordinary
job (``STUDY/NUMBER`` by name), each epoch's validation metric is read from the job's progress, and
a trial the pruner gives up on is stopped through the normal command path (``stop``, as an admin
would; it checkpoints, and could be resumed by hand). ``strategy = "pbt"`` replaces pruning with
population-based training (:mod:`.pbt`): a bottom member takes a top member's latest checkpoint
(an ``adopt`` command) and perturbed hyper-parameters (a ``set``), each step an event of its job.

The study's truth is its rows (:mod:`.study_store`). The Optuna study lives in memory and is
rebuilt from them when the router starts: finished trials are added as they ended, running ones
asked again with their parameters and their reports replayed, so pruning goes on as before.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

import optuna  # with the router, not at its first study: the import's second would stall the serving loop

from libbus.errors import BadRequest, BusError
from libbus.jobs.commands import JobCommand
from libbus.jobs.spec import JobSpec
from libbus.jobs.state import JobState

from . import pbt
from .store import JobRow, JobStore
from .studies_halving import BudgetHalvingPruner
from .study_spec import StudySpec, trial_spec
from .study_store import TRIAL_ENDED, StudyRow, StudyState, StudyStore, TrialRow, TrialState

__all__ = [
    "Studies",
    "CHECK_S",
    "START_PER_STEP",
    "ShownTrial",
    "StudyStopped",
    "StudySummary",
    "StudyView",
    "stored_study",
]


class ShownTrial(TypedDict):
    """A trial as ``busctl study show`` and the web show it: its job, params, state, objective, epochs, and
    the objective reported at each epoch (keys: the epoch, as a string: JSON's)."""

    number: int
    job: str | None
    params: dict[str, Any]
    state: str
    value: float | None
    epochs: float
    reports: dict[str, float]


class StudyView(TypedDict):
    """A study as ``GetStudy`` answers it (``StudyInfo.study``): its row, its objective, its trials, the best."""

    id: str
    state: str
    reason: str
    created: float
    spec: dict[str, Any]
    objective: str
    direction: str
    trials: list[ShownTrial]
    best: ShownTrial | None
    epochs_trained: float
    epochs_budget: int | None


class StudySummary(TypedDict):
    """A study as ``ListStudies`` answers it (``StudyList.studies``, ``busctl studies``): its state, objective,
    best trial, epochs trained of its budget, when it was created, its trials counted by state, how many
    trials it runs in all, and its dataset."""

    id: str
    state: str
    objective: str
    best: ShownTrial | None
    epochs_trained: float
    epochs_budget: int | None
    created: float
    counts: dict[str, int]
    trials: int
    dataset: str


class StudyStopped(TypedDict):
    """``StopStudy``'s answer (``Ok.detail``)."""

    state: str
    study: str


log = logging.getLogger(__name__)

#: How often running trials' reports are read.
CHECK_S = 0.2
#: The most trials one step of a study starts (at its submission, then at each tick, every
#: ``CHECK_S``): sampling and queueing a trial costs the router's loop up to a few milliseconds
#: (TPE's more as trials accumulate), so a population of ``concurrent`` trials is queued in slices.
START_PER_STEP = 8
#: The most trials all studies together start at one tick.
START_PER_TICK = 16


@dataclass
class _Live:
    """A study's in-memory Optuna state: the study and its running trials by number."""

    spec: StudySpec
    study: optuna.Study
    trials: dict[int, optuna.trial.Trial] = field(default_factory=dict)


def _distributions(spec: StudySpec) -> dict:
    d = optuna.distributions
    out: dict[str, optuna.distributions.BaseDistribution] = {}
    for name, p in spec.space.items():
        if p.kind == "choice":
            out[name] = d.CategoricalDistribution(list(p.values))
        elif p.kind == "int":
            out[name] = d.IntDistribution(p.values[0], p.values[1])
        else:
            out[name] = d.FloatDistribution(float(p.values[0]), float(p.values[1]), log=p.kind == "log_uniform")
    return out


def _sampler(spec: StudySpec):
    samplers = optuna.samplers
    if spec.sampler == "grid":

        class Grid(optuna.samplers.GridSampler):
            def after_trial(self, *args) -> None:
                """GridSampler stops ``study.optimize`` once the grid is used up (``study.stop()``,
                which raises outside it); here the study's ``trials`` (at most the grid) end it."""

        return Grid({n: list(p.values) for n, p in spec.space.items()}, seed=spec.seed)
    if spec.sampler == "tpe":
        return samplers.TPESampler(seed=spec.seed, n_startup_trials=max(2, min(10, spec.trials // 3)))
    return samplers.RandomSampler(seed=spec.seed)


def _pruner(spec: StudySpec):
    pruners = optuna.pruners
    if spec.pruner == "median":
        return pruners.MedianPruner(n_startup_trials=min(spec.concurrent, 5), n_warmup_steps=spec.min_epochs - 1)
    if spec.pruner == "asha":
        return BudgetHalvingPruner(spec.min_epochs, spec.reduction_factor, spec.trials, spec.base.planned_epochs() or 0)
    if spec.pruner == "plateau":
        return pruners.PatientPruner(None, patience=spec.patience, min_delta=spec.min_delta)
    return pruners.NopPruner()


class Studies:
    """Runs every study in the job store's database.

    Args:
        jobs: the job store (trials are its jobs).
        control: ``control(by, job, command, args)``, the admin command path (JobControl.control).
    """

    def __init__(self, jobs: JobStore, control: Callable[[str, str, str, dict], object]):
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # its per-trial INFO lines; ours say more
        self.jobs = jobs
        self.store = StudyStore(jobs.db)
        self.control = control
        self._live: dict[str, _Live] = {}
        self._stop_sent: set[str] = set()
        #: Jobs of running trials: their progress reports are judged as they arrive (:meth:`on_report`).
        self._trial_jobs: dict[str, int] = {}  # job -> epochs judged
        self._last = 0.0

    # -- admin requests --------------------------------------------------------------------------
    def submit(self, spec: StudySpec, by: str) -> str:
        """Start ``spec`` (checked where it entered: the router's SubmitStudy); returns the study's id."""
        study = self.store.create(spec.to_dict())
        log.info(
            "study %s submitted by %s: %d trials, %s sampler, %s pruner, %s",
            study,
            by,
            spec.trials,
            spec.sampler,
            spec.pruner,
            spec.strategy,
        )
        self._step(study)
        return study

    def show(self, study: str) -> StudyView:
        """The study with its trials (each: number, job, params, state, value, epochs) and ``best``."""
        return self.read(study)[0]

    def read(self, study: str) -> tuple[StudyView, StudySpec]:
        """:meth:`show`'s record of the study, and its spec (parsed once, from the store)."""
        row = self.store.get(study)
        spec = stored_study(row)
        trials: list[ShownTrial] = [
            {
                "number": t["number"],
                "job": t["job"],
                "params": t["params"],
                "state": t["state"],
                "value": t["value"],
                "epochs": t["epochs"],
                "reports": {str(e): v for e, v in t["reports"].items()},
            }
            for t in row["trials"]
        ]
        done = [t for t in trials if t["state"] == TrialState.COMPLETE and t["value"] is not None]
        best = (max if spec.maximize else min)(done, key=lambda t: t["value"] or 0.0, default=None)  # none is None
        epochs = sum(t["epochs"] for t in trials)
        shown: StudyView = {
            "id": study,
            "state": row["state"],
            "reason": row["reason"],
            "created": row["created"],
            "spec": row["spec"],
            "objective": spec.objective,
            "direction": "maximize" if spec.maximize else "minimize",
            "trials": trials,
            "best": best,
            "epochs_trained": round(epochs, 2),
            "epochs_budget": _epochs_budget(spec.trials, spec.base),
        }
        return shown, spec

    def list(self) -> list[StudySummary]:
        out: list[StudySummary] = []
        for row in self.store.list():
            s, spec = self.read(row["id"])
            counts: dict[str, int] = {}
            for t in s["trials"]:
                counts[t["state"]] = counts.get(t["state"], 0) + 1
            out.append(
                {
                    "id": s["id"],
                    "state": s["state"],
                    "objective": s["objective"],
                    "best": s["best"],
                    "epochs_trained": s["epochs_trained"],
                    "epochs_budget": s["epochs_budget"],
                    "created": s["created"],
                    "counts": counts,
                    "trials": spec.trials,
                    "dataset": spec.base.dataset,
                }
            )
        return out

    def stop(self, study: str, by: str) -> StudyStopped:
        row = self.store.get(study)
        if row["state"] != StudyState.RUNNING:
            raise BadRequest(f"study {study} already ended ({row['state']})")
        self.store.set_state(study, StudyState.STOPPED, f"stopped by {by}")
        for t in row["trials"]:
            if TrialState(t["state"]).live and t["job"]:
                self._stop_job(t["job"], f"study {study} stopped by {by}")
        log.info("study %s stopped by %s", study, by)
        return {"state": StudyState.STOPPED, "study": study}

    # -- the executor ----------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Read new epoch reports, prune or exploit, tell Optuna of ended trials, start new ones."""
        if now - self._last < CHECK_S:
            return
        self._last = now
        rows = self.jobs.db.execute(
            "SELECT DISTINCT s.id FROM studies s LEFT JOIN trials t ON t.study = s.id "
            "WHERE s.state = ? OR t.state IN (?, ?)",
            (StudyState.RUNNING, TrialState.RUNNING, TrialState.PRUNING),
        ).fetchall()
        budget = START_PER_TICK  # trials started this tick, all studies together
        for (study,) in rows:
            try:
                budget -= self._step(study, budget)
            except BusError as err:  # one study's trouble must not stop the others (or the router)
                log.error("study %s: %s", study, err)

    def on_report(self, job: str, epochs: int) -> None:
        """A trial's trainer reported ``epochs`` epochs: judge a new one now, not at the next tick
        (the trainer trains on while the router decides)."""
        if self._trial_jobs.get(job, epochs) >= epochs:
            return
        found = self.jobs.db.execute("SELECT study, number FROM trials WHERE job = ?", (job,)).fetchone()
        if found is None:
            return
        row = self.store.get(found[0])
        t = next(t for t in row["trials"] if t["number"] == found[1])
        if TrialState(t["state"]).live:
            self._follow(found[0], self._load(found[0], row), t, row["state"])

    def _step(self, study: str, budget: int = START_PER_STEP) -> int:
        """Follow the study's live trials and start at most ``budget`` (and ``START_PER_STEP``) new
        ones; returns how many it started."""
        row = self.store.get(study)
        live = self._load(study, row)
        for t in row["trials"]:
            if TrialState(t["state"]).live:
                self._follow(study, live, t, row["state"])
        if row["state"] != StudyState.RUNNING:
            return 0
        trials = self.store.trials(study)
        active = sum(TrialState(t["state"]).live for t in trials)
        started = before = len(trials)
        # a slice per step: the rest start at the next ticks, so no request or tick holds the loop
        # (and a busy trainer's lease renewal) for a whole population's sampling and queueing
        for _ in range(min(live.spec.concurrent - active, live.spec.trials - started, START_PER_STEP, budget)):
            self._start_trial(study, live, started)
            started += 1
            active += 1
        if active == 0 and started >= live.spec.trials:
            self.store.set_state(study, StudyState.COMPLETE, f"{started} trials ended")
            self._live.pop(study, None)
            log.info("study %s complete", study)
        return started - before

    def _load(self, study: str, row: StudyRow) -> _Live:
        """The study's Optuna state, rebuilt from its rows the first time (a router that restarts)."""
        live = self._live.get(study)
        if live is not None:
            return live
        spec = stored_study(row)
        dists = _distributions(spec)
        study_obj = optuna.create_study(
            direction="maximize" if spec.maximize else "minimize", sampler=_sampler(spec), pruner=_pruner(spec)
        )
        live = _Live(spec, study_obj)
        for t in row["trials"]:
            params = {k: v for k, v in t["params"].items() if k in dists}
            try:
                self._rebuild_trial(live, t, params, dists)
            except ValueError as err:  # parameters outside the space (rows from another version)
                log.warning("study %s: trial %d does not fit the space (%s): failed", study, t["number"], err)
                if t["state"] not in TRIAL_ENDED:
                    self.store.update_trial(study, t["number"], state=TrialState.FAILED)
        self._live[study] = live
        return live

    @staticmethod
    def _rebuild_trial(live: _Live, t: TrialRow, params: dict, dists: dict) -> None:
        """Give the rebuilt Optuna study one trial as it ended, or as it stands (still running)."""
        study_obj, states = live.study, optuna.trial.TrialState
        if t["state"] in TRIAL_ENDED:
            state = {TrialState.COMPLETE: states.COMPLETE, TrialState.PRUNED: states.PRUNED}.get(
                TrialState(t["state"]), states.FAIL
            )
            study_obj.add_trial(
                optuna.trial.create_trial(
                    state=state,
                    params=params,
                    distributions={k: dists[k] for k in params},
                    value=t["value"] if state == states.COMPLETE else None,
                    intermediate_values=t["reports"],
                    system_attrs=t["attrs"],
                )
            )
            return
        for name, value in params.items():  # checked first: a trial asked and then refused stays open
            if not dists[name]._contains(dists[name].to_internal_repr(value)):
                raise ValueError(f"{name}={value!r} is outside {dists[name]}")
        study_obj.enqueue_trial(params, skip_if_exists=False)
        trial = study_obj.ask(dists)
        for key, value in t["attrs"].items():  # the rungs it passed, its grid point
            study_obj._storage.set_trial_system_attr(trial._trial_id, key, value)
        for epoch, value in sorted(t["reports"].items()):
            trial.report(value, epoch)
        live.trials[t["number"]] = trial

    def _start_trial(self, study: str, live: _Live, number: int) -> None:
        trial = live.study.ask(_distributions(live.spec))
        params = dict(trial.params)
        live.trials[number] = trial
        self.store.add_trial(study, number, params)
        self.store.update_trial(study, number, attrs=_attrs(live, trial))
        self._submit_job(study, live, number, params)

    def _submit_job(self, study: str, live: _Live, number: int, params: dict) -> str:
        name = f"{study}/{number}"
        # a router killed between the two writes left the job submitted: adopt it, not a second one
        row = self.jobs.db.execute("SELECT id FROM jobs WHERE json_extract(spec, '$.name') = ?", (name,)).fetchone()
        if row is None:
            try:
                spec = trial_spec(live.spec.base, params, name=name)
            except BadRequest as err:  # a combination no single bound showed: this trial fails, not the study
                log.warning("study %s: trial %d cannot run: %s", study, number, err)
                self.store.update_trial(study, number, state=TrialState.FAILED)
                trial = live.trials.pop(number, None)
                if trial is not None:
                    live.study.tell(trial, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
                return ""
        job = row[0] if row else self.jobs.submit(spec)
        self.store.update_trial(study, number, job=job)
        # known as a trial from now on: its first report is judged when it comes (on_report), not at
        # the next tick, by when a fast trial may have reported every epoch and be judged at its last
        self._trial_jobs.setdefault(job, 0)
        log.info("study %s: trial %d is job %s with %s", study, number, job, params)
        return job

    def _follow(self, study: str, live: _Live, t: TrialRow, study_state: str) -> None:
        number, spec = t["number"], live.spec
        if not t["job"]:
            self._submit_job(study, live, number, t["params"])
            return
        job = self.jobs.get(t["job"], events=False)
        progress = job["progress"] or {}
        history = progress.get("history") or (job["result"] or {}).get("history") or []
        reports = dict(t["reports"])
        trial = live.trials.get(number)
        new = [
            (int(r["epoch"]), float(r[spec.objective]))
            for r in history
            if isinstance(r.get(spec.objective), (int, float))
            and math.isfinite(r[spec.objective])
            and isinstance(r.get("epoch"), int)
            and int(r["epoch"]) not in reports
        ]
        for epoch, value in new:
            reports[epoch] = value
            if trial is not None:  # registered when it started or the study was restored
                trial.report(value, epoch)
        self._trial_jobs[t["job"]] = len(history)
        epochs = _epochs_trained(job, len(history))
        if new or epochs != t["epochs"]:
            self.store.update_trial(study, number, reports=reports, epochs=epochs)
        # judged even when the job has just ended: ASHA records the rungs a trial passed (system
        # attributes the other trials are ranked against), kept for a router that restarts
        prune = (
            bool(new)
            and spec.strategy == "search"
            and t["state"] == TrialState.RUNNING
            and trial is not None
            and trial.should_prune()
        )
        if new and spec.strategy == "search":
            attrs = _attrs(live, trial)
            if attrs != t["attrs"]:
                self.store.update_trial(study, number, attrs=attrs)
        if JobState(job["state"]).terminal:
            self._ended(study, live, t, job, reports, study_state)
            return
        if t["state"] == TrialState.PRUNING or study_state != StudyState.RUNNING:
            if t["job"] not in self._stop_sent:  # a stop that could not be sent yet (or before a restart)
                self._stop_job(
                    t["job"],
                    f"study {study}: {TrialState.PRUNED if study_state == StudyState.RUNNING else StudyState.STOPPED}",
                )
            return
        if not new:
            return
        if spec.strategy == "pbt":
            self._exploit(study, live, number, job, new[-1][0])
            return
        if prune:
            epoch, value = new[-1]
            self.store.update_trial(study, number, state=TrialState.PRUNING)
            self.jobs.event(
                t["job"], f"pruned by study {study} ({spec.pruner}) after epoch {epoch}: {spec.objective} {value:.4f}"
            )
            self._stop_job(t["job"], f"study {study}: pruned")

    def _ended(self, study: str, live: _Live, t: TrialRow, job: JobRow, reports: dict, study_state: str) -> None:
        states = optuna.trial.TrialState
        spec, number = live.spec, t["number"]
        trial = live.trials.pop(number, None)
        self._trial_jobs.pop(job["id"], None)  # the trial's job
        result = job["result"] or {}
        value = result.get(spec.objective)
        if value is None and reports:
            value = reports[max(reports)]
        if job["state"] == JobState.SUCCEEDED and isinstance(value, (int, float)) and math.isfinite(value):
            state, told = TrialState.COMPLETE, states.COMPLETE
        elif job["state"] == JobState.STOPPED and t["state"] == TrialState.PRUNING:
            state, told, value = TrialState.PRUNED, states.PRUNED, None
        elif job["state"] == JobState.STOPPED and _early_stopped(self.jobs, job["id"]) and value is not None:
            state, told = TrialState.COMPLETE, states.COMPLETE  # its own patience ended it: a finished trial
        else:
            state, told, value = (
                (TrialState.STOPPED if job["state"] == JobState.STOPPED else TrialState.FAILED),
                states.FAIL,
                None,
            )
        if trial is not None:
            live.study.tell(trial, value if told == states.COMPLETE else None, state=told, skip_if_finished=True)
        self.store.update_trial(study, number, state=state, value=value)
        self._stop_sent.discard(t["job"])
        log.info(
            "study %s: trial %d (job %s) %s%s",
            study,
            number,
            t["job"],
            state,
            f", {spec.objective} {value:.4f}" if value is not None else "",
        )

    def _stop_job(self, job: str, why: str) -> None:
        try:
            self.control(why, job, JobCommand.STOP, {})
        except BusError as err:  # a trainer absent for a moment: the next tick tries again
            log.info("job %s: stop not sent yet (%s)", job, err)
            return
        self._stop_sent.add(job)

    # -- population-based training ---------------------------------------------------------------
    def _exploit(self, study: str, live: _Live, number: int, job: JobRow, epoch: int) -> None:
        spec = live.spec
        last = spec.base.planned_epochs()
        if last is not None and epoch >= last:
            return  # its last epoch: nothing left to train with another member's weights
        trials = self.store.trials(study)
        scores = {t["number"]: t["reports"][epoch] for t in trials if epoch in t["reports"]}
        rng = random.Random(f"{spec.seed}/{study}/{number}/{epoch}")
        donor = pbt.decide(
            number, epoch, scores, interval=spec.interval, quantile=spec.quantile, maximize=spec.maximize, rng=rng
        )
        if donor is None:
            return
        source = next(t for t in trials if t["number"] == donor)
        ckpt = self.jobs.get(source["job"], events=False)["checkpoint"] if source["job"] else None
        if ckpt is None:
            return
        params = pbt.explore({**source["params"]}, spec.space, spec.perturb, rng)
        adopt = (JobCommand.ADOPT, {"checkpoint": ckpt, "from": source["job"]})
        steps = [adopt, (JobCommand.SET, params)]
        if spec.base.entrypoint:  # its attempt ends at the adopt (it resumes from it): set first
            steps.reverse()
        try:
            for command, args in steps:
                self.control(f"study {study} (pbt)", job["id"], command, args)
        except BusError as err:
            self.jobs.event(job["id"], f"pbt: could not exploit trial {donor}: {err}")
            return
        mine = next(t for t in trials if t["number"] == number)
        self.jobs.event(
            job["id"],
            f"pbt exploit at epoch {epoch}: {spec.objective} {scores[number]:.4f} is in the "
            f"bottom {spec.quantile:g}; copies trial {donor} (job {source['job']}, "
            f"{scores[donor]:.4f}) from its checkpoint at step {ckpt['step']}",
        )
        self.jobs.event(
            job["id"],
            "pbt explore: "
            + ", ".join(
                f"{k} {mine['params'].get(k)} -> {v:.6g}" if isinstance(v, float) else f"{k} -> {v}"
                for k, v in params.items()
            ),
        )
        self.store.update_trial(study, number, params={**mine["params"], **params})


def _attrs(live: _Live, trial) -> dict:
    """Optuna's system attributes of a running trial, but the parameters an enqueued trial was given."""
    attrs = live.study._storage.get_trial_system_attrs(trial._trial_id)
    return {k: v for k, v in attrs.items() if k != "fixed_params"}


def _epochs_budget(trials: int, base: JobSpec) -> int | None:
    """Epochs the study trains if every trial runs to its end (:meth:`JobSpec.planned_epochs`);
    ``None`` when an entrypoint names none."""
    epochs = base.planned_epochs()
    return None if epochs is None else trials * epochs


def stored_study(row: StudyRow) -> StudySpec:
    """A stored study's spec, typed: the one place the router parses a study it wrote (each was checked
    with :meth:`StudySpec.from_dict` where it entered, at SubmitStudy)."""
    return StudySpec.from_dict(row["spec"])


def _epochs_trained(job: JobRow, reported: int) -> float:
    """Epochs of training the job did (a fraction for a partial one): its last step (the last
    report's, the result's, or a stopped job's final checkpoint's) over its steps per epoch, which a
    progress report says (a succeeded job's result is its last report; a checkpoint record has none)."""
    reports = [job["progress"] or {}, job["result"] or {}]
    per = next((r["steps_per_epoch"] for r in reports if isinstance(r.get("steps_per_epoch"), int)), 0)
    steps = [r["step"] for r in reports if isinstance(r.get("step"), int)]
    if job["checkpoint"] is not None:
        steps.append(job["checkpoint"]["step"])
    if per > 0 and steps:
        return round(max(steps) / per, 2)
    return float(reported)


def _early_stopped(jobs: JobStore, job: str) -> bool:
    return any(e["reason"].startswith("early stopping") for e in jobs.get(job)["events"])

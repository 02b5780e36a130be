"""ASHA that keeps to its budget when trials are few and trainers fewer.

Optuna's asynchronous successive halving (:class:`~optuna.pruners.SuccessiveHalvingPruner`)
promotes a trial that leads its rung however few others have reached it: the first trials of a
study on two trainers, and every trial once the sampler has found a good region, run on. A
12-trial study of 6 epochs trained 42-62% of the epochs of running every trial to the end. This
pruner keeps its rungs (epochs ``min_epochs * reduction_factor**k``) and its ranking (a trial goes
on past a rung if it is within the top ``1/reduction_factor`` of the values reported there, or the
best while fewer have reported), and adds two rules, decided when an epoch's report arrives (no
trial is held waiting, so no trainer idles):

- **re-judged promotions**: at every report a running trial must still rank within the top
  ``1/reduction_factor`` of each rung it passed, among all values reported there by now; one
  promoted early on few reports is pruned as soon as enough better ones arrive;
- **a quota per rung**: at most ``ceil(trials / reduction_factor**(k+1)) + 2`` trials ever go on
  past rung ``k`` — what synchronous halving would promote, and two spare places, so that a good
  trial arriving after early ones took places still finds room. It bounds the epochs outright:
  for 12 trials of 6 epochs with a reduction factor of 3 (rungs at epochs 1 and 3), at most
  12 x 1 + 6 x 2 + 4 x 3 = 36 of 72 epochs (50%), plus the part of an epoch each pruned trial
  trains before its stop arrives; in practice fewer, as re-judged trials stop early.

A report of the trial's last epoch is never pruned: the work is done, and pruning it would only
throw its result away.

A simulation of the benchmark's study (12 trials, two trainers, TPE, 20 seeds) and the benchmark
itself chose these over alternatives: pruning the first trials until the first rung is full kept
the budget lower but lost the best trial, and could prune every trial of a small study; a quota of
exactly what synchronous halving promotes (or half again as much) lost the best trial in 2 of 5
seeds of the test; one that gives back the places of trials pruned later let the budget pass half.

The rung values are kept where Optuna keeps them (``completed_rung_K`` system attributes), which
the router stores with each trial, so the rules hold across a router restart.
"""

from __future__ import annotations

import math

import optuna
from optuna.pruners import BasePruner

__all__ = ["BudgetHalvingPruner", "SPARE_PLACES"]

#: Places past a rung beyond those synchronous successive halving would give.
SPARE_PLACES = 2


def _rung_key(rung: int) -> str:
    return f"completed_rung_{rung}"


class BudgetHalvingPruner(BasePruner):
    """Successive halving with re-judged promotions and a quota per rung."""

    def __init__(self, min_resource: int, reduction_factor: int, trials: int, last_epoch: int = 0):
        self.min_epochs = min_resource
        self.factor = reduction_factor
        self.trials = trials
        self.last_epoch = last_epoch

    def quota(self, rung: int) -> int:
        """How many trials may ever go on past ``rung``."""
        return math.ceil(self.trials / self.factor ** (rung + 1)) + SPARE_PLACES

    def prune(self, study: optuna.study.Study, trial: optuna.trial.FrozenTrial) -> bool:
        step = trial.last_step
        if step is None or (self.last_epoch and step >= self.last_epoch):
            return False
        value = trial.intermediate_values[step]
        if math.isnan(value):
            return True
        attrs = study._storage.get_trial_system_attrs(trial._trial_id)
        others = [t for t in study.get_trials(deepcopy=False) if t._trial_id != trial._trial_id]
        maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
        rung = 0
        while self.min_epochs * self.factor**rung <= step:
            key = _rung_key(rung)
            if key not in attrs:  # it reaches this rung now: its value there, as Optuna records it
                study._storage.set_trial_system_attr(trial._trial_id, key, value)
                attrs[key] = value
            if self._out(rung, attrs[key], step, others, maximize):
                return True
            rung += 1
        return False

    def _out(self, rung: int, value: float, step: int, others: list, maximize: bool) -> bool:
        key = _rung_key(rung)
        there = [t for t in others if key in t.system_attrs]
        places = max(1, (len(there) + 1) // self.factor)
        better = sum(1 for t in there if (t.system_attrs[key] > value if maximize else t.system_attrs[key] < value))
        if better >= places:
            return True
        promoted_at = self.min_epochs * self.factor**rung
        if step == promoted_at:  # going on past this rung right now: is there room?
            went_on = sum(1 for t in there if (t.last_step or 0) > promoted_at)
            return went_on >= self.quota(rung)
        return False

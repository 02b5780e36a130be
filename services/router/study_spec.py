"""A study file, checked once: the ``[base]`` job spec, the ``[space]`` of parameters, the ``[study]``
settings (:class:`StudySpec`). No Optuna here: what is allowed and why is read in one place, and
``busctl study submit`` refuses a wrong file with the same message the router would give.

```toml
[base]                          # a job spec: the same fields as a job file
dataset = "mnist"
model = "mlp"
epochs = 6
[space]                         # each a job field: one of the four kinds below
lr = { log_uniform = [1e-4, 1e-1] }
momentum = { uniform = [0.5, 0.99] }
batch_size = { choice = [32, 64, 128] }
seed = { int = [0, 9] }
[study]
trials = 16
concurrent = 4
objective = "val_accuracy"      # maximised; val_loss (and any other val_ metric but accuracy) minimised
sampler = "tpe"                 # random | grid | tpe
pruner = "asha"                 # none | median | asha | plateau
```
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from libbus.errors import BadRequest
from libbus.jobs.spec import SETTABLE, JobSpec

__all__ = [
    "SAMPLERS",
    "PRUNERS",
    "STRATEGIES",
    "KINDS",
    "MAX_TRIALS",
    "MAX_CONCURRENT",
    "Param",
    "StudySpec",
    "trial_spec",
]


def trial_spec(base: JobSpec, values: dict, **fixed: Any) -> JobSpec:
    """The job spec of a trial: ``base`` with the sampled ``values`` (``params.NAME`` ones go into
    its ``params``) and the ``fixed`` fields (its ``name``), checked as a submitted spec is.

    Raises:
        BadRequest: the values do not make a valid job (naming the field).
    """
    params = {k.removeprefix(PARAMS): v for k, v in values.items() if k.startswith(PARAMS)}
    fields = {k: v for k, v in values.items() if not k.startswith(PARAMS)}
    if params:
        fields["params"] = {**base.params, **params}
    return base.updated(**fields, **fixed)


def _prefixed(table: dict) -> dict:
    return {f"{PARAMS}{k}": v for k, v in table.items()}


SAMPLERS = ("random", "grid", "tpe")
PRUNERS = ("none", "median", "asha", "plateau")
STRATEGIES = ("search", "pbt")
#: How a ``[space]`` entry draws its values.
KINDS = ("log_uniform", "uniform", "int", "choice")
#: Job fields a study may not vary: they say what the trials are, not how they train.
#: A ``[space]`` entry named ``params.NAME`` varies an entrypoint job's ``params[NAME]``.
PARAMS = "params."
FIXED = ("dataset", "name", "world_size", "task", "model_from", "split")
#: The most trials one study may run: each is a job row with its events and reports, and TPE
#: samples each trial in time that grows with the trials before it.
MAX_TRIALS = 1000
#: The most trials of one study that run at once (each holds a trainer; a PBT population is this
#: large at most). They are queued a few at a time (services/router/studies.py ``START_PER_STEP``).
MAX_CONCURRENT = 64
#: ``[study]`` keys and their defaults.
STUDY_KEYS = {
    "trials": 10,
    "concurrent": 2,
    "objective": "val_accuracy",
    "sampler": "tpe",
    "pruner": "none",
    "seed": 0,
    "strategy": "search",
    "min_epochs": 1,
    "reduction_factor": 4,
    "patience": 2,
    "min_delta": 0.0,
    "interval": 1,
    "quantile": 0.25,
    "perturb": [0.8, 1.25],
}


@dataclass(frozen=True)
class Param:
    """One ``[space]`` entry: ``kind`` (log_uniform, uniform, int, choice) and its ``values`` (the
    bounds ``[low, high]``, or the choices)."""

    name: str
    kind: str
    values: tuple

    @classmethod
    def parse(cls, name: str, raw) -> Param:
        where = f"[space] {name}"
        if not isinstance(raw, dict) or len(raw) != 1:
            raise BadRequest(f"{where}: expected one of {{ {' | '.join(f'{k} = [...]' for k in KINDS)} }}, got {raw!r}")
        ((kind, values),) = raw.items()
        if kind not in KINDS:
            raise BadRequest(f"{where}: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
        if not isinstance(values, list) or not values:
            raise BadRequest(f"{where}: {kind} needs a non-empty list, got {values!r}")
        if kind == "choice":
            if len(set(map(repr, values))) != len(values):
                raise BadRequest(f"{where}: choice lists a value twice: {values!r}")
            return cls(name, kind, tuple(values))
        if len(values) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise BadRequest(f"{where}: {kind} needs [low, high] numbers, got {values!r}")
        low, high = values
        if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
            raise BadRequest(f"{where}: {kind} needs low < high, got {values!r}")
        if kind == "log_uniform" and low <= 0:
            raise BadRequest(f"{where}: log_uniform needs low > 0, got {low!r}")
        if kind == "int" and not all(isinstance(v, int) for v in values):
            raise BadRequest(f"{where}: int needs whole bounds, got {values!r}")
        return cls(name, kind, (low, high))


@dataclass
class StudySpec:
    """A checked study. ``base`` is the job spec every trial starts from;
    ``space`` the parameters varied; the rest are ``[study]`` settings (see the module docstring and
    docs/operations.md §Studies)."""

    base: JobSpec
    space: dict[str, Param]
    trials: int = 10
    concurrent: int = 2
    objective: str = "val_accuracy"
    sampler: str = "tpe"
    pruner: str = "none"
    seed: int = 0
    strategy: str = "search"
    min_epochs: int = 1
    reduction_factor: int = 4
    patience: int = 2
    min_delta: float = 0.0
    interval: int = 1
    quantile: float = 0.25
    perturb: list = field(default_factory=lambda: [0.8, 1.25])

    @property
    def maximize(self) -> bool:
        return "accuracy" in self.objective

    @classmethod
    def from_dict(cls, raw) -> StudySpec:
        """Check a study (the file's three tables as a dict); raises :class:`BadRequest` naming the
        table and key that are wrong."""
        if not isinstance(raw, dict):
            raise BadRequest("a study must be an object with [base], [space] and [study] tables")
        extra = sorted(set(raw) - {"base", "space", "study"})
        if extra:
            raise BadRequest(f"unknown table(s) {', '.join(extra)}; a study file has [base], [space] and [study]")
        base, space, settings = raw.get("base"), raw.get("space"), raw.get("study", {})
        if not isinstance(base, dict):
            raise BadRequest("[base] is missing: the job spec every trial starts from (dataset = ... at least)")
        if not isinstance(space, dict) or not space:
            raise BadRequest(
                "[space] is empty: name at least one job field to vary, e.g. lr = { log_uniform = [1e-4, 1e-1] }"
            )
        if not isinstance(settings, dict):
            raise BadRequest("[study] must be a table")
        try:
            job = JobSpec.from_dict(base)  # a study's [base] enters with it: parsed here, typed from here on
        except BadRequest as err:
            raise BadRequest(f"[base]: {err}") from err
        if isinstance(space.get("params"), dict):  # [space.params] lr = {...}: the entrypoint's params
            space = {**{k: v for k, v in space.items() if k != "params"}, **_prefixed(space["params"])}
        params = {name: Param.parse(name, value) for name, value in space.items()}
        known = {f.name: f for f in dataclasses.fields(JobSpec)}
        for name, param in params.items():
            if name.startswith(PARAMS):  # an entrypoint's parameter: any plain value its function reads
                if not job.entrypoint:
                    raise BadRequest(f"[space] {name}: params are an entrypoint's; [base] names no entrypoint")
                for value in param.values:
                    try:
                        trial_spec(job, {name: value})
                    except BadRequest as err:
                        raise BadRequest(f"[space] {name}: {value!r} does not make a valid job: {err}") from err
                continue
            if name not in known or name in FIXED:
                varied = ", ".join(k for k in known if k not in FIXED)
                raise BadRequest(f"[space] {name}: not a job field a study can vary; fields: {varied}")
            default = known[name].default
            if param.kind in ("uniform", "log_uniform") and type(default) is not float:
                raise BadRequest(
                    f"[space] {name}: {param.kind} draws floats, but {name} is "
                    f"{type(default).__name__ if default is not dataclasses.MISSING else 'not a number'}"
                    f"; use int = [low, high] or choice = [...]"
                )
            for value in param.values:  # every bound or choice must make a valid job
                try:
                    trial_spec(job, {name: value})
                except BadRequest as err:
                    raise BadRequest(f"[space] {name}: {value!r} does not make a valid job: {err}") from err
        unknown = sorted(set(settings) - set(STUDY_KEYS))
        if unknown:
            raise BadRequest(f"[study]: unknown key(s) {', '.join(unknown)}; known: {', '.join(STUDY_KEYS)}")
        values: dict[str, Any] = {}
        for key, default in STUDY_KEYS.items():
            value = settings.get(key, default)
            want = type(default)
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise BadRequest(f"[study] {key} must be {want.__name__}, got {value!r}")
            values[key] = value
        spec = cls(base=job, space=params, **values)
        spec._check(known)
        return spec

    def _check(self, known: dict) -> None:
        def choose(key: str, options: tuple) -> None:
            if getattr(self, key) not in options:
                raise BadRequest(
                    f"[study] {key} {getattr(self, key)!r} is unknown; expected one of {', '.join(options)}"
                )

        choose("sampler", SAMPLERS)
        choose("pruner", PRUNERS)
        choose("strategy", STRATEGIES)
        if not 1 <= self.trials <= MAX_TRIALS:
            raise BadRequest(f"[study] trials must be 1 to {MAX_TRIALS}, got {self.trials}")
        if not 1 <= self.concurrent <= MAX_CONCURRENT:
            raise BadRequest(f"[study] concurrent must be 1 to {MAX_CONCURRENT}, got {self.concurrent}")
        if not self.objective.startswith("val_"):
            raise BadRequest(
                f"[study] objective must be a validation metric a trainer reports each epoch "
                f"(val_accuracy, val_loss, val_perplexity), got {self.objective!r}"
            )
        for key in ("min_epochs", "reduction_factor", "patience", "interval"):
            if getattr(self, key) < (2 if key == "reduction_factor" else 1):
                raise BadRequest(f"[study] {key} is too small: {getattr(self, key)}")
        if self.sampler == "grid":
            ranged = [p.name for p in self.space.values() if p.kind != "choice"]
            if ranged:
                raise BadRequest(
                    f"[study] sampler grid needs every [space] entry as choice = [...]; "
                    f"{', '.join(ranged)} {'is' if len(ranged) == 1 else 'are'} a range"
                )
            points = math.prod(len(p.values) for p in self.space.values())
            if self.trials > points:
                raise BadRequest(
                    f"[study] sampler grid has {points} point(s) and tries each once: trials must be "
                    f"at most {points}, got {self.trials}"
                )
        if self.strategy == "pbt":
            self._check_pbt()

    def _check_pbt(self) -> None:
        if not 0 < self.quantile <= 0.5:
            raise BadRequest(f"[study] quantile must be above 0 and at most 0.5, got {self.quantile}")
        if len(self.perturb) < 1 or not all(
            isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in self.perturb
        ):
            raise BadRequest(f"[study] perturb must list positive factors, e.g. [0.8, 1.25], got {self.perturb!r}")
        entry = bool(self.base.entrypoint)  # an entrypoint's params are all settable
        live = [name for name in self.space if name in SETTABLE or (entry and name.startswith(PARAMS))]
        if not live:
            raise BadRequest(
                f"[study] strategy pbt perturbs hyper-parameters a running job can change "
                f"({', '.join(SETTABLE)}); [space] has none of them"
            )
        if self.pruner != "none":
            raise BadRequest(
                "[study] strategy pbt replaces bad trials' weights instead of pruning them: leave pruner at none"
            )
        if self.concurrent < self.trials:
            raise BadRequest(
                f"[study] strategy pbt trains its whole population at once: concurrent "
                f"({self.concurrent}) must equal trials ({self.trials})"
            )
        if self.trials < 2:
            raise BadRequest("[study] strategy pbt needs a population of at least 2 trials")

    def to_dict(self) -> dict:
        """The study as :meth:`from_dict` takes it (``[base]`` with every job field, as a job's stored spec)."""
        settings = {k: getattr(self, k) for k in STUDY_KEYS}
        return {
            "base": self.base.to_dict(),
            "space": {p.name: {p.kind: list(p.values)} for p in self.space.values()},
            "study": settings,
        }

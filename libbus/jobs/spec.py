"""The job spec: what a user submits, what the router stores and what a trainer runs. Checked once."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypedDict

import orjson

from libbus.errors import BadRequest
from libbus.jobs.state import JobState
from libbus.order.epochs import DEFAULT_BLOCK_SIZE, Shuffle, check_skips
from libbus.wire.schema import too_deep

__all__ = [
    "BUILTIN_MODELS",
    "BUILTIN_PARAMS",
    "JOB_STATES",
    "MAX_ATTEMPTS",
    "TERMINAL_STATES",
    "SETTABLE",
    "JobSpec",
    "SpikeSpec",
    "dataset_name",
]

JOB_STATES = tuple(s.value for s in JobState)
TERMINAL_STATES = tuple(s.value for s in JobState if s.terminal)
OPTIMIZERS = ("sgd", "adam")
GATHER_POLICIES = ("wait", "fail")
TASKS = ("train", "evaluate")
#: Hyper-parameters ``busctl job set`` may change while a job runs.
SETTABLE = ("lr", "weight_decay", "momentum")
#: The fields a built-in job's loop reads as its ``job.params`` (services/trainer/attempt/builtin.py); an
#: entrypoint job has ``params`` of its own instead, and these mean nothing to it but ``model_from``.
BUILTIN_PARAMS = ("model", "model_kwargs", "optimizer", *SETTABLE, "epochs", "seed", "model_from")


class BuiltinParams(TypedDict):
    """A built-in job's ``job.params`` (:meth:`JobSpec.builtin_params`): :data:`BUILTIN_PARAMS`, typed."""

    model: str
    model_kwargs: dict[str, Any]
    optimizer: str
    lr: float
    weight_decay: float
    momentum: float
    epochs: int
    seed: int
    model_from: str


#: The most trainers one job may gather.
MAX_WORLD_SIZE = 256
#: The most attempts a job may lose (each may have cost a trainer): past this it is poisoned.
MAX_ATTEMPTS = 10


def dataset_name(ref: str) -> str:
    """A job names its dataset as ``NAME`` or, in the seed's form, ``remote://NAME``."""
    name = ref.removeprefix("remote://").strip("/")
    if not name:
        raise BadRequest(f"dataset {ref!r} names nothing; use NAME or remote://NAME")
    return name


@dataclass
class JobSpec:
    dataset: str
    model: str = "cnn"
    model_kwargs: dict = field(default_factory=dict)
    optimizer: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.9
    weight_decay: float = 0.0
    epochs: int = 2
    batch_size: int = 64
    seed: int = 0
    #: How ``train`` is ordered each epoch: ``none``, ``full`` or ``block`` (a bool is accepted:
    #: true is ``full``, false ``none``); stored as the mode's name. ``val`` is never shuffled.
    shuffle: str = Shuffle.FULL.value
    #: Samples per block of ``shuffle = "block"`` (read sequentially inside a block).
    block_size: int = DEFAULT_BLOCK_SIZE
    device: str = "cpu"
    #: Score the final weights on the provider's private test split.
    evaluate: bool = True
    priority: int = 0
    #: Times the job may lose its trainer (lease lapsed, abandoned, a retryable failure) before it
    #: is failed as poisoned; at most :data:`MAX_ATTEMPTS`.
    max_attempts: int = 3
    #: Write a checkpoint every this many steps (0: only at the end of each epoch and on command).
    checkpoint_every: int = 0
    #: Trainers that train the job together (a gang, torch.distributed): each reads its own shard
    #: of ``train`` and ``batch_size`` is per trainer. The job waits until this many are free.
    world_size: int = 1
    #: A gang that has not gathered ``world_size`` trainers in this many seconds releases them to
    #: other work; then the job waits its turn again (``gather_policy = "wait"``) or fails.
    gather_timeout_s: float = 120.0
    gather_policy: str = "wait"
    #: An elastic gang starts on as many trainers as are free, from ``min_world_size`` up to
    #: ``max_world_size`` (at once with the maximum; else with at least the minimum once
    #: ``gather_timeout_s`` has passed), and a requeued one resumes at the size it gets then
    #: (its cursor re-split, libbus/order/elastic.py). ``world_size`` is then the maximum.
    elastic: bool = False
    min_world_size: int = 0
    max_world_size: int = 0
    name: str = ""
    #: Early stopping, decided by the router (services/router/early_stop.py): stop once ``monitor``
    #: has not improved by more than ``min_delta`` for ``patience`` epochs (0: never).
    patience: int = 0
    min_delta: float = 0.0
    monitor: str = "val_loss"
    #: ``train``, or ``evaluate``: score the stored model ``model_from`` (a succeeded job's id, or
    #: ``upload``: a file sent with the submission) on ``split`` (``val`` on a trainer, ``test`` on
    #: the provider). A ``train`` job with ``model_from`` starts from that model's weights, or (a job
    #: that has not succeeded) from its latest checkpoint's (docs/jobs.md).
    task: str = "train"
    model_from: str = ""
    split: str = "val"
    #: The user's training function, ``package.module:function``: the trainer runs it in a child
    #: process with a :class:`libbus.jobapi.Job` (docs/jobs.md). Empty: the built-in loop trains
    #: ``model``. A trainer imports only modules its operator allows (its ``job_modules`` setting).
    entrypoint: str = ""
    #: The entrypoint's own parameters (``job.params``): names to plain values; ``busctl job set``
    #: changes them while it runs, a study samples them (``[space] "params.lr" = ...``).
    params: dict = field(default_factory=dict)
    #: ``[start, stop]``: train on these records of the train split only (every order, shard and
    #: resume guarantee kept inside them). Empty: the whole split.
    train_range: list = field(default_factory=list)
    #: Samples never to train on again (``busctl job skip``, docs/jobs.md): skips, oldest first, each a
    #: list of ``[start, stop]`` index ranges of the train split. Only ever added to, by the router.
    skip: list = field(default_factory=list)
    #: Skip a loss spike's stretch by itself (:class:`SpikeSpec`; docs/jobs.md "Loss spikes"): empty,
    #: off; a table given (``{}`` too) is stored whole, its missing keys at their defaults.
    spike: dict = field(default_factory=dict)
    #: The spikes skipped so far, oldest first (``{step, loss, median, steps}``): only ever added to, by
    #: the router, when a trainer asks it to skip a spike's stretch; ``spike.max_skips`` bounds them.
    spikes: list = field(default_factory=list)
    #: What scores the weights on the provider's test split: "" (the built-in ``model`` is built
    #: there), or ``package.module:function`` that the provider's ``evaluator_modules`` allows, called
    #: with ``evaluator_kwargs`` (services/provider/evaluator.py; docs/python-api.md).
    evaluator: str = ""
    evaluator_kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict) -> JobSpec:
        """Check a submitted spec; raises :class:`BadRequest` naming the field that is wrong."""
        if not isinstance(raw, dict):
            raise BadRequest("job spec must be an object")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise BadRequest(f"unknown job field(s) {', '.join(unknown)}; known: {', '.join(known)}")
        if "dataset" not in raw:
            raise BadRequest("job spec needs 'dataset' (a name a provider serves)")
        values: dict[str, Any] = {}
        for name, value in raw.items():
            default = known[name].default
            if default is dataclasses.MISSING:
                factory = known[name].default_factory
                default = factory() if factory is not dataclasses.MISSING else ""
            if name == "shuffle":
                values[name] = _shuffle_mode(value)
                continue
            want = type(default)
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise BadRequest(f"job field '{name}' must be {want.__name__}, got {value!r}")
            values[name] = value
        spec = cls(**values)
        spec.dataset = dataset_name(spec.dataset)
        if spec.optimizer not in OPTIMIZERS:
            raise BadRequest(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {spec.optimizer!r}")
        for name in ("epochs", "batch_size", "block_size", "max_attempts", "world_size"):
            if getattr(spec, name) < 1:
                raise BadRequest(f"{name} must be at least 1, got {getattr(spec, name)}")
        if spec.max_attempts > MAX_ATTEMPTS:
            raise BadRequest(
                f"max_attempts must be at most {MAX_ATTEMPTS} (a job that loses that many "
                f"trainers is poisoned), got {spec.max_attempts}"
            )
        if spec.world_size > MAX_WORLD_SIZE:
            raise BadRequest(f"world_size must be at most {MAX_WORLD_SIZE}, got {spec.world_size}")
        _check_elastic(spec, raw)
        if spec.gather_timeout_s <= 0:
            raise BadRequest(f"gather_timeout_s must be positive, got {spec.gather_timeout_s}")
        if spec.gather_policy not in GATHER_POLICIES:
            raise BadRequest(f"gather_policy must be one of {', '.join(GATHER_POLICIES)}, got {spec.gather_policy!r}")
        if spec.checkpoint_every < 0:
            raise BadRequest(f"checkpoint_every must be 0 or more steps, got {spec.checkpoint_every}")
        if spec.patience < 0 or spec.min_delta < 0:
            raise BadRequest("patience and min_delta must not be negative")
        if not spec.monitor.startswith("val_"):
            raise BadRequest(f"monitor must be a validation metric (val_loss, val_accuracy), got {spec.monitor!r}")
        if spec.task not in TASKS:
            raise BadRequest(f"task must be one of {', '.join(TASKS)}, got {spec.task!r}")
        if spec.evaluator and (spec.evaluator.count(":") != 1 or not all(spec.evaluator.split(":"))):
            raise BadRequest(f"evaluator must be 'package.module:function', got {spec.evaluator!r}")
        if spec.task == "evaluate" and (not spec.model_from or spec.split not in ("val", "test")):
            raise BadRequest(
                "an evaluate task needs model_from (a succeeded job, or an uploaded file) and "
                f"split val or test, got model_from={spec.model_from!r} split={spec.split!r}"
            )
        _check_model(spec)
        _check_entrypoint(spec)
        check_skips(spec.skip)
        if "spike" in raw:
            spec.spike = SpikeSpec.parse(spec.spike).to_dict()
        _check_spikes(spec.spikes)
        if spec.train_range and not (
            len(spec.train_range) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in spec.train_range)
            and 0 <= spec.train_range[0] < spec.train_range[1]
        ):
            raise BadRequest(f"train_range must be [start, stop] with 0 <= start < stop, got {spec.train_range!r}")
        if spec.lr <= 0:
            raise BadRequest(f"lr must be positive, got {spec.lr}")
        if spec.weight_decay < 0 or spec.momentum < 0:
            raise BadRequest("weight_decay and momentum must not be negative")
        return spec

    def with_hyper(self, changes: dict) -> JobSpec:
        """This spec with ``busctl job set`` changes applied and checked: only :data:`SETTABLE`
        keys of a built-in job; any of its ``params`` (plain values) for an entrypoint job."""
        if not isinstance(changes, dict) or not changes:
            raise BadRequest(f"set needs at least one of {', '.join(SETTABLE)} (e.g. lr=0.01)")
        if self.entrypoint:  # NAME or params.NAME (a study's name for it)
            changes = {str(k).removeprefix("params."): v for k, v in changes.items()}
            return self.updated(params={**self.params, **changes})
        other = sorted(set(changes) - set(SETTABLE))
        if other:
            raise BadRequest(f"cannot set {', '.join(other)} on a running job; settable: {', '.join(SETTABLE)}")
        return self.updated(**changes)

    def updated(self, **changes: Any) -> JobSpec:
        """A copy with ``changes``, checked as a submitted spec is (:class:`BadRequest` naming the field).
        An elastic job's ``world_size`` follows a changed ``max_world_size`` unless set with it."""
        merged = {**self.to_dict(), **changes}
        if merged.get("elastic") and "world_size" not in changes:
            del merged["world_size"]  # derived: its max_world_size
        return JobSpec.from_dict(merged)

    def planned_epochs(self) -> int | None:
        """The epochs the job trains, where it says: an entrypoint's ``params.epochs``, else ``epochs``
        for the built-in loop; None for an entrypoint without one (its function decides: the spec's
        default is not it)."""
        epochs = self.params.get("epochs", None if self.entrypoint else self.epochs)
        return epochs if isinstance(epochs, int) and not isinstance(epochs, bool) and epochs > 0 else None

    def builtin_params(self) -> BuiltinParams:
        """What the built-in loop (services/trainer/attempt/builtin.py) reads as ``job.params``: a built-in
        job is that entrypoint with its typed fields as parameters (``set`` changes :data:`SETTABLE`)."""
        return BuiltinParams(
            model=self.model,
            model_kwargs=self.model_kwargs,
            optimizer=self.optimizer,
            lr=self.lr,
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            epochs=self.epochs,
            seed=self.seed,
            model_from=self.model_from,
        )

    def settable(self) -> dict:
        """What ``busctl job set`` may change now, with its values: an entrypoint's ``params``, or a
        built-in job's :data:`SETTABLE` hyper-parameters (a gang's rank 0 sends them to the others)."""
        return dict(self.params) if self.entrypoint else {k: getattr(self, k) for k in SETTABLE}

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if not out["spike"]:  # off is absent: from_dict reads any ``spike`` given, {} too, as on
            del out["spike"]
        return out


@dataclass(frozen=True)
class SpikeSpec:
    """When a step's loss is a spike, and what is done about it (docs/jobs.md "Loss spikes").

    A step's loss is a spike when it is not finite, or when at least ``warmup`` steps of the attempt
    came before it and it is above ``factor`` times the median of the last ``window`` losses that
    were not spikes. On a spike at step ``k`` the job skips steps ``k - skip_before .. k`` (as
    ``busctl job skip --steps``); past ``max_skips`` such skips it fails instead (0: fail at the first).
    """

    factor: float = 3.0
    window: int = 50
    warmup: int = 20
    skip_before: int = 2
    max_skips: int = 3

    #: ``name: (lowest, highest)`` accepted for each field.
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "factor": (1.0, 1e6),
        "window": (1, 10_000),
        "warmup": (0, 1_000_000),
        "skip_before": (0, 1_000),
        "max_skips": (0, 100),
    }

    @classmethod
    def parse(cls, raw: Any) -> SpikeSpec:
        """``raw`` (the job's ``spike`` table) checked; raises :class:`BadRequest` naming the key."""
        if not isinstance(raw, dict):
            raise BadRequest(f"spike must be a table (factor, window, warmup, skip_before, max_skips), got {raw!r:.80}")
        unknown = sorted(set(raw) - set(cls.BOUNDS))
        if unknown:
            raise BadRequest(f"unknown spike key(s) {', '.join(unknown)}; known: {', '.join(cls.BOUNDS)}")
        values: dict[str, Any] = {}
        for name, value in raw.items():
            low, high = cls.BOUNDS[name]
            want = float if name == "factor" else int
            ok = isinstance(value, (int, float) if want is float else int) and not isinstance(value, bool)
            if not ok or not low <= value <= high or (want is float and not math.isfinite(value)):
                kind = "a number" if want is float else "an integer"
                raise BadRequest(f"spike.{name} must be {kind} in [{low:g}, {high:g}], got {value!r}")
            values[name] = want(value)
        if values.get("factor", cls.factor) <= 1.0:
            raise BadRequest(
                f"spike.factor must be above 1 (a spike is a loss above factor x the median: 1 flags "
                f"half of all steps), got {values['factor']}"
            )
        return cls(**values)

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.BOUNDS}


def _check_spikes(spikes: Any) -> None:
    """``spikes`` is the router's record: a bounded list of small tables."""
    if len(spikes) > SpikeSpec.BOUNDS["max_skips"][1] or not all(isinstance(s, dict) and len(s) <= 8 for s in spikes):
        raise BadRequest(f"spikes is the router's record of skipped loss spikes (a list of tables), got {spikes!r:.80}")


def _check_elastic(spec: JobSpec, raw: dict) -> None:
    """``elastic`` needs ``1 <= min_world_size <= max_world_size <= MAX_WORLD_SIZE``; its
    ``world_size`` becomes ``max_world_size`` (one given as well must equal it). Without
    ``elastic`` the bounds mean nothing, and a spec that sets them is refused rather than ignored."""
    if not spec.elastic:
        if spec.min_world_size or spec.max_world_size:
            raise BadRequest("min_world_size and max_world_size need elastic = true (else set world_size)")
        return
    low, high = spec.min_world_size, spec.max_world_size
    if not 1 <= low <= high <= MAX_WORLD_SIZE:
        raise BadRequest(
            f"an elastic job needs 1 <= min_world_size <= max_world_size <= {MAX_WORLD_SIZE}, "
            f"got min_world_size={low} max_world_size={high}"
        )
    if "world_size" in raw and spec.world_size != high:
        raise BadRequest(
            f"an elastic job's world_size is its max_world_size: got world_size={spec.world_size} "
            f"and max_world_size={high} (leave world_size out)"
        )
    spec.world_size = high


#: The most bytes a job's ``params`` may take as JSON, and how deep they may nest.
MAX_PARAMS_BYTES = 64 << 10
MAX_PARAMS_DEPTH = 4
_ENTRYPOINT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z][A-Za-z0-9_]*$")


#: The built-in models' names (what services/models.py builds; tests/router/test_job_spec_model.py holds them equal).
BUILTIN_MODELS = ("mlp", "cnn", "resnet18", "tiny-lm")


def _check_model(spec: JobSpec) -> None:
    """``model`` names a built-in (``mlp``) or ``package.module:factory`` (a public name), checked as
    ``entrypoint`` is: a trainer imports the module only where its ``job_modules`` allows it."""
    if ":" in spec.model:
        if not _ENTRYPOINT.match(spec.model):
            raise BadRequest(
                f"model must be a built-in name or package.module:factory (a public name), got {spec.model!r:.120}"
            )
    elif spec.model not in BUILTIN_MODELS:
        meant = difflib.get_close_matches(spec.model, BUILTIN_MODELS, n=1, cutoff=0.6)
        hint = f"; did you mean {meant[0]!r}?" if meant else ""
        raise BadRequest(
            f"model must be a built-in name ({', '.join(BUILTIN_MODELS)}) or package.module:factory, "
            f"got {spec.model!r:.120}{hint}"
        )


def _check_entrypoint(spec: JobSpec) -> None:
    """``entrypoint`` names ``package.module:function`` (a public name); ``params`` are plain,
    bounded values with string names. Whether a trainer may import it is the trainer's decision."""
    if spec.entrypoint and not _ENTRYPOINT.match(spec.entrypoint):
        raise BadRequest(f"entrypoint must be package.module:function (a public name), got {spec.entrypoint!r}")
    if spec.params and not spec.entrypoint:
        raise BadRequest(
            "params are an entrypoint's parameters: set entrypoint too (built-in jobs use lr, epochs, ...)"
        )
    if spec.entrypoint and spec.task != "train":
        raise BadRequest("an entrypoint job trains (task = train); score its model with an evaluate task")
    if any(not isinstance(k, str) or not k.isidentifier() for k in spec.params):
        raise BadRequest(f"params names must be identifiers, got {sorted(map(str, spec.params))}")
    if too_deep(spec.params, MAX_PARAMS_DEPTH):
        raise BadRequest(f"params nest deeper than {MAX_PARAMS_DEPTH} levels")
    try:
        size = len(orjson.dumps(spec.params))
    except TypeError as err:
        raise BadRequest(f"params must be plain values (numbers, strings, lists, tables): {err}") from err
    if size > MAX_PARAMS_BYTES:
        raise BadRequest(f"params take {size} bytes as JSON; at most {MAX_PARAMS_BYTES}")


def _shuffle_mode(value) -> str:
    """The shuffle mode's name for a submitted ``shuffle`` (a mode name or a bool)."""
    try:
        return Shuffle.parse(value).value
    except BadRequest as err:
        raise BadRequest(f"job field 'shuffle' must be none, full or block (or true/false), got {value!r}") from err

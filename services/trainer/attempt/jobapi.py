"""The :class:`libbus.jobapi.Job` a trainer hands a job's function (an entrypoint, or the built-in
loop, :mod:`.builtin`): one attempt's parameters, loaders, checkpoints, reports and model, inside the
attempt's own process (:mod:`.child`).

Commands (:mod:`.control`) are applied at :meth:`AttemptJob.step`, :meth:`AttemptJob.report`,
:meth:`AttemptJob.checkpoint` and :meth:`AttemptJob.save_model`, where the function has finished a
step: the loaders' cursors then equal the samples trained on, so a checkpoint taken there (on
command, on stop, on the trainer's shutdown) resumes at the exact next sample.

A checkpoint is one safetensors file holding the function's state with every loader's cursor, the
random generators, the step and the history, written atomically; its format is :mod:`.checkpoint`'s
(:func:`.checkpoint.save_state`, :func:`.checkpoint.read_state`). Nothing in it is unpickled on restore.
"""

from __future__ import annotations

import hashlib
import logging
import math
import queue
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, cast

import orjson
import torch
from safetensors.torch import save as save_safetensors

from libbus.config import Settings
from libbus.connect.client import Identity
from libbus.errors import BadRequest, BusError
from libbus.jobapi import CheckpointRecord, Job, JobEnded, ModelRecord
from libbus.jobs.commands import JobCommand
from libbus.jobs.spec import JobSpec
from libbus.jobs.tensorboard_events import JobEvents, run_dir
from libbus.loader.remote import RemoteLoader
from libbus.wire.messages import Checkpointed, Command, Progress, Task
from services.sdnotify import Notifier

from ..reports import Reporter
from .audit import Audit
from .checkpoint import (
    job_dir,
    load_state,
    model_metadata,
    prune,
    read_state,
    save_model,
    save_state,
    set_rng_state,
)
from .control import Controls, Lost, Stopped
from .evaluation import LiveEvaluations, snapshot
from .final_eval import EVALUATE_TIMEOUT_S, model_spec
from .gang import Code, Gang, GangError
from .prepare import job_device, shard, starting_weights
from .progress import AttemptProgress, Meter, slowest
from .resume import read_shared
from .spike import Spike, detector_for, skip_spike

__all__ = ["AttemptJob"]

log = logging.getLogger(__name__)

#: What a job's loader may not be told: they are the job's (its dataset, its trainer's identity).
RESERVED_LOADER_ARGS = ("dataset", "provider", "token", "resolver", "curve", "host_id", "name")


class AttemptJob(Job):
    """One attempt of an entrypoint job (see the module docstring)."""

    def __init__(
        self,
        task: Task,
        spec: JobSpec,
        settings: Settings,
        identity: Identity,
        reporter: Reporter,
        commands: queue.Queue[Command],
        *,
        providers: list[dict],
        resolver: Callable[[float], list[dict]],
        attempt: int = 0,
        gang: Gang | None = None,
        provider: dict | None = None,
        notifier: Notifier | None = None,
    ):
        self.task = task
        #: The job's spec, parsed where the task entered this process (``busctl job set`` replaces it).
        self.spec = spec
        self.settings = settings
        self.identity = identity
        self.reporter = reporter
        self.id = task.job
        self.rank = task.rank
        self.world_size = task.world_size
        self.attempt = attempt
        self.device = job_device(self.spec)
        self.step_count = 0
        self.epochs_reported = 0
        self.history: list[dict] = []
        self.lead = task.rank == 0
        self.directory = job_dir(settings.checkpoint_dir, self.id)
        if not self.lead:
            self.directory = self.directory / f"rank-{task.rank}"
        self.meter = Meter()
        #: Job calls made: with the loaders' cursors, what tells the trainer this attempt is alive.
        self.calls = 0
        self.last_checkpoint: CheckpointRecord | None = None
        self.resumed_from: dict | None = None
        self.model_record: ModelRecord | None = None
        #: Why the function was ended at a call (``stopped``, ``handback``, ``lost``), else None.
        self.ended: str | None = None
        #: In a gang: the process group every rank's function joined (torch.distributed is initialized).
        self.gang = gang
        #: How many times ``set`` changed the params (rank 0's count goes to the other ranks).
        self._params_version = 0
        self._shutting_down = False
        self._seen_version = 0
        self._providers = providers
        #: The provider the job reads from (and ``busctl job eval`` scores on).
        self.provider = provider or (providers[0] if providers else {})
        #: systemd's status line of the trainer (``running job J epoch E/N``), told at each step.
        self.notifier = notifier or Notifier()
        #: ``busctl job eval``: the weights now, scored on the provider's test split in the background.
        self.evaluations = LiveEvaluations(self.id, identity, EVALUATE_TIMEOUT_S)
        self._audit: Audit | None = None
        self._status_epoch = -1
        self._resolver = resolver
        self._loaders: dict[str, RemoteLoader] = {}
        self._cursors: dict[str, dict] = {}
        self._get_state: Callable[[], Mapping[str, Any]] | None = None
        self._restored = False
        self._restore_value: dict | None = None
        self._adopted = 0
        self._checkpointed = (-1, -1)
        self._last_report = 0.0
        #: The job's TensorBoard run (the trainer's ``tensorboard_dir``), written by rank 0 only.
        self._events = self._open_events()
        self.controls = Controls(
            self.id,
            commands,
            reporter,
            checkpoint=self._checkpoint_on_command,
            set_hyper=self._set,
            report=self._while_paused,
            before_stop=self._before_stop,
            evaluate=self._evaluate,
            adopt=self._adopt,
            model=self._current_model,
        )
        #: A study's PBT adopted another member's state: this attempt ends at this call, and the
        #: next (its trainer takes the job again) restores the adopted state.
        self._restart = False
        #: The job's loss-spike rule (its ``spike`` option), fed by ``step(loss=...)``: rank 0 judges,
        #: in a gang the largest loss of the ranks (every rank takes part in finding it).
        self._spikes = detector_for(self.spec)

    # -- the API ------------------------------------------------------------------------------------
    @property
    def params(self) -> Mapping[str, Any]:
        if not self.spec.entrypoint:  # the built-in loop's (services/trainer/attempt/builtin.py)
            return MappingProxyType(self.spec.builtin_params())
        return MappingProxyType(self.spec.params)

    def loader(self, split: str = "train", **kwargs: Any) -> RemoteLoader:
        name = kwargs.pop("name", split)
        if name in self._loaders:
            raise BadRequest(f"job.loader: a loader named {name!r} is open already (give name= to open another)")
        reserved = sorted(set(kwargs) & set(RESERVED_LOADER_ARGS))
        if reserved:
            raise BadRequest(f"job.loader: {', '.join(reserved)} are the job's own; leave them out")
        s, spec = self.settings, self.spec
        args: dict[str, Any] = {
            "provider": self._providers,
            "provider_wait_s": s.provider_wait_s,
            "resolver": self._resolver,
            "token": self.identity.token,
            "batch_size": spec.batch_size,
            "inflight": s.inflight or None,  # 0: the loader sizes its window
            "flows": s.flows,
            "timeout_s": s.request_timeout_s,
            "retries": s.request_retries,
            "name": self.identity.name,
            "device": str(self.device),
            "shm": s.shm,
            "shm_slots": s.shm_slots,
            "host_id": self.identity.host_id,
            "curve": self.identity.curve,
        }
        if split == "train":  # the job's order, this rank's shard, its train_range
            args.update(
                shuffle=spec.shuffle, block_size=spec.block_size, seed=spec.seed, skip=spec.skip, **shard(self.task)
            )
            if spec.train_range:
                args["samples"] = tuple(spec.train_range)
        else:  # whole, in file order, unless asked otherwise
            args.update(shuffle=False, rank=0, world_size=1)
        loader = RemoteLoader(spec.dataset, split=split, **{**args, **kwargs})
        if name in self._cursors:
            loader.load_state_dict(self._cursors[name])
        self._loaders[name] = loader
        return loader

    def restore(self) -> dict | None:
        if self._restored:
            return self._restore_value
        self._restored = True
        record = cast(CheckpointRecord | None, self.task.resume)  # the router's copy of one this job wrote
        if not record:
            return None
        try:
            self._restore_value = self._read(record)
        except BusError as err:
            log.warning("job %s: cannot resume from %s: %s; starting over", self.id, record.get("path"), err)
            self.resumed_from = {"error": str(err)}
            self._cursors = {}
            for loader in self._loaders.values():  # a cursor it may have set goes (an elastic plan too)
                loader.rewind()
            return None
        return self._restore_value

    def initial_model(self) -> dict[str, torch.Tensor] | None:
        return starting_weights(self.task, self.spec.model_from, self.settings.checkpoint_dir, self.gang)

    def checkpoint(self, state: Mapping[str, Any] | None = None) -> CheckpointRecord:
        record = self._write(state)
        self._commands()
        return record

    def on_checkpoint(self, get_state: Callable[[], Mapping[str, Any]]) -> None:
        if not callable(get_state):
            raise BadRequest(f"job.on_checkpoint needs a function returning the state, got {type(get_state).__name__}")
        self._get_state = get_state

    def step(self, samples: int | None = None, **metrics: float) -> None:
        loss = _number("loss", metrics.get("loss", math.nan))  # a wrong call is refused before it counts
        train = self._loaders.get("train")
        if samples is None:
            samples = train.batch_size if train is not None else 1
        elif isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise BadRequest(f"job.step: samples is the step's batch size, a count; got {samples!r}")
        self.calls += 1
        self.step_count += 1
        if math.isfinite(loss):
            self.meter.add(samples, loss)
            if self._events is not None:
                self._events.step(self.step_count, loss)
        else:
            self.meter.samples += samples
        if train is not None and train.epoch != self._status_epoch:  # told once an epoch, not every step
            self._status_epoch = train.epoch
            total = self.spec.planned_epochs()
            shown = f"{min(train.epoch + 1, total)}/{total}" if total else f"{train.epoch + 1}"
            self.notifier.status(f"running job {self.id} epoch {shown}")
        if self._spikes is not None and "loss" in metrics:
            judged = self.gang.largest(loss) if self.gang is not None else loss
            if self.lead and (spike := self._spikes.observe(self.step_count, judged)):
                self._on_spike(spike)
        every = self.spec.checkpoint_every
        if every and self.step_count % every == 0 and self._get_state is not None:
            self._write(None)
        self._maybe_report()
        self._commands()

    def report(self, **metrics: float) -> None:
        values: dict[str, float] = {}
        for key, value in metrics.items():  # a wrong call is refused before it counts
            if not key.isidentifier() or key == "epoch":
                raise BadRequest(f"job.report: metric names are identifiers other than 'epoch', got {key!r}")
            values[key] = _number(key, value)
        self.calls += 1
        record: dict[str, Any] = {"epoch": self.epochs_reported + 1}
        train_loss = self.meter.take_loss()
        if math.isfinite(train_loss):
            record["train_loss"] = train_loss
        record.update(values)
        self.history.append(record)
        self.epochs_reported += 1
        if self._events is not None:
            self._events.epoch(record)
        log.info("job %s: epoch %d %s", self.id, self.epochs_reported, _shown(record))
        if self._get_state is not None:  # a resumed attempt keeps this record and continues after it
            self._write(None)
        if self.lead:
            self._report()
            # the router judges this epoch now (early stopping, a study's pruner): its verdict applies here
            self.reporter.await_verdict()
        self._commands()

    def save_model(self, state_dict: Mapping[str, torch.Tensor]) -> ModelRecord:
        self.calls += 1
        self.model_record = save_model(self.directory, dict(state_dict), self._model_meta())
        self._commands()
        return self.model_record

    # -- for the trainer's own code (the built-in loop) ----------------------------------------------
    def record_batch(self, epoch: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """The audit of what the job trained on (the trainer's ``audit_dir``; :mod:`.audit`): the
        batch about to make step ``step_count + 1``. Nothing without an ``audit_dir``."""
        if not self.settings.audit_dir:
            return
        if self._audit is None:  # after restore(): the attempt's first line says where it resumed
            self._audit = Audit(
                self.settings.audit_dir,
                self.id,
                self.identity.name,
                self.step_count,
                rank=self.rank,
                attempt=self.attempt,
            )
        self._audit.record(epoch, self.step_count + 1, x, y)

    # -- for the attempt's runner -----------------------------------------------------------------
    def activity(self) -> tuple:
        """Changes while the function makes progress: its calls, its loaders' cursors and waits."""
        return (self.calls, *((ld._epoch, ld._position, ld.wait_s) for ld in self._loaders.values()))

    def progress(self) -> AttemptProgress:
        """What this attempt reports (``busctl job watch``, ``top``): the built-in loop's fields."""
        train = self._loaders.get("train")
        elapsed = max(1e-9, time.monotonic() - self.meter.started)
        out: AttemptProgress = {
            "epoch": train.epoch if train is not None else self.epochs_reported,
            "epochs": self.spec.planned_epochs(),
            "step": self.step_count,
            "steps_per_epoch": len(train) if train is not None else None,
            "loss": self.meter.loss_sum / self.meter.loss_n if self.meter.loss_n else None,
            "samples": self.meter.samples * self.world_size,
            "samples_per_s": self.meter.samples * self.world_size / elapsed,
            "elapsed_s": elapsed,
            "state": self.controls.state,
            "checkpoint_step": self.last_checkpoint["step"] if self.last_checkpoint else None,
            "resumed_from": self.resumed_from,
            "history": self.history,
            "entrypoint": self.spec.entrypoint,
        }
        if train is not None:
            out.update(
                {
                    "data_wait_s": train.wait_s,
                    "transport": train.transport,
                    "data_wait_pct": 100.0 * train.wait_s / elapsed,
                    # the replica whose batches were waited for longest: the slow provider, if data is the bottleneck
                    "data_wait_slowest": slowest(train),
                    "data_wait_split": train.stall.breakdown(),  # where the waiting went (libbus.loader.stall)
                }
            )
        return out

    def close(self) -> None:
        for loader in self._loaders.values():
            loader.close()
        if self._audit is not None:
            self._audit.close()
        if self._events is not None:
            self._events.progress(self.progress())  # the attempt's last figures, between two reports
            self._events.close()

    # -- checkpoints ----------------------------------------------------------------------------------
    def _write(self, state: Mapping[str, Any] | None, again: bool = False) -> CheckpointRecord:
        """Write a checkpoint of ``state`` (or the registered one's); the last record again if nothing
        happened since it (unless ``again``: a state not the function's own, adopted)."""
        self.calls += 1
        if not self.lead:  # rank 0 checkpoints for the gang
            return self.last_checkpoint or {}
        if state is None:
            if self._get_state is None:
                raise BadRequest("job.checkpoint() needs the state to store, or a job.on_checkpoint(...) function")
            if self.last_checkpoint is not None and self._checkpointed == (self.step_count, self.epochs_reported):
                return self.last_checkpoint
            state = self._get_state()
        elif again and self.last_checkpoint is not None and self.last_checkpoint["step"] == self.step_count:
            self._adopted += 1  # a file of its own: the record the router holds must name intact bytes
        cursors = {name: loader.state_dict() for name, loader in self._loaders.items()}
        cursor = cursors.get("train", {})
        epoch = int(cursor.get("epoch", self.epochs_reported)) if isinstance(cursor, dict) else self.epochs_reported
        same_step = self.last_checkpoint is not None and self.last_checkpoint["step"] == self.step_count
        record = save_state(
            self.directory,
            step=self.step_count,
            epoch=epoch,
            state=state,
            cursors=cursors,
            extra={"history": self.history, "loss_sum": self.meter.loss_sum, "loss_n": self.meter.loss_n},
            tag=f"a{self._adopted}" if again and self._adopted else ("e" if same_step else ""),
        )
        self.last_checkpoint = record
        self._checkpointed = (self.step_count, self.epochs_reported)
        self.reporter.put(Checkpointed(job=self.id, checkpoint=dict(record)))  # the message's JSON object
        self.reporter.prune_checkpoints(lambda held: prune(self.directory, held))
        log.info("job %s: checkpoint at step %d in %s", self.id, self.step_count, record["path"])
        return record

    def _read(self, record: CheckpointRecord) -> dict:
        """The user state of checkpoint ``record``; sets the step count, history, random generators
        and every loader's cursor (loaders opened later start at theirs)."""
        data = read_shared(record, self.settings.checkpoint_dir, self.gang)  # a gang: rank 0's bytes on every rank
        restored = read_state(data, record)
        cursors = restored.cursors
        for name, loader in self._loaders.items():
            if name in cursors:
                loader.load_state_dict(cursors[name])
        self._cursors = cursors
        set_rng_state(*restored.rng)
        self.step_count = step = restored.step
        extra = restored.extra
        self.history = list(extra.get("history", []))
        # the epoch's running train loss goes on where it was (its record is the same as uninterrupted)
        self.meter.loss_sum, self.meter.loss_n = float(extra.get("loss_sum", 0.0)), int(extra.get("loss_n", 0))
        self.epochs_reported = len(self.history)
        self.last_checkpoint = record
        self._checkpointed = (self.step_count, self.epochs_reported)
        self.resumed_from = {"step": step, "epoch": restored.epoch, "path": record.get("path")}
        log.info("job %s: resumed from step %d (%s)", self.id, step, record.get("path"))
        state = restored.state
        return state if isinstance(state, dict) else {"state": state}

    # -- commands -------------------------------------------------------------------------------------
    def _commands(self) -> None:
        """Apply the router's commands now; a stop, a hand-back or a lost job ends the function here.
        In a gang every rank does, at this same call, what rank 0 decided (:meth:`_in_step`)."""
        try:
            if self.gang is None:
                self.controls.check()
                if self._restart:
                    raise Stopped(handback=True)
            elif self.lead:
                self.controls.check()  # a stop has told the gang already (_before_stop)
                self._follow(Code.RUN)
            else:
                self._follow(self._own_code())
        except Stopped as stop:
            self.ended = "handback" if stop.handback else "stopped"
            raise JobEnded(
                "the trainer is shutting down: handed back" if stop.handback else "stopped", handback=stop.handback
            ) from None
        except Lost:
            self.ended = "lost"
            raise JobEnded("the router gave this job to another trainer") from None

    def _on_spike(self, spike: Spike) -> None:
        """Rank 0 saw a loss spike at this step: the gang's other ranks stop at this same call, the
        router skips the stretch before it and takes the job back (the function ends here, to be
        resumed without those samples); past ``spike.max_skips`` the function gets
        :class:`.spike.TooManySpikes` and the job fails."""
        if self.gang is not None:
            self._decide(Code.STOP)
        try:
            skip_spike(spike, self.spec, self.id, self.reporter, self.settings.request_timeout_s)
        except Lost as lost:
            self.ended = "lost"
            raise JobEnded(str(lost)) from None

    def _own_code(self) -> Code:
        """A rank above 0 hears no commands from the router; only its own trainer's shutdown."""
        commands = self.controls.commands
        while not commands.empty():
            if commands.get_nowait().command == JobCommand.SHUTDOWN:
                self._shutting_down = True
        return Code.HANDBACK if self._shutting_down else Code.RUN

    def _follow(self, code: Code) -> None:
        """Every rank: what the gang decides at this call (rank 0's params, a pause, an end)."""
        assert self.gang is not None  # noqa: S101 - only called in a gang
        code = self._decide(code)
        while code == Code.PAUSE and not self.lead:
            code = self._decide(self._own_code())
        if code == Code.RUN or (self.lead and code == Code.PAUSE):
            return
        if self.lead:  # another rank's trainer is shutting down: the gang hands the job back
            log.info("job %s: a rank of the gang is shutting down; handing the job back", self.id)
            self._checkpoint_quietly()
        raise Stopped(handback=code == Code.HANDBACK)

    def _decide(self, code: Code) -> Code:
        assert self.gang is not None  # noqa: S101 - only called in a gang
        code, version = self.gang.decide(code, self._params_version)
        if not self.lead and version != self._params_version:
            settable = orjson.loads(self.gang.share(None))  # rank 0's params (a built-in job's lr, ...)
            if settable:
                self.spec = self.spec.with_hyper(settable)
            self._params_version = version
        elif self.lead and version != self._seen_version:
            self.gang.share(orjson.dumps(self.spec.settable()))
        self._seen_version = version
        return code

    def _while_paused(self) -> None:
        """Rank 0 while paused: reports, and keeps the gang paused."""
        self._maybe_report()
        if self.gang is not None:
            self._follow(Code.PAUSE)

    def _checkpoint_on_command(self) -> dict:
        if self._get_state is None:
            return {"error": "the job's function registered no state (job.on_checkpoint); it checkpoints itself"}
        return dict(self._write(None))

    def _before_stop(self) -> None:
        """Rank 0 stops or hands back: the gang's other ranks stop at this same call, after its checkpoint."""
        self._checkpoint_quietly()
        if self.gang is not None:
            try:
                self._decide(Code.STOP)
            except GangError as err:  # the others are gone already: the stop stands
                log.warning("job %s: %s", self.id, err)

    def _checkpoint_quietly(self) -> None:
        if self._get_state is None or not self.lead:
            return
        try:
            self._write(None)
        except BusError as err:
            log.error("job %s: no checkpoint on stop: %s", self.id, err)

    def _adopt(self, args: dict) -> dict:
        """Population-based training's exploit: another member's state (``args["checkpoint"]``, read
        on this trainer) with this job's own cursors, step, history and params becomes this job's
        checkpoint; the attempt then ends at this call and the job resumes from it (a function
        takes a state only where it restores one)."""
        if self.gang is not None:
            raise BadRequest("adopt is not supported for a gang (world_size > 1)")
        record = args.get("checkpoint") or {}
        try:
            adopted = load_state(record, self.settings.checkpoint_dir)
        except BusError as err:
            raise BadRequest(f"cannot adopt {record.get('path')}: {err}") from err
        state = adopted.state
        mine = self._write(state, again=True)
        self._restart = True
        log.info("job %s: adopted the state of %s (step %d); resuming from it", self.id, args.get("from"), adopted.step)
        return {"from": args.get("from"), "step": adopted.step, "sha256": record.get("sha256"), "as": mine["path"]}

    def _set(self, changes: dict) -> dict:
        self.spec = self.spec.with_hyper(changes)
        self._params_version += 1  # in a gang the other ranks take them at this same call
        return self.spec.to_dict()

    def _weights(self) -> Mapping[str, torch.Tensor] | None:
        """The model weights of the job's registered state now (its ``model`` entry), else None."""
        state = self._get_state() if self._get_state is not None else None
        model = state.get("model") if isinstance(state, Mapping) else None
        weights = model.state_dict() if model is not None and hasattr(model, "state_dict") else model
        if not isinstance(weights, Mapping) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
            return None
        return weights

    def _model_meta(self) -> dict[str, str]:
        """The metadata of the job's model file: what built it (a built-in's name and kwargs, which
        an evaluate task builds again, or the entrypoint) and its step."""
        if self.spec.entrypoint:
            return {"job": self.id, "entrypoint": self.spec.entrypoint, "step": str(self.step_count)}
        return model_metadata(self.id, self.spec, self.step_count)

    def _shown_epoch(self) -> int:
        """The epoch under way, counted from 1."""
        train = self._loaders.get("train")
        return (train.epoch if train is not None else self.epochs_reported) + 1

    def _evaluate(self, done: Callable[[dict], None]) -> None:
        """``busctl job eval``: the weights now (copied here, between two steps), scored on the
        provider's private test split in the background by the built-in model or the job's evaluator."""
        if self.spec.entrypoint and not self.spec.evaluator:
            done(
                {
                    "error": "an entrypoint job's model is scored by the evaluator it names: submit it with "
                    "evaluator = 'package.module:function' (one its provider's operator lists in evaluator_modules)",
                    "step": self.step_count,
                }
            )
            return
        weights = self._weights()
        if weights is None:
            done(
                {"error": "the job's state (job.on_checkpoint) has no 'model' entry to score", "step": self.step_count}
            )
            return
        self.evaluations.start(
            weights,
            model_spec(self.spec),
            self.spec.dataset,
            self.provider,
            step=self.step_count,
            epoch=self._shown_epoch(),
            done=done,
        )

    def _current_model(self) -> tuple[dict, bytes]:
        """``busctl job model --current``: the weights now, as safetensors bytes, with their sha256,
        step and epoch."""
        weights = self._weights()
        if weights is None:
            return {"error": "the job's state (job.on_checkpoint) has no 'model' entry"}, b""
        tensors, copy_ms = snapshot(weights)
        data = save_safetensors({k: v.contiguous() for k, v in tensors.items()}, metadata=self._model_meta())
        detail = {
            "sha256": hashlib.sha256(data).hexdigest(),
            "step": self.step_count,
            "epoch": self._shown_epoch(),
            "copy_ms": round(copy_ms, 3),
            "bytes": len(data),
        }
        return detail, data

    # -- progress -------------------------------------------------------------------------------------
    def _report(self) -> None:
        self._last_report = time.monotonic()
        progress = self.progress()
        if self._events is not None:
            self._events.progress(progress)
        self.reporter.put(Progress(job=self.id, progress=dict(progress)))  # the message's JSON object

    def _open_events(self) -> JobEvents | None:
        """The job's TensorBoard run under ``tensorboard_dir`` (rank 0's figures are the job's); none
        where it is not set, or cannot be written (said once: the job trains all the same)."""
        root = self.settings.tensorboard_dir
        if not root or not self.lead:
            return None
        try:
            return JobEvents(run_dir(root, self.id, self.spec.name), flush_s=self.settings.progress_interval_s)
        except (OSError, ImportError) as err:
            log.warning("job %s: no TensorBoard events under tensorboard_dir %s: %s", self.id, root, err)
            return None

    def _maybe_report(self) -> None:
        if self.lead and time.monotonic() - self._last_report >= self.settings.progress_interval_s:
            self._report()


def _number(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"job metric {name!r} must be a number, got {type(value).__name__}")
    return float(value)


def _shown(record: dict) -> str:
    return " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items() if k != "epoch")

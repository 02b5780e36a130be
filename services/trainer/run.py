"""One training task, from Resolve to PushResult: the part of the trainer that does the work."""

from __future__ import annotations

import logging
import queue
import time
from functools import partial

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from libbus.config import Settings
from libbus.connect.client import Identity
from libbus.connect.link import Link
from libbus.errors import BusError, NotFound, PeerTimeout, Unavailable
from libbus.jobs.spec import JobSpec
from libbus.jobs.state import JobState
from libbus.loader.remote import RemoteLoader, pick_provider
from libbus.wire.messages import Checkpointed, Command, Evaluation, Progress, Task
from services.models import batch_loss, dataset_kind, evaluate, xy
from services.sdnotify import Notifier

from .audit import Audit
from .checkpoint import CheckpointError, job_dir, model_metadata, prune, save_model
from .control import Controls, Lost, Stopped
from .evaltask import adopt_checkpoint, current_weights, evaluate_now, run_evaluation
from .evaluation import LiveEvaluations
from .failures import describe_failure
from .failures import deterministic as _deterministic
from .final_eval import EVALUATE_TIMEOUT_S, score_final
from .gang import Gang, GangError, advertised_host
from .lockstep import Lockstep
from .optim import apply_hyper
from .prepare import build, job_device, load_initial, open_loaders, resolve, starting_weights
from .progress import Meter, epoch_record, final_result, progress_report
from .reports import Reporter
from .resume import restore, save
from .spike import Spike, detector_for, skip_spike

__all__ = ["LOST", "TaskRun"]

log = logging.getLogger(__name__)

#: How a run ends when the router gave its job to another trainer: no job state (nothing is pushed).
LOST = "lost"


class TaskRun:
    """Runs ``task`` to its end and returns the ``(state, result, error)`` to push to the router.

    ``state`` is ``succeeded``, ``failed``, ``stopped``, ``queued`` (handed back on shutdown, with a
    fresh checkpoint) or ``lost`` (the router gave the job away: push nothing). Commands
    (:mod:`.control`) are applied between batches, where the loader's position equals the samples
    trained on, so a checkpoint taken there resumes at the exact next sample.

    In a gang (``task.world_size`` > 1, :mod:`.gang`) rank 0 does all of that for the gang; the
    other ranks train their shards in step with it and report nothing (their state is not pushed).
    """

    def __init__(
        self,
        task: Task,
        settings: Settings,
        link: Link,
        identity: Identity,
        commands: queue.Queue[Command],
        reporter: Reporter,
        *,
        notifier: Notifier | None = None,
    ):
        self.task = task
        self.job = task.job
        self.spec = JobSpec.from_dict(task.spec)
        self.settings = settings
        self.link = link
        self.identity = identity
        self.reporter = reporter
        #: systemd: fed between steps (a long epoch is no silence), told each epoch (STATUS=).
        self.notifier = notifier or Notifier()
        self.history: list[dict] = []
        self.step = 0
        #: Rank 0 (or a job's only trainer) reports, checkpoints and scores; other ranks only train.
        self.lead = task.rank == 0
        self.gang: Gang | None = None
        #: In a gang: commands applied in step with the other ranks.
        self.lockstep: Lockstep | None = None
        #: The gang's process group could not be left: this process must not take another job.
        self.unclean = False
        self.directory = job_dir(settings.checkpoint_dir, self.job)
        if not self.lead:  # the final weights of this rank (identical to rank 0's) go apart
            self.directory = self.directory / f"rank-{task.rank}"
        self.last_checkpoint: dict | None = None
        #: (step, epoch records) of the last checkpoint written or resumed from.
        self._checkpointed: tuple[int, int] = (-1, -1)
        self.resumed_from: dict | None = None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.train: RemoteLoader | None = None
        self.meter = Meter()
        self.audit: Audit | None = None
        #: The job's loss-spike rule (its ``spike`` option), else None: rank 0 judges, in a gang the
        #: largest loss of the ranks (every rank takes part in finding it).
        self.spikes = detector_for(self.spec)
        self._last_report = 0.0
        #: The provider the task reads from (and ``busctl job eval`` scores on), once resolved.
        self.provider: dict | None = None
        self.evaluations = LiveEvaluations(self.job, identity, EVALUATE_TIMEOUT_S)
        self.controls = Controls(
            self.job,
            commands,
            reporter,
            checkpoint=self._checkpoint,
            set_hyper=self._set_hyper,
            report=self._while_paused,
            before_stop=self._before_stop,
            # busctl job eval, population-based training's adopt, busctl job model --current (.evaltask)
            evaluate=partial(evaluate_now, self),
            adopt=partial(adopt_checkpoint, self),
            model=partial(current_weights, self),
        )

    def run(self) -> tuple[JobState | str, dict, str]:
        if self.spec.task == "evaluate":  # score a stored model, no training (services/trainer/evaltask.py)
            return run_evaluation(self.task, self.spec, self.settings, self.link, self.identity)
        # a live evaluation's acknowledgement goes before the result; a trainer shutting down waits less
        evaluation_wait_s = EVALUATE_TIMEOUT_S
        try:
            return JobState.SUCCEEDED, self._train(), ""
        except Stopped as stop:
            result = {"history": self.history, "checkpoint": self.last_checkpoint}
            if stop.handback:
                evaluation_wait_s = self.settings.request_timeout_s
                return JobState.QUEUED, result, f"trainer {self.identity.name} shutting down"
            return JobState.STOPPED, result, ""
        except Lost:
            evaluation_wait_s = 0.0  # the router takes nothing more of this job from here
            return LOST, {}, str(self.reporter.lost)
        except BusError as err:
            return self._failed(err)
        except RuntimeError as err:
            if self.gang is not None and not _deterministic(err):
                # a collective inside backward() (DDP) breaks when another rank is gone
                return self._failed(GangError(f"rank {self.task.rank}: the gang broke: {err}"))
            return self._failed(err)
        except (Exception, SystemExit) as err:  # noqa: BLE001 - whatever the job's model or data raise (sys.exit too), the trainer lives on
            return self._failed(err)
        finally:
            if self.audit is not None:
                self.audit.close()
            if self.evaluations.running:
                with self.notifier.extended(evaluation_wait_s):
                    self.evaluations.join(evaluation_wait_s)
            if self.gang is not None and not self.gang.close():
                self.unclean = True

    def _failed(self, err: BaseException) -> tuple[JobState | str, dict, str]:
        """The job ends ``failed`` with the exception's type, message and a hint; only a peer that
        did not answer or is gone (a provider, a rank of the gang) makes it retryable: a model, a
        spec or a device that fails here fails the same way on the next trainer."""
        retryable = isinstance(err, (PeerTimeout, Unavailable, NotFound))
        error = describe_failure(err, self.spec)
        if retryable or isinstance(err, BusError):
            log.error("job %s failed: %s", self.job, error)
        else:
            log.error("job %s failed: %s", self.job, error, exc_info=err)
        return JobState.FAILED, {"history": self.history, "retryable": retryable}, error

    def _parts(self) -> tuple[RemoteLoader, nn.Module, torch.optim.Optimizer]:
        """The train loader, model and optimizer that :meth:`_train` sets up before anything here
        (a command, a checkpoint, a report) can need them."""
        if self.train is None or self.model is None or self.optimizer is None:
            raise RuntimeError(f"job {self.job}: asked for its model before training was set up")
        return self.train, self.model, self.optimizer

    # -- what commands call ---------------------------------------------------------------------
    def _set_hyper(self, changes: dict) -> dict:
        """``busctl job set``: the optimizer's param groups change now, the spec with them."""
        spec = self.spec.with_hyper(changes)
        apply_hyper(self._parts()[2], spec)
        self.spec = spec
        return spec.to_dict()

    def _before_stop(self) -> None:
        """Stopped or handed back, the job can resume exactly here; if this checkpoint cannot be
        written, it resumes from the last one (what it trained since is done again). The gang's
        other ranks stop at this same step."""
        if self.lockstep is not None:
            self.lockstep.stop()
        self._checkpoint_quietly()

    def _checkpoint_quietly(self) -> None:
        if self.model is None or not (self.step or self.last_checkpoint):
            return
        try:
            self._checkpoint()
        except CheckpointError as err:
            log.error("job %s: no checkpoint on stop: %s", self.job, err)

    # -- applying commands (in a gang: in step with the other ranks, .lockstep) ---------------------
    def _check(self) -> None:
        """Apply commands: :meth:`Controls.check`, and in a gang every rank does what rank 0 decided,
        at this same step (:mod:`.lockstep`)."""
        if self.lockstep is None:
            self.controls.check()
        else:
            self.lockstep.check()

    def _while_paused(self) -> None:
        """Called while rank 0 (or a lone trainer) is paused: reports, and keeps the gang paused."""
        self._maybe_report()
        if self.lockstep is not None:
            self.lockstep.paused()

    # -- checkpoints ------------------------------------------------------------------------------
    def _checkpoint(self) -> dict:
        """Write a checkpoint (unless the last one is of this very step and epoch record: the
        epoch-end one after the last step's adds the epoch's validation) and report it."""
        if self.last_checkpoint is not None and self._checkpointed == (self.step, len(self.history)):
            return self.last_checkpoint
        end = self._checkpointed[0] == self.step  # the epoch-end one after the last step's
        train, model, optimizer = self._parts()
        record = save(self.directory, self.step, train, model, optimizer, self.meter, self.history, epoch_end=end)
        self.last_checkpoint = record
        self._checkpointed = (self.step, len(self.history))
        self.reporter.put(Checkpointed(job=self.job, checkpoint=record))
        prune(self.directory, self.reporter.checkpoint_step)
        log.info("job %s: checkpoint at step %d in %s", self.job, self.step, record["path"])
        return record

    def _resume(self, record: dict) -> bool:
        """Continue from the checkpoint the router handed over. False if it cannot be used (missing
        here, changed, or from another dataset size): the job then starts over. In a gang rank 0
        reads it and every rank restores the same bytes (each its own shard at the same cursor)."""
        train, model, optimizer = self._parts()
        try:
            restored = restore(record, self.settings.checkpoint_dir, self.gang, train, model, optimizer)
        except BusError as err:
            log.warning("job %s: cannot resume from %s: %s; starting over", self.job, record.get("path"), err)
            self.resumed_from = {"error": str(err)}
            train.rewind()  # what load_state_dict may have set (an elastic plan too) is dropped
            return False
        apply_hyper(optimizer, self.spec)  # the stored spec has any `set` made since
        self.step = restored.step
        self.history = restored.extra.get("history", [])
        self.meter.loss_sum = restored.extra.get("loss_sum", 0.0)
        self.meter.loss_n = restored.extra.get("loss_n", 0)
        self.last_checkpoint = record
        self._checkpointed = (self.step, len(self.history))
        self.resumed_from = {"step": restored.step, "epoch": restored.epoch, "path": record.get("path")}
        log.info(
            "job %s: resumed from step %d (epoch %d, position %d)",
            self.job,
            restored.step,
            train.epoch,
            train.position,
        )
        return True

    # -- training ---------------------------------------------------------------------------------
    def _report(self, progress: dict) -> None:
        self._last_report = time.monotonic()
        self.reporter.put(Progress(job=self.job, progress=progress))

    def _maybe_report(self) -> None:
        """Feed the watchdog; a progress report if the last one is ``progress_interval_s`` old.
        Called after every step and while paused, so neither a long epoch nor a long pause is
        silence to systemd."""
        self.notifier.watchdog()
        if self.lead and time.monotonic() - self._last_report >= self.settings.progress_interval_s:
            train = self._parts()[0]
            self._report(self._progress(train.epoch, len(train), train))

    def _train(self) -> dict:
        spec, s = self.spec, self.settings
        resolved = resolve(self.link, spec.dataset, s, self.notifier.watchdog)
        provider = self.provider = pick_provider(resolved.providers, self.identity.host_id)
        info = resolved.info
        log.info(
            "job %s: %s on %s from %s (%s)", self.job, spec.model, spec.dataset, provider["name"], provider["endpoint"]
        )
        device = job_device(spec)
        if self.task.world_size > 1:
            self.gang = Gang(self.task, self.link, advertised_host(s.advertise, s.router), device, s.request_timeout_s)
            self.lockstep = Lockstep(
                self.gang,
                self.controls,
                job=self.job,
                lead=self.lead,
                spec=lambda: self.spec,
                set_hyper=self._set_hyper,
                watchdog=self.notifier.watchdog,
                handback=self._checkpoint_quietly,
            )
        model, optimizer = build(spec, info, device, self.settings.job_modules)
        self.model, self.optimizer = model, optimizer
        kind = dataset_kind(info)
        train, val = open_loaders(self.task, spec, s, self.link, self.identity, resolved.providers, device)
        self.train = train
        if self.task.resume and not self._resume(self.task.resume):
            # a checkpoint half loaded must not leak into the fresh start (build seeds anew)
            model, optimizer = build(spec, info, device, self.settings.job_modules)
            self.model, self.optimizer = model, optimizer
        if self.step == 0 and (initial := starting_weights(self.task, s.checkpoint_dir, self.gang)) is not None:
            load_initial(model, initial, spec.model_from)  # model_from: a first attempt starts from those weights
        net = model if self.gang is None else DistributedDataParallel(model, device_ids=self.gang.device_ids)
        if s.audit_dir:
            self.audit = Audit(s.audit_dir, self.job, self.identity.name, self.step, rank=self.task.rank)
        meter = self.meter
        steps_per_epoch = len(train)
        try:
            if len(self.history) < min(train.epoch, spec.epochs):
                # resumed from a checkpoint taken after an epoch's last step but before its
                # validation (checkpoint_every, a stop, a SIGTERM there): the cursor says the
                # epoch is done, its record is not; validate it now, as the uninterrupted run did
                self._end_epoch(train.epoch - 1, val, kind, steps_per_epoch)
            for epoch in range(train.epoch, spec.epochs):
                train.set_epoch(epoch)
                self.notifier.status(f"running job {self.job} epoch {epoch + 1}/{spec.epochs}")
                self._check()
                model.train()
                for batch in train:
                    x, y = xy(batch)  # a named-field dataset's image and label
                    if self.audit is not None:
                        self.audit.record(epoch, self.step + 1, x, y)
                    optimizer.zero_grad(set_to_none=True)
                    loss = batch_loss(net, x, y, kind)
                    loss.backward()
                    optimizer.step()
                    self.step += 1
                    value = loss.item()
                    meter.add(len(x), value)
                    if self.spikes is not None:
                        self._judge(value)
                    if self.lead and spec.checkpoint_every and self.step % spec.checkpoint_every == 0:
                        self._checkpoint()
                    self._maybe_report()
                    # here the loader's position is exactly the samples trained on
                    self._check()
                self._end_epoch(epoch, val, kind, steps_per_epoch)
        finally:
            train.close()
            if val is not None:
                val.close()
        if not self.lead:
            return {
                "rank": self.task.rank,
                "step": self.step,
                "model": save_model(
                    self.directory, model, {"job": self.job, "rank": str(self.task.rank), "step": str(self.step)}
                ),
            }
        progress = self._progress(spec.epochs, steps_per_epoch, train)
        evaluation = self._evaluate(model, provider) if spec.evaluate else None
        if evaluation is not None:
            log.info(
                "job %s: provider-side test accuracy %.4f on %d samples", self.job, evaluation.accuracy, evaluation.n
            )
        result = final_result(progress, self.history, provider["name"], self.task.world_size, kind, evaluation)
        result["model"] = save_model(self.directory, model, model_metadata(self.job, spec, self.step))
        return result

    def _judge(self, loss: float) -> None:
        """The spike rule on this step's loss (in a gang: the largest of the ranks', so a bad stretch
        in any rank's shard is seen); rank 0 acts on a spike, the others follow at :meth:`_check`."""
        if self.gang is not None:
            loss = self.gang.largest(loss)
        if self.lead and self.spikes is not None and (spike := self.spikes.observe(self.step, loss)):
            self._on_spike(spike)

    def _on_spike(self, spike: Spike) -> None:
        """Rank 0 saw a loss spike at this step: the gang's other ranks stop here, and the router is
        asked to skip the stretch before it (:func:`.spike.skip_spike`: raises :class:`Lost` once it
        has, :class:`.spike.TooManySpikes` past ``spike.max_skips``)."""
        if self.lockstep is not None:
            self.lockstep.stop()
        skip_spike(spike, self.spec, self.job, self.reporter, self.settings.request_timeout_s)

    def _end_epoch(self, epoch: int, val: RemoteLoader | None, kind: str, steps_per_epoch: int) -> None:
        """After ``epoch``'s last step: rank 0 validates, records the epoch, checkpoints at cursor
        ``(epoch + 1, 0)`` with that record, and reports; every rank then applies commands."""
        if not self.lead:  # rank 0 scores, checkpoints and reports for the gang
            self._check()
            return
        train, model, _ = self._parts()
        val_loss, val_acc, _ = evaluate(model, self._watched(val), kind)
        self.history.append(epoch_record(epoch + 1, self.meter.take_loss(), val_loss, val_acc, kind))
        log.info(
            "job %s epoch %d/%d: val loss %.4f accuracy %.4f", self.job, epoch + 1, self.spec.epochs, val_loss, val_acc
        )
        self._checkpoint()
        self._report(self._progress(epoch + 1, steps_per_epoch, train))
        # the router judges the epoch at this report (early stopping, a study's pruner): its stop applies here
        self.reporter.await_verdict()
        self._check()

    def _progress(self, epoch: int, steps_per_epoch: int, loader: RemoteLoader) -> dict:
        """What rank 0 reports; ``samples`` counts the whole gang (every rank trains as many)."""
        return progress_report(
            self.meter,
            loader,
            epoch=epoch,
            epochs=self.spec.epochs,
            step=self.step,
            steps_per_epoch=steps_per_epoch,
            world_size=self.task.world_size,
            state=self.controls.state,
            last_checkpoint=self.last_checkpoint,
            resumed_from=self.resumed_from,
            history=self.history,
        )

    def _watched(self, batches):
        """``batches``, feeding the watchdog between them."""
        for batch in batches:
            self.notifier.watchdog()
            yield batch

    def _evaluate(self, model: nn.Module, provider: dict) -> Evaluation:
        """The final test evaluation, on a live replica of the provider (:func:`.final_eval.score_final`)."""
        return score_final(
            model,
            self.job,
            self.spec,
            provider,
            link=self.link,
            identity=self.identity,
            settings=self.settings,
            check=self._while_scoring,
        )

    def _while_scoring(self) -> None:
        """During the final evaluation: the watchdog is fed and commands apply (a shutdown hands
        the job back; its epoch-end checkpoint resumes it at this evaluation)."""
        self.notifier.watchdog()
        self.controls.check()

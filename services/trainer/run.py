"""One training task, from Resolve to PushResult: the part of the trainer that does the work."""

from __future__ import annotations

import logging
import math
import queue
import time
from dataclasses import dataclass, field

import orjson
import torch
from safetensors.torch import save as save_safetensors
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from libbus.client import Identity
from libbus.config import Settings
from libbus.errors import BadRequest, BusError, NotFound, PeerTimeout, Unavailable
from libbus.jobs import SETTABLE, JobSpec
from libbus.link import Link
from libbus.loader import RemoteLoader, pick_provider
from libbus.messages import Checkpointed, Command, Evaluate, Evaluation, Message, Progress, Resolve, Task
from services.models import TOKENS, batch_loss, build_model, dataset_kind, evaluate
from services.sdnotify import Notifier

from .audit import Audit
from .checkpoint import (
    CheckpointError,
    job_dir,
    prune,
    read_checkpoint,
    restore_checkpoint,
    save_checkpoint,
    save_model,
)
from .control import Controls, Lost, Stopped
from .evaltask import adopt_checkpoint, current_weights, run_evaluation
from .evaluation import LiveEvaluations
from .failures import describe_failure
from .failures import deterministic as _deterministic
from .final_eval import EVALUATE_TIMEOUT_S, score_on_provider
from .gang import Code, Gang, GangError, advertised_host
from .optim import apply_hyper, make_optimizer
from .reports import Reporter

__all__ = ["TaskRun"]

log = logging.getLogger(__name__)


def _perplexity(loss: float) -> float:
    """exp(mean next-token loss), capped so that a diverged run reports a number JSON can carry."""
    return math.exp(min(loss, 700.0))


@dataclass
class Meter:
    """Running throughput and data-wait figures for progress reports."""

    started: float = field(default_factory=time.monotonic)
    samples: int = 0
    loss_sum: float = 0.0
    loss_n: int = 0

    def add(self, n: int, loss: float) -> None:
        self.samples += n
        self.loss_sum += loss * n
        self.loss_n += n

    def take_loss(self) -> float:
        loss = self.loss_sum / self.loss_n if self.loss_n else float("nan")
        self.loss_sum, self.loss_n = 0.0, 0
        return loss


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
        #: The gang's process group could not be left: this process must not take another job.
        self.unclean = False
        self._shutting_down = False
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
            evaluate=self._evaluate_now,
            adopt=self._adopt,
            model=self._current_model,
        )

    def run(self) -> tuple[str, dict, str]:
        if self.spec.task == "evaluate":  # score a stored model, no training (services/trainer/evaltask.py)
            return run_evaluation(self.task, self.spec, self.settings, self.link, self.identity)
        # a live evaluation's acknowledgement goes before the result; a trainer shutting down waits less
        evaluation_wait_s = EVALUATE_TIMEOUT_S
        try:
            return "succeeded", self._train(), ""
        except Stopped as stop:
            result = {"history": self.history, "checkpoint": self.last_checkpoint}
            if stop.handback:
                evaluation_wait_s = self.settings.request_timeout_s
                return "queued", result, f"trainer {self.identity.name} shutting down"
            return "stopped", result, ""
        except Lost:
            evaluation_wait_s = 0.0  # the router takes nothing more of this job from here
            return "lost", {}, str(self.reporter.lost)
        except BusError as err:
            return self._failed(err)
        except RuntimeError as err:
            if self.gang is not None and not _deterministic(err):
                # a collective inside backward() (DDP) breaks when another rank is gone
                return self._failed(GangError(f"rank {self.task.rank}: the gang broke: {err}"))
            return self._failed(err)
        except Exception as err:  # noqa: BLE001 - whatever the job's model or data raise, the trainer lives on
            return self._failed(err)
        finally:
            if self.audit is not None:
                self.audit.close()
            if self.evaluations.running:
                with self.notifier.extended(evaluation_wait_s):
                    self.evaluations.join(evaluation_wait_s)
            if self.gang is not None and not self.gang.close():
                self.unclean = True

    def _failed(self, err: Exception) -> tuple[str, dict, str]:
        """The job ends ``failed`` with the exception's type, message and a hint; only a peer that
        did not answer or is gone (a provider, a rank of the gang) makes it retryable: a model, a
        spec or a device that fails here fails the same way on the next trainer."""
        retryable = isinstance(err, (PeerTimeout, Unavailable, NotFound))
        error = describe_failure(err, self.spec)
        if retryable or isinstance(err, BusError):
            log.error("job %s failed: %s", self.job, error)
        else:
            log.error("job %s failed: %s", self.job, error, exc_info=err)
        return "failed", {"history": self.history, "retryable": retryable}, error

    # -- what commands call ---------------------------------------------------------------------
    def _set_hyper(self, changes: dict) -> dict:
        """``busctl job set``: the optimizer's param groups change now, the spec with them."""
        spec = self.spec.with_hyper(changes)
        apply_hyper(self.optimizer, spec)
        self.spec = spec
        return spec.to_dict()

    def _evaluate_now(self, done) -> None:
        """``busctl job eval``: copy the weights here, between batches; score them in the background."""
        self.evaluations.start(
            self.model,
            {"name": self.spec.model, "kwargs": self.spec.model_kwargs},
            self.spec.dataset,
            self.provider,
            step=self.step,
            epoch=self.train.epoch + 1,
            done=done,
        )

    def _adopt(self, args: dict) -> dict:
        """Population-based training: load another job's checkpoint (weights and optimizer state) and
        go on from here with this job's own data position and hyper-parameters."""
        return adopt_checkpoint(self, args)

    def _current_model(self) -> tuple[dict, bytes]:
        """``busctl job model --current``: the weights now, between two steps."""
        return current_weights(self)

    def _before_stop(self) -> None:
        """Stopped or handed back, the job can resume exactly here; if this checkpoint cannot be
        written, it resumes from the last one (what it trained since is done again). The gang's
        other ranks stop at this same step."""
        if self.gang is not None:
            try:
                self.gang.sync(Code.STOP, self._hyper())
            except GangError as err:  # the others are gone already: the stop stands
                log.warning("job %s: %s", self.job, err)
        self._checkpoint_quietly()

    def _checkpoint_quietly(self) -> None:
        if self.model is None or not (self.step or self.last_checkpoint):
            return
        try:
            self._checkpoint()
        except CheckpointError as err:
            log.error("job %s: no checkpoint on stop: %s", self.job, err)

    # -- the gang (world_size > 1) -----------------------------------------------------------------
    def _hyper(self) -> dict:
        return {k: getattr(self.spec, k) for k in SETTABLE}

    def _check(self) -> None:
        """Apply commands: :meth:`Controls.check`, and in a gang every rank does what rank 0 decided,
        at this same step (:mod:`.gang`)."""
        if self.gang is None:
            self.controls.check()
            return
        if self.lead:
            self.controls.check()  # a stop has told the gang already (_before_stop)
            self._follow(*self.gang.sync(Code.RUN, self._hyper()))
            return
        self._follow(*self.gang.sync(self._own_code(), self._hyper()))

    def _own_code(self) -> Code:
        """A rank above 0 hears no commands from the router; only its own trainer's shutdown."""
        while not self.controls.commands.empty():
            if self.controls.commands.get_nowait().command == "shutdown":
                self._shutting_down = True
        return Code.HANDBACK if self._shutting_down else Code.RUN

    def _follow(self, code: Code, hyper: dict) -> None:
        """Do what the gang decided: take rank 0's hyper-parameters, wait out a pause, end."""
        if not self.lead and hyper != self._hyper():
            self._set_hyper(hyper)
        while code == Code.PAUSE and not self.lead:
            self.notifier.watchdog()
            code, hyper = self.gang.sync(self._own_code(), self._hyper())
            if hyper != self._hyper():
                self._set_hyper(hyper)
        if code == Code.RUN or (self.lead and code == Code.PAUSE):
            return
        if self.lead:  # another rank's trainer is shutting down: the gang hands the job back
            log.info("job %s: a rank of the gang is shutting down; handing the job back", self.job)
            self._checkpoint_quietly()
        raise Stopped(handback=code == Code.HANDBACK)

    def _while_paused(self) -> None:
        """Called while rank 0 (or a lone trainer) is paused: reports, and keeps the gang paused."""
        self._maybe_report()
        if self.gang is not None:
            self._follow(*self.gang.sync(Code.PAUSE, self._hyper()))

    # -- checkpoints ------------------------------------------------------------------------------
    def _checkpoint(self) -> dict:
        """Write a checkpoint (unless the last one is of this very step and epoch record: the
        epoch-end one after the last step's adds the epoch's validation) and report it."""
        if self.last_checkpoint is not None and self._checkpointed == (self.step, len(self.history)):
            return self.last_checkpoint
        extra = {"history": self.history, "loss_sum": self.meter.loss_sum, "loss_n": self.meter.loss_n}
        cursor = self.train.state_dict()
        record = save_checkpoint(
            self.directory,
            step=self.step,
            epoch=cursor["epoch"],
            cursor=cursor,
            model=self.model,
            optimizer=self.optimizer,
            extra=extra,
            epoch_end=self._checkpointed[0] == self.step,
        )
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
        try:
            data = self._checkpoint_bytes(record)
            self.train.load_state_dict(record.get("cursor") or {})
            restored = restore_checkpoint(data, record, self.model, self.optimizer)
        except BusError as err:
            log.warning("job %s: cannot resume from %s: %s; starting over", self.job, record.get("path"), err)
            self.resumed_from = {"error": str(err)}
            self.train.epoch, self.train.position = 0, 0
            return False
        apply_hyper(self.optimizer, self.spec)  # the stored spec has any `set` made since
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
            self.train.epoch,
            self.train.position,
        )
        return True

    def _checkpoint_bytes(self, record: dict) -> bytes:
        if self.gang is None:
            return read_checkpoint(record, self.settings.checkpoint_dir)
        data, error = b"", None
        if self.lead:
            try:
                data = read_checkpoint(record, self.settings.checkpoint_dir)
            except CheckpointError as err:
                error = err
        data = self.gang.share(data)  # empty: rank 0 cannot read it, every rank starts over
        if error is not None:
            raise error
        if not data:
            raise CheckpointError(f"rank 0 could not read checkpoint {record.get('path')}")
        return data

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
            self._report(self._progress(self.train.epoch, len(self.train), self.train))

    def _resolve(self) -> Message:
        """The dataset's providers. None online is waited out for ``provider_wait_s`` (a provider
        restarting), as a loader waits for its lost providers, before the attempt fails."""
        deadline = time.monotonic() + self.settings.provider_wait_s
        while True:
            try:
                return self.link.request(Resolve(dataset=self.spec.dataset), timeout_s=self.settings.request_timeout_s)
            except NotFound:
                if time.monotonic() >= deadline:
                    raise
            self.notifier.watchdog()
            time.sleep(0.25)

    def _train(self) -> dict:
        spec, s = self.spec, self.settings
        resolved = self._resolve()
        provider = self.provider = pick_provider(resolved.providers, self.identity.host_id)
        info = resolved.info
        log.info(
            "job %s: %s on %s from %s (%s)", self.job, spec.model, spec.dataset, provider["name"], provider["endpoint"]
        )
        device = self._device()
        if self.task.world_size > 1:
            self.gang = Gang(self.task, self.link, advertised_host(s.advertise, s.router), device, s.request_timeout_s)
        torch.manual_seed(spec.seed)
        model = self.model = build_model(spec.model, info, **spec.model_kwargs).to(device)
        optimizer = self.optimizer = make_optimizer(spec, model.parameters())
        kind = dataset_kind(info)
        # Every replica: requests spread over them, and the loaders ask again when none answers.
        common = {
            "provider": resolved.providers,
            "provider_wait_s": s.provider_wait_s,
            "resolver": lambda timeout_s: (
                self.link.request(Resolve(dataset=spec.dataset), timeout_s=timeout_s).providers
            ),
            "token": self.identity.token,
            "batch_size": spec.batch_size,
            "inflight": s.inflight,
            "timeout_s": s.request_timeout_s,
            "retries": s.request_retries,
            "name": self.identity.name,
            "device": str(device),
            "shm": s.shm,
            "shm_slots": s.shm_slots,
            "host_id": self.identity.host_id,
            "curve": self.identity.curve,
        }
        train = self.train = RemoteLoader(
            spec.dataset,
            split="train",
            shuffle=spec.shuffle,
            block_size=spec.block_size,
            seed=spec.seed,
            **self._shard(),
            **common,
        )
        val = RemoteLoader(spec.dataset, split="val", shuffle=False, **common) if self.lead else None
        if self.task.resume and not self._resume(self.task.resume):
            torch.manual_seed(spec.seed)  # a checkpoint half loaded must not leak into the fresh start
            model = self.model = build_model(spec.model, info, **spec.model_kwargs).to(device)
            optimizer = self.optimizer = make_optimizer(spec, model.parameters())
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
                for x, y in train:
                    if self.audit is not None:
                        self.audit.record(epoch, self.step + 1, x, y)
                    optimizer.zero_grad(set_to_none=True)
                    loss = batch_loss(net, x, y, kind)
                    loss.backward()
                    optimizer.step()
                    self.step += 1
                    meter.add(len(x), loss.item())
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
        result = {
            **self._progress(spec.epochs, steps_per_epoch, train),
            "val_loss": self.history[-1]["val_loss"],
            "val_accuracy": self.history[-1]["val_accuracy"],
            "provider": provider["name"],
            "world_size": self.task.world_size,
        }
        if kind == TOKENS:
            result["val_perplexity"] = self.history[-1]["val_perplexity"]
        if spec.evaluate:
            evaluation = self._evaluate(model, provider)
            result.update(test_loss=evaluation.loss, test_accuracy=evaluation.accuracy, test_n=evaluation.n)
            if kind == TOKENS:
                result["test_perplexity"] = _perplexity(evaluation.loss)
            log.info(
                "job %s: provider-side test accuracy %.4f on %d samples", self.job, evaluation.accuracy, evaluation.n
            )
        result["model"] = save_model(
            self.directory,
            model,
            {
                "job": self.job,
                "model": spec.model,
                "step": str(self.step),
                "model_kwargs": orjson.dumps(spec.model_kwargs).decode(),
            },
        )
        return result

    def _end_epoch(self, epoch: int, val: RemoteLoader | None, kind: str, steps_per_epoch: int) -> None:
        """After ``epoch``'s last step: rank 0 validates, records the epoch, checkpoints at cursor
        ``(epoch + 1, 0)`` with that record, and reports; every rank then applies commands."""
        if not self.lead:  # rank 0 scores, checkpoints and reports for the gang
            self._check()
            return
        val_loss, val_acc, _ = evaluate(self.model, self._watched(val), kind)
        epoch_record = {
            "epoch": epoch + 1,
            "train_loss": self.meter.take_loss(),
            "val_loss": val_loss,
            "val_accuracy": val_acc,
        }
        if kind == TOKENS:  # per-token loss; perplexity is how language models are compared
            epoch_record["val_perplexity"] = _perplexity(val_loss)
        self.history.append(epoch_record)
        log.info(
            "job %s epoch %d/%d: val loss %.4f accuracy %.4f", self.job, epoch + 1, self.spec.epochs, val_loss, val_acc
        )
        self._checkpoint()
        self._report(self._progress(epoch + 1, steps_per_epoch, self.train))
        self._check()

    def _shard(self) -> dict:
        """A gang's rank reads its own shard of ``train``; all as many batches (DDP steps together)."""
        if self.task.world_size == 1:
            return {}
        return {"rank": self.task.rank, "world_size": self.task.world_size, "drop_uneven": True}

    def _progress(self, epoch: int, steps_per_epoch: int, loader: RemoteLoader) -> dict:
        """What rank 0 reports; ``samples`` counts the whole gang (every rank trains as many)."""
        meter = self.meter
        elapsed = max(1e-9, time.monotonic() - meter.started)
        last_loss = meter.loss_sum / meter.loss_n if meter.loss_n else None
        return {
            "epoch": epoch,
            "epochs": self.spec.epochs,
            "step": self.step,
            "steps_per_epoch": steps_per_epoch,
            "loss": last_loss,
            "samples": meter.samples * self.task.world_size,
            "samples_per_s": meter.samples * self.task.world_size / elapsed,
            "data_wait_s": loader.wait_s,
            "transport": loader.transport,
            "data_wait_pct": 100.0 * loader.wait_s / elapsed,
            "elapsed_s": elapsed,
            "state": self.controls.state,
            "checkpoint_step": self.last_checkpoint["step"] if self.last_checkpoint else None,
            "resumed_from": self.resumed_from,
            "history": self.history,
        }

    def _device(self) -> torch.device:
        try:
            device = torch.device(self.spec.device)
        except RuntimeError as err:
            raise BadRequest(f"job device {self.spec.device!r} is not a torch device: {err}") from err
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BadRequest(f"job asks for {device} but this trainer has no CUDA device")
        return device

    def _watched(self, batches):
        """``batches``, feeding the watchdog between them."""
        for batch in batches:
            self.notifier.watchdog()
            yield batch

    def _evaluate(self, model: nn.Module, provider: dict) -> Evaluation:
        try:  # a live replica: the provider read from at the start may have gone since
            live = self.link.request(Resolve(dataset=self.spec.dataset), timeout_s=self.settings.request_timeout_s)
            provider = pick_provider(live.providers, self.identity.host_id)
        except BusError as err:
            log.warning("job %s: evaluating on %s (the router did not answer: %s)", self.job, provider["name"], err)
        blob = save_safetensors({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()})
        msg = Evaluate(
            dataset=self.spec.dataset,
            job=self.job,
            model={"name": self.spec.model, "kwargs": self.spec.model_kwargs},
            frames=[blob],
        )
        s = self.settings
        return score_on_provider(
            msg,
            provider,
            self.identity,
            link=self.link,
            request_timeout_s=s.request_timeout_s,
            provider_wait_s=s.provider_wait_s,
            check=self._while_scoring,
        )

    def _while_scoring(self) -> None:
        """During the final evaluation: the watchdog is fed and commands apply (a shutdown hands
        the job back; its epoch-end checkpoint resumes it at this evaluation)."""
        self.notifier.watchdog()
        self.controls.check()

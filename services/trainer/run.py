"""One training task, from Resolve to PushResult: the part of the trainer that does the work."""

from __future__ import annotations

import logging
import math
import queue
import time
from dataclasses import dataclass, field

import torch
from safetensors.torch import save as save_safetensors
from torch import nn

from libbus.client import Client, Identity
from libbus.config import Settings
from libbus.errors import BadRequest, BusError
from libbus.jobs import JobSpec
from libbus.link import Link
from libbus.curve import curve_key_of
from libbus.loader import RemoteLoader, pick_provider
from libbus.messages import Command, Evaluate, Evaluation, Progress, Resolve, Task
from services.models import TOKENS, batch_loss, build_model, dataset_kind, evaluate

__all__ = ["Stopped", "TaskRun"]

log = logging.getLogger(__name__)

#: An evaluation scores the whole test split on the provider: give it longer than a batch.
EVALUATE_TIMEOUT_S = 300.0


def _perplexity(loss: float) -> float:
    """exp(mean next-token loss), capped so that a diverged run reports a number JSON can carry."""
    return math.exp(min(loss, 700.0))


class Stopped(Exception):
    """The router asked this task to stop."""


def make_optimizer(spec: JobSpec, params) -> torch.optim.Optimizer:
    if spec.optimizer == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    return torch.optim.Adam(params, lr=spec.lr, weight_decay=spec.weight_decay)


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
    """Runs ``task`` to its end and returns the ``(state, result, error)`` to push to the router."""

    def __init__(self, task: Task, settings: Settings, link: Link, identity: Identity,
                 commands: queue.Queue[Command]):
        self.task = task
        self.job = task.job
        self.spec = JobSpec.from_dict(task.spec)
        self.settings = settings
        self.link = link
        self.identity = identity
        self.commands = commands
        self.history: list[dict] = []

    def run(self) -> tuple[str, dict, str]:
        try:
            return "succeeded", self._train(), ""
        except Stopped:
            return "stopped", {"history": self.history}, ""
        except BusError as err:
            log.error("job %s failed: %s", self.job, err)
            return "failed", {"history": self.history}, f"{type(err).__name__}: {err}"

    def _check_commands(self) -> None:
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return
            if cmd.job == self.job and cmd.command in ("stop", "shutdown"):
                log.info("job %s: stop received", self.job)
                raise Stopped

    def _report(self, progress: dict) -> None:
        reply = self.link.request(Progress(job=self.job, progress=progress), timeout_s=5.0)
        if reply.detail.get("stop"):  # a stop whose push was lost still arrives here
            raise Stopped

    def _train(self) -> dict:
        spec, s = self.spec, self.settings
        resolved = self.link.request(Resolve(dataset=spec.dataset), timeout_s=s.request_timeout_s)
        provider = pick_provider(resolved.providers, self.identity.host_id)
        info = resolved.info
        log.info("job %s: %s on %s from %s (%s)", self.job, spec.model, spec.dataset, provider["name"],
                 provider["endpoint"])
        device = self._device()
        torch.manual_seed(spec.seed)
        model = build_model(spec.model, info, **spec.model_kwargs).to(device)
        optimizer = make_optimizer(spec, model.parameters())
        kind = dataset_kind(info)
        # Every replica: requests spread over them, and the loaders ask again when none answers.
        common = {"provider": resolved.providers, "provider_wait_s": s.provider_wait_s,
                  "resolver": lambda timeout_s: self.link.request(Resolve(dataset=spec.dataset),
                                                                  timeout_s=timeout_s).providers,
                  "token": self.identity.token, "batch_size": spec.batch_size,
                  "inflight": s.inflight, "timeout_s": s.request_timeout_s, "retries": s.request_retries,
                  "name": self.identity.name, "device": str(device), "shm": s.shm, "shm_slots": s.shm_slots,
                  "host_id": self.identity.host_id, "curve": self.identity.curve}
        train = RemoteLoader(spec.dataset, split="train", shuffle=spec.shuffle, block_size=spec.block_size,
                             seed=spec.seed, **common)
        val = RemoteLoader(spec.dataset, split="val", shuffle=False, **common)
        meter = Meter()
        steps_per_epoch = len(train)
        last_report = 0.0
        step = 0
        try:
            for epoch in range(spec.epochs):
                train.set_epoch(epoch)
                model.train()
                for x, y in train:
                    self._check_commands()
                    optimizer.zero_grad(set_to_none=True)
                    loss = batch_loss(model, x, y, kind)
                    loss.backward()
                    optimizer.step()
                    step += 1
                    meter.add(len(x), loss.item())
                    now = time.monotonic()
                    if now - last_report >= s.progress_interval_s:
                        last_report = now
                        self._report(self._progress(epoch, step, steps_per_epoch, meter, train))
                val_loss, val_acc, _ = evaluate(model, val, kind)
                epoch_record = {"epoch": epoch + 1, "train_loss": meter.take_loss(),
                                "val_loss": val_loss, "val_accuracy": val_acc}
                if kind == TOKENS:  # per-token loss; perplexity is how language models are compared
                    epoch_record["val_perplexity"] = _perplexity(val_loss)
                self.history.append(epoch_record)
                log.info("job %s epoch %d/%d: val loss %.4f accuracy %.4f", self.job, epoch + 1,
                         spec.epochs, val_loss, val_acc)
                self._report(self._progress(epoch + 1, step, steps_per_epoch, meter, train))
        finally:
            train.close()
            val.close()
        result = {**self._progress(spec.epochs, step, steps_per_epoch, meter, train),
                  "val_loss": self.history[-1]["val_loss"], "val_accuracy": self.history[-1]["val_accuracy"],
                  "provider": provider["name"]}
        if kind == TOKENS:
            result["val_perplexity"] = self.history[-1]["val_perplexity"]
        if spec.evaluate:
            self._check_commands()
            evaluation = self._evaluate(model, provider)
            result.update(test_loss=evaluation.loss, test_accuracy=evaluation.accuracy, test_n=evaluation.n)
            if kind == TOKENS:
                result["test_perplexity"] = _perplexity(evaluation.loss)
            log.info("job %s: provider-side test accuracy %.4f on %d samples", self.job,
                     evaluation.accuracy, evaluation.n)
        return result

    def _progress(self, epoch: int, step: int, steps_per_epoch: int, meter: Meter,
                  loader: RemoteLoader) -> dict:
        elapsed = max(1e-9, time.monotonic() - meter.started)
        last_loss = meter.loss_sum / meter.loss_n if meter.loss_n else None
        return {"epoch": epoch, "epochs": self.spec.epochs, "step": step, "steps_per_epoch": steps_per_epoch,
                "loss": last_loss, "samples": meter.samples, "samples_per_s": meter.samples / elapsed,
                "data_wait_s": loader.wait_s, "transport": loader.transport, "data_wait_pct": 100.0 * loader.wait_s / elapsed,
                "elapsed_s": elapsed, "history": self.history}

    def _device(self) -> torch.device:
        try:
            device = torch.device(self.spec.device)
        except RuntimeError as err:
            raise BadRequest(f"job device {self.spec.device!r} is not a torch device: {err}") from err
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BadRequest(f"job asks for {device} but this trainer has no CUDA device")
        return device

    def _evaluate(self, model: nn.Module, provider: dict) -> Evaluation:
        try:  # a live replica: the provider read from at the start may have gone since
            live = self.link.request(Resolve(dataset=self.spec.dataset), timeout_s=self.settings.request_timeout_s)
            provider = pick_provider(live.providers, self.identity.host_id)
        except BusError as err:
            log.warning("job %s: evaluating on %s (the router did not answer: %s)", self.job, provider["name"], err)
        blob = save_safetensors({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()})
        msg = Evaluate(dataset=self.spec.dataset, job=self.job,
                       model={"name": self.spec.model, "kwargs": self.spec.model_kwargs}, frames=[blob])
        with Client(provider["endpoint"], self.identity, timeout_s=EVALUATE_TIMEOUT_S, retries=0,
                    server_key=curve_key_of(provider)) as client:
            return client.request(msg)

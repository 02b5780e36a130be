"""The built-in training loop, written on the job API (:mod:`libbus.jobapi`) like any entrypoint.

A built-in job (one that names ``model``, not ``entrypoint``) runs :func:`train` in its attempt's
process with the same :class:`.jobapi.AttemptJob` an entrypoint gets: one way to run a job. Its
``job.params`` are the job's typed fields (``model``, ``model_kwargs``, ``optimizer``, ``lr``,
``momentum``, ``weight_decay``, ``epochs``, ``seed``, ``model_from``: :meth:`JobSpec.builtin_params`),
so ``busctl job set lr=...`` reaches it at the next step, as it reaches a user's function.

It trains the job's model (:func:`services.models.build_model`) with class cross-entropy, or
next-token loss on a token dataset (:func:`services.models.batch_loss`); validates on rank 0 after
every epoch and reports ``val_loss``, ``val_accuracy`` (and ``val_perplexity`` for tokens); and saves
the final weights, which the trainer then has the provider score on its private test split. Its
state is ``{"model": ..., "optimizer": ...}``: the checkpoint the job API writes with the cursors.

Beyond the public API it uses two things of its trainer: ``job.settings.job_modules`` (the modules a
``module:factory`` model may come from) and :meth:`.jobapi.AttemptJob.record_batch` (the audit of
what was trained on, when the trainer's operator sets ``audit_dir``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from libbus.errors import BadRequest
from libbus.jobs.spec import SETTABLE
from libbus.loader.remote import RemoteLoader
from services.models import TOKENS, batch_loss, build_model, dataset_kind, evaluate, xy

from .jobapi import AttemptJob
from .optim import apply_hyper, make_optimizer
from .prepare import load_initial
from .progress import perplexity

__all__ = ["restore_into", "train"]

log = logging.getLogger(__name__)


def train(job: AttemptJob) -> None:
    """Train the built-in job ``job`` to its last epoch (see the module docstring)."""
    params = job.params
    loader = job.loader("train")
    val = job.loader("val") if job.rank == 0 else None  # rank 0 scores the whole val split for the gang
    kind = dataset_kind(loader.info)
    torch.manual_seed(params["seed"])
    model = build_model(params["model"], loader.info, params["model_kwargs"], allowed=job.settings.job_modules)
    model = model.to(job.device)
    optimizer = make_optimizer(job.spec, model.parameters())
    job.on_checkpoint(lambda: {"model": model, "optimizer": optimizer})
    state = job.restore()
    if state is not None:
        restore_into(model, optimizer, state)
    elif (weights := job.initial_model()) is not None:
        load_initial(model, weights, params["model_from"])  # a first attempt starts from those weights
    hyper = _set_hyper(optimizer, job.params, None)  # the stored spec has any `set` made since
    net: nn.Module = model
    if job.world_size > 1:
        device_ids = [job.device.index or 0] if job.device.type == "cuda" else None
        net = DistributedDataParallel(model, device_ids=device_ids)
    epochs = int(params["epochs"])
    if job.epochs_reported < min(loader.epoch, epochs):
        # resumed from a checkpoint taken after an epoch's last step but before its validation
        # (checkpoint_every, a stop, a SIGTERM there): the cursor says the epoch is done, its
        # record is not; validate it now, as the uninterrupted run did
        _end_epoch(job, model, val, kind)
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)
        model.train()
        for batch in loader:
            x, y = xy(batch)  # a named-field dataset's image and label
            job.record_batch(epoch, x, y)
            optimizer.zero_grad(set_to_none=True)
            loss = batch_loss(net, x, y, kind)
            loss.backward()
            optimizer.step()
            # commands apply here, where the loader's position is exactly the samples trained on
            job.step(loss=loss.item(), samples=len(x))
            hyper = _set_hyper(optimizer, job.params, hyper)
        _end_epoch(job, model, val, kind)
    job.save_model(model.state_dict())


def _end_epoch(job: AttemptJob, model: nn.Module, val: RemoteLoader | None, kind: str) -> None:
    """After an epoch's last step: rank 0 validates and reports the epoch (its checkpoint, at cursor
    ``(epoch + 1, 0)``, goes with the report); every rank reports, so the gang decides together."""
    if val is None:
        job.report()
        return
    val_loss, val_accuracy, _ = evaluate(model, val, kind)
    metrics = {"val_loss": val_loss, "val_accuracy": val_accuracy}
    if kind == TOKENS:  # per-token loss; perplexity is how language models are compared
        metrics["val_perplexity"] = perplexity(val_loss)
    job.report(**metrics)


def restore_into(model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """The model and optimizer of a restored state (a checkpoint of this same job)."""
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise BadRequest(f"the job's checkpoint does not fit its model and optimizer: {err}") from err


def _set_hyper(
    optimizer: torch.optim.Optimizer, params: Mapping[str, Any], last: dict[str, float] | None
) -> dict[str, float]:
    """Put the settable hyper-parameters of ``params`` on every param group when they changed since
    ``last`` (``busctl job set``, a study's PBT explore step); returns them."""
    hyper = {k: params[k] for k in SETTABLE}
    if hyper != last:
        apply_hyper(optimizer, hyper)
    return hyper

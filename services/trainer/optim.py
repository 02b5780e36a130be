"""The job's optimizer: built from its spec, and its settable hyper-parameters (``busctl job set``,
a study's PBT explore step) applied to it."""

from __future__ import annotations

import torch

from libbus.jobs.spec import JobSpec

__all__ = ["apply_hyper", "make_optimizer"]


def make_optimizer(spec: JobSpec, params) -> torch.optim.Optimizer:
    """``spec.optimizer`` (sgd or adam) over ``params`` with the spec's hyper-parameters."""
    if spec.optimizer == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    return torch.optim.Adam(params, lr=spec.lr, weight_decay=spec.weight_decay)


def apply_hyper(optimizer: torch.optim.Optimizer, spec: JobSpec) -> None:
    """Set the spec's settable hyper-parameters (``busctl job set``) on every param group."""
    for group in optimizer.param_groups:
        group["lr"] = spec.lr
        group["weight_decay"] = spec.weight_decay
        if "momentum" in group:
            group["momentum"] = spec.momentum

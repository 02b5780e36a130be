"""The job's optimizer: built from its spec, and its settable hyper-parameters (``busctl job set``,
a study's PBT explore step) applied to it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from libbus.jobs.spec import JobSpec

__all__ = ["apply_hyper", "make_optimizer"]


def make_optimizer(spec: JobSpec, params) -> torch.optim.Optimizer:
    """``spec.optimizer`` (sgd or adam) over ``params`` with the spec's hyper-parameters."""
    if spec.optimizer == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    return torch.optim.Adam(params, lr=spec.lr, weight_decay=spec.weight_decay)


def apply_hyper(optimizer: torch.optim.Optimizer, values: Mapping[str, Any]) -> None:
    """Set the settable hyper-parameters ``values`` (``lr``, ``weight_decay``, ``momentum``: what
    ``busctl job set`` changes) on every param group."""
    for group in optimizer.param_groups:
        group["lr"] = values["lr"]
        group["weight_decay"] = values["weight_decay"]
        if "momentum" in group:
            group["momentum"] = values["momentum"]

"""Evaluators a provider's operator might install (tests/evaluation/test_evaluators.py allows this module in the
test provider's ``evaluator_modules``). Each follows the contract of docs/python-api.md, "Scoring your
model on the private test split"."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Mapping

import torch
from torch import nn


def linear(
    state_dict: dict[str, torch.Tensor], batches: Iterable, info: dict, *, temperature: float = 1.0
) -> Mapping[str, float]:
    """A linear classifier ``x.flatten() @ weight.T + bias`` (a model no built-in names), with a
    ``temperature`` its caller chooses; reports top-2 accuracy besides loss and accuracy."""
    weight, bias = state_dict["weight"], state_dict["bias"]
    total, correct, top2, n = 0.0, 0, 0, 0
    for x, y in batches:
        logits = (x.reshape(len(x), -1).float() @ weight.T + bias) / temperature
        targets = y.long().reshape(-1)
        losses = nn.functional.cross_entropy(logits, targets, reduction="none").clamp(max=info["loss_clip"])
        total += float(losses.sum())
        correct += int((logits.argmax(1) == targets).sum())
        top2 += int((logits.topk(2, dim=1).indices == targets[:, None]).any(1).sum())
        n += len(targets)
    return {"loss": total / n, "accuracy": correct / n, "top2": top2 / n}


def fields(state_dict: dict[str, torch.Tensor], batches: Iterable, info: dict) -> Mapping[str, float]:
    """On a named-field dataset: a batch is ``{field: tensor}``; a constant-class predictor."""
    guess = int(state_dict["guess"].item())
    correct, n = 0, 0
    for batch in batches:
        labels = batch["label"].long().reshape(-1)
        correct += int((labels == guess).sum())
        n += len(labels)
    return {"loss": 1.0, "accuracy": correct / n}


def no_accuracy(state_dict: dict[str, torch.Tensor], batches: Iterable, info: dict) -> Mapping[str, float]:
    """Breaks the contract: no accuracy."""
    return {"loss": 0.5}


def forever(state_dict: dict[str, torch.Tensor], batches: Iterable, info: dict) -> Mapping[str, float]:
    """Reads the split again and again: only the provider's bound ends it."""
    while True:
        for _ in batches:
            pass


#: While set, :func:`held` evaluations wait (at most a minute): a test's two providers run in its process.
HOLD = threading.Event()


def held(
    state_dict: dict[str, torch.Tensor], batches: Iterable, info: dict, *, while_exists: str = ""
) -> Mapping[str, float]:
    """Waits after each batch while :data:`HOLD` is set, or (a provider in a process of its own) while
    the file ``while_exists`` does; then a constant score."""
    for _ in batches:
        until = time.monotonic() + 60
        while (HOLD.is_set() or (while_exists and os.path.exists(while_exists))) and time.monotonic() < until:
            time.sleep(0.02)
    return {"loss": 1.0, "accuracy": 0.25}


def mlp(
    state_dict: dict[str, torch.Tensor], batches: Iterable, info: dict, *, hidden: int = 256
) -> Mapping[str, float]:
    """The built-in ``mlp``, built here from the weights, scored with top-2 accuracy as well."""
    from services.models import as_float, build_model

    model = build_model("mlp", info, {"hidden": hidden})
    model.load_state_dict(state_dict)
    model.eval()
    total, correct, top2, n = 0.0, 0, 0, 0
    for x, y in batches:
        logits, targets = model(as_float(x)), y.long()
        total += float(
            nn.functional.cross_entropy(logits, targets, reduction="none").clamp(max=info["loss_clip"]).sum()
        )
        correct += int((logits.argmax(1) == targets).sum())
        top2 += int((logits.topk(2, 1).indices == targets[:, None]).any(1).sum())
        n += len(targets)
    return {"loss": total / n, "accuracy": correct / n, "top2": top2 / n}

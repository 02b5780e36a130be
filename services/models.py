"""Built-in models, and loading a user's own (``module:factory``), shared by trainer and provider.

Every model is built from the dataset's DatasetInfo (input shape, number of classes), so the same
spec builds the same architecture on the trainer that trains it and the provider that evaluates it.
"""

from __future__ import annotations

import importlib
import math

import torch
from torch import nn

from libbus.errors import BadRequest

__all__ = ["build_model", "evaluate", "MODELS"]


def _mlp(info: dict, hidden: int = 256) -> nn.Module:
    features = math.prod(info["sample_shape"])
    return nn.Sequential(nn.Flatten(), nn.Linear(features, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden // 2), nn.ReLU(),
                         nn.Linear(hidden // 2, info["num_classes"]))


def _cnn(info: dict, width: int = 16) -> nn.Module:
    shape = info["sample_shape"]
    if len(shape) != 3:
        raise BadRequest(f"model 'cnn' needs image samples (C, H, W); this dataset's are {shape}")
    channels = shape[0]
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, width * 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        nn.Linear(width * 2 * 16, 64), nn.ReLU(), nn.Linear(64, info["num_classes"]))


MODELS = {"mlp": _mlp, "cnn": _cnn}


def build_model(name: str, info: dict, **kwargs) -> nn.Module:
    """The model ``name`` for a dataset described by ``info`` (DatasetInfo fields).

    ``name`` is a built-in (``mlp``, ``cnn``) or ``package.module:factory``, a callable taking
    ``(info, **kwargs)`` and returning an ``nn.Module``. Raises :class:`BadRequest` for an unknown
    model or arguments it does not take.
    """
    if info.get("num_classes", 0) < 1:
        raise BadRequest("classification models need a dataset with num_classes >= 1")
    if name in MODELS:
        factory = MODELS[name]
    elif ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise BadRequest(f"model {name!r}: cannot import {attr} from {module_name}: {err}") from err
    else:
        raise BadRequest(f"unknown model {name!r}; built-ins are {', '.join(MODELS)}, "
                         "or give package.module:factory")
    try:
        model = factory(info, **kwargs)
    except TypeError as err:
        raise BadRequest(f"model {name!r}: bad arguments {kwargs}: {err}") from err
    if not isinstance(model, nn.Module):
        raise BadRequest(f"model {name!r}: factory returned {type(model).__name__}, not a torch Module")
    return model


@torch.no_grad()
def evaluate(model: nn.Module, batches) -> tuple[float, float, int]:
    """Mean cross-entropy loss, accuracy and sample count of ``model`` over ``(x, y)`` batches."""
    model.eval()
    total_loss, correct, n = 0.0, 0, 0
    for x, y in batches:
        logits = model(x)
        total_loss += nn.functional.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
        n += len(y)
    if n == 0:
        return 0.0, 0.0, 0
    return total_loss / n, correct / n, n

"""Tensor helpers a training script needs next to its loader (public via ``from libbus import ...``)."""

from __future__ import annotations

import torch

__all__ = ["as_float"]


def as_float(x: torch.Tensor) -> torch.Tensor:
    """Model input from a batch of samples: integer images become float, float ones pass untouched.

    File sources serve images as stored (MNIST IDX and CIFAR-10 are uint8, 0..255), so no bytes are
    inflated on the wire or in a ring slot; the one conversion happens here, on the trainer's (or
    evaluator's) device. ``uint8`` is scaled to ``[0, 1]``, the convention of torchvision's
    ``ToTensor``; other integer types keep their values (their range says nothing general).
    """
    if x.is_floating_point():
        return x
    if x.dtype == torch.uint8:
        return x.float().div_(255)
    return x.float()

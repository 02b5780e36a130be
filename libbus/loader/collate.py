"""A decoded batch of named fields → what the loader yields: a dict of tensors.

Fixed fields become one tensor each. Variable fields follow the loader's ``collate`` choice:

- ``"pad"``: one tensor padded with zeros to the batch's longest in each varying dimension, plus
  ``<name>_lengths``, int64: shape ``(n,)`` with each sample's size along the one varying
  dimension, or ``(n, k)`` with its sizes along each of ``k`` varying dimensions (an image
  ``(?, ?, 3)`` gets ``(n, 2)``: heights and widths);
- ``"list"``: a list of one tensor per sample, each its own shape.

Bytes and text fields are lists of ``bytes`` / ``str`` either way. A datasets of exactly two
fixed fields ``x`` and ``y`` never comes here: the loader yields ``(x, y)`` for it, as always.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from libbus.errors import BadRequest

__all__ = ["COLLATES", "Collated", "check_collate", "collate"]

COLLATES = ("pad", "list")
#: One field of a yielded batch: a tensor (fixed, or padded with its ``NAME_lengths`` beside it), a tensor
#: per sample (``collate="list"``), or the samples' bytes or texts.
Collated = torch.Tensor | list[torch.Tensor] | list[bytes] | list[str]


def check_collate(how: str) -> str:
    """``how``, if it is a collate choice. Raises :class:`BadRequest` naming the choices."""
    if how not in COLLATES:
        raise BadRequest(f"collate must be one of {', '.join(map(repr, COLLATES))}, got {how!r}")
    return how


def _tensor(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(arr)
    return tensor if device.type == "cpu" else tensor.to(device)


def _pad(samples: list[np.ndarray], varying: list[int], device: torch.device):
    """(padded batch, lengths) of per-sample arrays (at least one), ``varying`` their varying dims."""
    n = len(samples)
    sizes = np.array([a.shape for a in samples], np.int64).reshape(n, samples[0].ndim)
    top = sizes.max(axis=0)
    padded = np.zeros((n, *top.tolist()), samples[0].dtype)
    for row, arr in enumerate(samples):
        where: tuple[int | slice, ...] = (row, *(slice(0, s) for s in arr.shape))
        padded[where] = arr
    lengths = np.ascontiguousarray(sizes[:, varying[0]] if len(varying) == 1 else sizes[:, varying])
    return _tensor(padded, device), _tensor(lengths, device)


def collate(batch: dict[str, Any], shapes: list, dtypes: list, how: str, device: torch.device) -> dict[str, Collated]:
    """The dict the loader yields for ``batch`` (from :func:`libbus.wire.fields.decode_frames` or
    :func:`~libbus.wire.fields.unpack_slot`: already checked against ``shapes`` and ``dtypes``, the
    reply's, field by field, ``-1`` where a dimension varies)."""
    out: dict[str, Collated] = {}
    for (name, value), shape, dtype in zip(batch.items(), shapes, dtypes):
        if isinstance(value, np.ndarray):
            out[name] = _tensor(value, device)
        elif dtype in ("bytes", "str"):
            out[name] = value
        elif how == "list":
            out[name] = [_tensor(arr, device) for arr in value]
        else:
            varying = [i for i, d in enumerate(shape[1:]) if d == -1]
            if not value:  # an empty batch: nothing to pad, sizes from the fixed dimensions
                top = [0 if d == -1 else d for d in shape[1:]]
                out[name] = torch.zeros((0, *top), dtype=torch.from_numpy(np.empty(0, dtype)).dtype)
                out[f"{name}_lengths"] = torch.zeros(
                    (0,) if len(varying) == 1 else (0, len(varying)), dtype=torch.int64
                )
                continue
            out[name], out[f"{name}_lengths"] = _pad(value, varying, device)
    return out

"""What an attempt sets up before its function's first step: the device, a gang rank's shard of
``train``, and the weights a job starts from (``model_from``)."""

from __future__ import annotations

from typing import TypedDict

import torch
from safetensors.torch import load as load_safetensors
from torch import nn

from libbus.errors import BadRequest, Unavailable
from libbus.jobs.spec import JobSpec
from libbus.wire.messages import Task

from .checkpoint import CheckpointError, checkpoint_model
from .gang import Gang
from .resume import read_shared

__all__ = ["Shard", "initial_weights", "job_device", "load_initial", "shard", "starting_weights"]


class Shard(TypedDict, total=False):
    """The train loader's arguments that give a gang's rank its own shard (:class:`RemoteLoader`'s)."""

    rank: int
    world_size: int
    drop_uneven: bool


def job_device(spec: JobSpec) -> torch.device:
    """The job's ``device``; :class:`BadRequest` if torch does not know it or this trainer lacks it."""
    try:
        device = torch.device(spec.device)
    except RuntimeError as err:
        raise BadRequest(f"job device {spec.device!r} is not a torch device: {err}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BadRequest(f"job asks for {device} but this trainer has no CUDA device")
    return device


def shard(task: Task) -> Shard:
    """A gang's rank reads its own shard of ``train``; all as many batches (DDP steps together)."""
    if task.world_size == 1:  # said outright: a loader left to itself would look for a process group
        return {"rank": 0, "world_size": 1}
    return {"rank": task.rank, "world_size": task.world_size, "drop_uneven": True}


def initial_weights(frame: bytes | memoryview, source: str) -> dict[str, torch.Tensor]:
    """The weights a job starts from when ``model_from`` names a model the router sends with its
    task (a succeeded job's, or an upload), from safetensors bytes only. Raises
    :class:`BadRequest` for bytes that are not safetensors."""
    try:
        return load_safetensors(bytes(frame))
    except Exception as err:  # noqa: BLE001 - safetensors raises several types for malformed bytes
        raise BadRequest(f"model_from {source!r}: the weights are not a safetensors file: {err}") from err


def starting_weights(task: Task, source: str, root: str, gang: Gang | None = None) -> dict[str, torch.Tensor] | None:
    """The weights ``task``'s job starts from (``source``: its spec's ``model_from``), or None when it
    names none: the model the router sent with the task, or the model weights of another job's
    checkpoint (``task.initial``, that job's latest when the task was handed out), read from ``root``
    (``checkpoint_dir``; in a gang rank 0 reads it for every rank). Only the weights are taken: its
    optimizer and data position stay that job's.

    Raises:
        Unavailable: the checkpoint cannot be read on this trainer (the attempt is retried, and its
            next task names that job's latest checkpoint then).
        BadRequest: the bytes are not a model: changed since the router recorded them (sha256), or no
            model weights in them (not retried).
    """
    if task.frames:
        return initial_weights(task.frames[0], source)
    if not task.initial:
        return None
    try:
        data = read_shared(task.initial, root, gang)
    except CheckpointError as err:
        raise Unavailable(
            f"model_from {source!r}: {err}. A job starts from another job's checkpoint on a trainer that can "
            "read it: that job's own trainer, or trainers sharing one checkpoint_dir (as population-based "
            "training needs)"
        ) from err
    try:
        return checkpoint_model(data, task.initial)
    except CheckpointError as err:
        raise BadRequest(f"model_from {source!r}: {err}") from err


def load_initial(model: nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    """Load the ``model_from`` weights (:func:`starting_weights`) into the built-in ``model``
    (strict: their names and shapes must fit it)."""
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        raise BadRequest(f"model_from {source!r} does not fit this job's model: {err}") from err

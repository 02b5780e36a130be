"""A running task's checkpoints (:mod:`.checkpoint` is their format): written with what the task
resumes with, and resumed from: their bytes (in a gang rank 0 reads them and every rank restores
the same, :mod:`.gang`), the train loader at their cursor, the model, optimizer and random state."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from libbus.loader.remote import RemoteLoader

from .checkpoint import CheckpointError, Restored, read_checkpoint, restore_checkpoint, save_checkpoint
from .gang import Gang
from .progress import Meter

__all__ = ["read_shared", "restore", "save"]


def save(
    directory: Path,
    step: int,
    train: RemoteLoader,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meter: Meter,
    history: list[dict],
    *,
    epoch_end: bool,
) -> dict:
    """Write the checkpoint of ``step`` at ``train``'s cursor, with the history and running loss the
    task resumes with (:func:`restore` gives them back in ``extra``); returns its record."""
    extra = {"history": history, "loss_sum": meter.loss_sum, "loss_n": meter.loss_n}
    cursor = train.state_dict()
    return save_checkpoint(
        directory,
        step=step,
        epoch=cursor["epoch"],
        cursor=cursor,
        model=model,
        optimizer=optimizer,
        extra=extra,
        epoch_end=epoch_end,
    )


def read_shared(record: dict, root: str, gang: Gang | None) -> bytes:
    """The bytes of the checkpoint ``record`` under ``root``; in a gang, rank 0's on every rank.

    Raises:
        CheckpointError: it cannot be read here (in a gang: on rank 0, and every rank starts over).
    """
    if gang is None:
        return read_checkpoint(record, root)
    data, error = b"", None
    if gang.rank == 0:
        try:
            data = read_checkpoint(record, root)
        except CheckpointError as err:
            error = err
    data = gang.share(data)  # empty: rank 0 cannot read it, every rank starts over
    if error is not None:
        raise error
    if not data:
        raise CheckpointError(f"rank 0 could not read checkpoint {record.get('path')}")
    return data


def restore(
    record: dict,
    root: str,
    gang: Gang | None,
    train: RemoteLoader,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> Restored:
    """Put ``train`` at the checkpoint's cursor and restore ``model``, ``optimizer`` and the random
    state from it.

    Raises:
        BusError: it cannot be used (missing here, changed, or from another dataset size); ``train``
            and ``model`` may then be half restored.
    """
    data = read_shared(record, root, gang)
    train.load_state_dict(record.get("cursor") or {})
    return restore_checkpoint(data, record, model, optimizer)

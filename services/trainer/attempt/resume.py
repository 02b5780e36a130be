"""A checkpoint's bytes for a resumed attempt (:mod:`.checkpoint` is their format): in a gang rank 0
reads them and every rank restores the same (:mod:`.gang`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .checkpoint import CheckpointError, read_checkpoint
from .gang import Gang

__all__ = ["read_shared"]


def read_shared(record: Mapping[str, Any], root: str, gang: Gang | None) -> bytes:
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

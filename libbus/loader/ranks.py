"""Which rank of how many this process is, found the way PyTorch launchers say it.

A script run under ``torchrun``, Lightning, Accelerate or a gang of trainers should not have to pass
``rank=``/``world_size=`` to its loader: :func:`detect` takes them from an initialized
``torch.distributed`` process group, else from the ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
variables every launcher sets (``torchrun``, ``accelerate launch``, Lightning's DDP launcher), else
a single process. This reads the environment, unlike the rest of the library (which takes one
settings object): the launchers' variables are the interface PyTorch scripts have to their world.

A careless launch fails loudly instead of reading a wrong share of the data: a ``RANK`` outside
``0..WORLD_SIZE-1``, a value that is not a number, or only one of the two variables set is a
:class:`~libbus.errors.BadRequest` naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from libbus.errors import BadRequest

__all__ = ["RankInfo", "detect"]


@dataclass(frozen=True)
class RankInfo:
    """This process's place in its world and where that was read (``given``, ``torch.distributed``,
    ``environment`` or ``single process``)."""

    rank: int
    world_size: int
    local_rank: int = 0
    source: str = "single process"


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"environment variable {name}={raw!r} is not an integer") from None


def _checked(rank: int, world_size: int, where: str) -> tuple[int, int]:
    if world_size < 1:
        raise BadRequest(f"world size {world_size} ({where}) must be at least 1")
    if not 0 <= rank < world_size:
        raise BadRequest(f"rank {rank} ({where}) is outside a world of {world_size} (ranks 0..{world_size - 1})")
    return rank, world_size


def _from_process_group() -> tuple[int, int] | None:
    try:
        import torch.distributed as dist
    except ImportError:  # a torch built without distributed support
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()


def detect(
    rank: int | None = None, world_size: int | None = None, environ: Mapping[str, str] | None = None
) -> RankInfo:
    """This process's rank and world size: ``rank``/``world_size`` when given (both, or neither),
    else the process group's, else ``RANK``/``WORLD_SIZE`` (and ``LOCAL_RANK``) from ``environ``
    (default ``os.environ``), else rank 0 of 1.

    Raises:
        BadRequest: only one of ``rank``/``world_size`` given (or set), a value that is not an
            integer, or a rank outside ``0..world_size-1`` (the message names where it came from).
    """
    environ = os.environ if environ is None else environ
    local = _env_int(environ, "LOCAL_RANK") or 0
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise BadRequest("give both rank= and world_size=, or neither (they are then detected)")
        return RankInfo(*_checked(rank, world_size, "given"), local, "given")
    group = _from_process_group()
    if group is not None:
        return RankInfo(*_checked(*group, "torch.distributed"), local, "torch.distributed")
    env_rank, env_world = _env_int(environ, "RANK"), _env_int(environ, "WORLD_SIZE")
    if env_rank is None and env_world is None:
        return RankInfo(0, 1, local)
    if env_rank is None or env_world is None:
        missing = "RANK" if env_rank is None else "WORLD_SIZE"
        raise BadRequest(f"{missing} is not set while {'WORLD_SIZE' if env_rank is None else 'RANK'} is")
    return RankInfo(*_checked(env_rank, env_world, "RANK/WORLD_SIZE"), local, "environment")

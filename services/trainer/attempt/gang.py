"""A trainer's side of a gang: the ranks of one job training together through torch.distributed.

- **Rendezvous.** Rank 0 opens a TCPStore on a free port of its host (port 0: the kernel picks it,
  nothing to race for) and reports ``tcp://HOST:PORT`` to the router (``Rendezvous``); the router
  hands it to the other ranks with their tasks. ``HOST`` is the trainer's ``advertise`` setting, or
  the address of this host's interface on the route to the router (what other hosts can reach).
  All ranks then join one process group: gloo on CPU, nccl on CUDA.
- **One decision per step.** Rank 0 alone hears the router's commands. At every point where the
  training loop applies commands (each epoch's start, after each step, after each epoch) all ranks
  all-reduce (max) one small tensor: a :class:`Code` and rank 0's settable hyper-parameters. So
  every rank pauses, stops or takes ``busctl job set`` values at the same step. The other ranks
  contribute :attr:`Code.HANDBACK` when their own trainer is shutting down (SIGTERM): the whole
  gang then hands the job back, from a checkpoint rank 0 writes at that step.
- **Resume.** Rank 0 reads the job's checkpoint and broadcasts its bytes: every rank restores the
  same model, optimizer and random state, and each its own shard at the same cursor (every rank
  has taken the same steps: the loaders drop uneven tails).

torch.distributed's store and gloo traffic are neither authenticated nor encrypted: gangs belong on
a trusted network (docs/security.md).
"""

from __future__ import annotations

import logging
import math
import socket
import threading
from datetime import timedelta
from enum import IntEnum
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from libbus.connect.link import Link
from libbus.errors import BadRequest, Unavailable
from libbus.wire.messages import Rendezvous, Task

__all__ = ["Code", "Gang", "GangError", "GANG_TIMEOUT_S", "RENDEZVOUS_TIMEOUT_S", "advertised_host"]

log = logging.getLogger(__name__)

#: How long ranks wait for each other to meet (rank 0 for the others to get their tasks).
RENDEZVOUS_TIMEOUT_S = 60.0
#: How long a collective waits for the slowest rank: rank 0 also scores the val split and writes
#: checkpoints while the others wait at the next step.
GANG_TIMEOUT_S = 300.0
#: How long leaving the process group may take: gloo's teardown can block for good when another
#: rank was killed mid-collective.
GANG_CLOSE_TIMEOUT_S = 10.0


class GangError(Unavailable):
    """A rank of the gang is gone or never came: the attempt fails and may be retried."""


class Code(IntEnum):
    """What every rank does after a sync point (the highest any rank asked for wins)."""

    RUN = 0
    PAUSE = 1
    STOP = 2
    HANDBACK = 3
    ABORT = 4


def advertised_host(advertise: str, router: str) -> str:
    """The host other ranks reach this trainer at: ``advertise`` (a host, or a ``tcp://HOST[:PORT]``
    endpoint), else this host's address on the route to the router, else its hostname."""
    if advertise:
        return (urlsplit(advertise).hostname or advertise) if "://" in advertise else advertise
    url = urlsplit(router)
    host = url.hostname if url.scheme == "tcp" else None
    if not host or host in ("*", "0.0.0.0"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # no packet is sent: this only picks the outgoing interface
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()


class Gang:
    """The process group of one task with ``world_size`` > 1.

    Args:
        task: the router's task (rank, world size; ``rendezvous`` for ranks above 0).
        link: the trainer's link to the router (rank 0 reports its rendezvous there).
        host: the host rank 0 advertises (:func:`advertised_host`).
        device: the job's torch device (nccl for CUDA, else gloo).
        timeout_s: the bound on every request to the router.

    Raises:
        GangError: the ranks did not meet within :data:`RENDEZVOUS_TIMEOUT_S`.
    """

    def __init__(self, task: Task, link: Link, host: str, device: torch.device, timeout_s: float):
        self.rank, self.world_size = task.rank, task.world_size
        self.device = device if device.type == "cuda" else torch.device("cpu")
        backend = "nccl" if device.type == "cuda" else "gloo"
        wait = timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        try:
            if self.rank == 0:
                store = dist.TCPStore(
                    host, 0, world_size=self.world_size, is_master=True, timeout=wait, wait_for_workers=False
                )
                address = f"tcp://{host}:{store.port}"
                link.request(Rendezvous(job=task.job, address=address), timeout_s=timeout_s)
            else:
                url = urlsplit(task.rendezvous)
                if url.scheme != "tcp" or not url.hostname or not url.port:
                    raise BadRequest(
                        f"task of job {task.job} names no rendezvous tcp://HOST:PORT, got {task.rendezvous!r}"
                    )
                address = task.rendezvous
                store = dist.TCPStore(url.hostname, url.port, world_size=self.world_size, is_master=False, timeout=wait)
            dist.init_process_group(
                backend,
                store=store,
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=GANG_TIMEOUT_S),
            )
        except (RuntimeError, ValueError) as err:  # torch.distributed's errors (DistError is one)
            raise GangError(
                f"rank {self.rank} of {self.world_size} of job {task.job} could not meet its gang: {err}"
            ) from err
        self.group = dist.group.WORLD
        #: DistributedDataParallel's ``device_ids``: the job's CUDA device, none on CPU.
        self.device_ids = [device.index or 0] if device.type == "cuda" else None
        log.info(
            "job %s: rank %d of %d joined its gang at %s (%s)", task.job, self.rank, self.world_size, address, backend
        )

    def decide(self, code: Code, version: int) -> tuple[Code, int]:
        """All ranks' highest :class:`Code` and rank 0's ``version`` (of the job's settable params:
        when it differs from a rank's own, rank 0 shares them next, :meth:`share`)."""
        mine = [float(code), float(version) if self.rank == 0 else -1.0]
        flags = torch.tensor(mine, dtype=torch.float64, device=self.device)
        self._collective(dist.all_reduce, flags, op=dist.ReduceOp.MAX)
        values = flags.tolist()
        return Code(int(values[0])), int(values[1])

    def largest(self, value: float) -> float:
        """The largest of every rank's ``value`` (a loss), on every rank; inf where any is not finite."""
        mine = value if math.isfinite(value) else math.inf
        t = torch.tensor([mine], dtype=torch.float64, device=self.device)
        self._collective(dist.all_reduce, t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def share(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` (a checkpoint's bytes; empty: none) on every rank."""
        size = torch.tensor([len(data or b"")], dtype=torch.int64, device=self.device)
        self._collective(dist.broadcast, size, src=0)
        n = int(size.item())
        if self.rank == 0:
            blob = (
                torch.frombuffer(bytearray(data or b""), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
            )
        else:
            blob = torch.empty(n, dtype=torch.uint8)
        if n:
            moved = blob.to(self.device)
            self._collective(dist.broadcast, moved, src=0)
            blob = moved.cpu()
        return blob.numpy().tobytes()

    def _collective(self, fn, *args, **kw) -> None:
        try:
            fn(*args, group=self.group, **kw)
        except RuntimeError as err:
            raise GangError(f"rank {self.rank}: a rank of the gang is gone: {err}") from err

    def close(self, timeout_s: float = GANG_CLOSE_TIMEOUT_S) -> bool:
        """Leave the process group (a rank still waiting on this one sees its connection close).

        Returns False when the teardown did not end within ``timeout_s`` (a rank killed mid-collective
        can leave gloo's teardown blocked for good): this process then cannot join another gang, and
        its trainer exits so that its supervisor starts a fresh one.
        """
        if not dist.is_initialized():
            return True
        teardown = threading.Thread(target=dist.destroy_process_group, name="gang-close", daemon=True)
        teardown.start()
        teardown.join(timeout_s)
        if teardown.is_alive():
            log.error("rank %d: leaving the process group did not end within %.0f s", self.rank, timeout_s)
            return False
        return True

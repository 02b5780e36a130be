"""What a training attempt tells the router of its progress: the running figures (:class:`Meter`) its
progress reports are built from (:meth:`.jobapi.AttemptJob.progress`), and the measures derived there."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, TypedDict

from libbus.loader.remote import RemoteLoader
from libbus.loader.stall import StallBreakdown

__all__ = ["AttemptProgress", "Meter", "perplexity", "slowest"]


class AttemptProgress(TypedDict, total=False):
    """An attempt's progress report (``Progress.progress``; ``busctl job watch``, ``top``): where the
    loop is, its loss and throughput, what it resumed from, its history, and where its data waits went
    (the ``data_wait_*`` keys, with a train loader only)."""

    epoch: int
    epochs: int | None
    step: int
    steps_per_epoch: int | None
    loss: float | None
    samples: int
    samples_per_s: float
    elapsed_s: float
    state: str
    checkpoint_step: int | None
    resumed_from: dict[str, Any] | None
    history: list[dict[str, Any]]
    entrypoint: str
    data_wait_s: float
    transport: str
    data_wait_pct: float
    data_wait_slowest: str | None
    data_wait_split: StallBreakdown


def perplexity(loss: float) -> float:
    """exp(mean next-token loss), capped so that a diverged run reports a number JSON can carry."""
    return math.exp(min(loss, 700.0))


@dataclass
class Meter:
    """Running throughput and data-wait figures for progress reports."""

    started: float = field(default_factory=time.monotonic)
    samples: int = 0
    loss_sum: float = 0.0
    loss_n: int = 0

    def add(self, n: int, loss: float) -> None:
        self.samples += n
        self.loss_sum += loss * n
        self.loss_n += n

    def take_loss(self) -> float:
        loss = self.loss_sum / self.loss_n if self.loss_n else float("nan")
        self.loss_sum, self.loss_n = 0.0, 0
        return loss


def slowest(loader: RemoteLoader) -> str | None:
    """The replica whose batches ``loader`` waited for longest: the slow provider, when data is the
    bottleneck."""
    _, by_replica = loader.stall.snapshot()
    return max(by_replica, key=by_replica.__getitem__) if by_replica else None

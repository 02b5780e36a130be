"""What a training task tells the router of its progress: the running figures (:class:`Meter`), the
progress report built from them, each epoch's record in the job's history, and the final result."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from libbus.loader.remote import RemoteLoader
from libbus.wire.messages import Evaluation
from services.models import TOKENS

__all__ = ["Meter", "epoch_record", "final_result", "perplexity", "progress_report"]


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


def progress_report(
    meter: Meter,
    loader: RemoteLoader,
    *,
    epoch: int,
    epochs: int,
    step: int,
    steps_per_epoch: int,
    world_size: int,
    state: str,
    last_checkpoint: dict | None,
    resumed_from: dict | None,
    history: list[dict],
) -> dict:
    """What rank 0 reports; ``samples`` counts the whole gang (every rank trains as many)."""
    elapsed = max(1e-9, time.monotonic() - meter.started)
    last_loss = meter.loss_sum / meter.loss_n if meter.loss_n else None
    return {
        "epoch": epoch,
        "epochs": epochs,
        "step": step,
        "steps_per_epoch": steps_per_epoch,
        "loss": last_loss,
        "samples": meter.samples * world_size,
        "samples_per_s": meter.samples * world_size / elapsed,
        "data_wait_s": loader.wait_s,
        "transport": loader.transport,
        "data_wait_pct": 100.0 * loader.wait_s / elapsed,
        # the replica whose batches were waited for longest: the slow provider, when data is the bottleneck
        "data_wait_slowest": _slowest(loader),
        # where the waiting went: provider queueing, source read, each stage, transfer (libbus.loader.stall)
        "data_wait_split": loader.stall.breakdown(),
        "elapsed_s": elapsed,
        "state": state,
        "checkpoint_step": last_checkpoint["step"] if last_checkpoint else None,
        "resumed_from": resumed_from,
        "history": history,
    }


def epoch_record(epoch: int, train_loss: float, val_loss: float, val_accuracy: float, kind: str) -> dict:
    """The history's record of ``epoch`` (counted from 1): its mean train loss and its validation."""
    record = {"epoch": epoch, "train_loss": train_loss, "val_loss": val_loss, "val_accuracy": val_accuracy}
    if kind == TOKENS:  # per-token loss; perplexity is how language models are compared
        record["val_perplexity"] = perplexity(val_loss)
    return record


def final_result(
    progress: dict, history: list[dict], provider: str, world_size: int, kind: str, evaluation: Evaluation | None
) -> dict:
    """Rank 0's result (without its model): the last ``progress`` report, the last epoch's
    validation, and the provider-side test ``evaluation`` if the job asked for one."""
    result = {
        **progress,
        "val_loss": history[-1]["val_loss"],
        "val_accuracy": history[-1]["val_accuracy"],
        "provider": provider,
        "world_size": world_size,
    }
    if kind == TOKENS:
        result["val_perplexity"] = history[-1]["val_perplexity"]
    if evaluation is not None:
        result.update(test_loss=evaluation.loss, test_accuracy=evaluation.accuracy, test_n=evaluation.n)
        if kind == TOKENS:
            result["test_perplexity"] = perplexity(evaluation.loss)
    return result


def _slowest(loader: RemoteLoader) -> str | None:
    _, by_replica = loader.stall.snapshot()
    return max(by_replica, key=by_replica.__getitem__) if by_replica else None

"""Early stopping of single jobs, decided by the router: a job whose spec sets ``patience`` is
stopped once its validation metric (``monitor``, ``val_loss`` by default; ``val_accuracy`` is
maximised) has not improved by more than ``min_delta`` for ``patience`` epochs in a row. The stop
travels the normal command path (the job checkpoints and ends ``stopped``); the decision is an
event of the job, starting "early stopping".

The decision is taken when an epoch's report arrives (:meth:`EarlyStopping.on_report`), epoch by
epoch in order, never by a timer: the job stops at the first epoch at which its history runs out of
patience, whenever and however batched its reports reach the router, so the same job replays the
same decision. The stop rides on the reply to that report (JobControl.on_progress judges before it
answers), and the trainer waits for that reply at the end of each epoch of such a job (bounded by
its request timeout) before it trains on, so the stop takes effect right after that epoch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Container

import orjson

from libbus.errors import BusError
from libbus.jobs.commands import JobCommand
from libbus.jobs.spec import JobSpec

from .store import JobStore, stored_spec

__all__ = ["EarlyStopping", "should_stop", "stop_epoch"]

log = logging.getLogger(__name__)

#: How often the cache of ended jobs is dropped.
FORGET_S = 30.0


def should_stop(values: list[float], *, patience: int, min_delta: float, maximize: bool) -> str | None:
    """Why a job whose metric went ``values`` (one per epoch, oldest first) should stop, or None.

    An epoch improves on the best so far when it beats it by more than ``min_delta``; ``patience``
    epochs in a row without an improvement stop the job. Non-finite values never improve.
    """
    if patience < 1:
        return None
    best, best_epoch = None, 0
    for epoch, value in enumerate(values, 1):
        if not math.isfinite(value):
            continue
        if best is None or (value - best > min_delta if maximize else best - value > min_delta):
            best, best_epoch = value, epoch
    if best is None:
        return None if len(values) < patience else f"no finite value in {len(values)} epochs"
    if len(values) - best_epoch >= patience:
        return (
            f"no improvement by more than {min_delta:g} for {len(values) - best_epoch} epoch(s) "
            f"(patience {patience}); best {best:.4f} at epoch {best_epoch}"
        )
    return None


def stop_epoch(history: list[dict], spec: JobSpec, after: int = 0) -> tuple[int, str] | None:
    """The first epoch past ``after`` (1-based, in ``history``: one record per epoch, oldest first)
    at which ``spec``'s early stopping stops the job, with why; None if none does.

    Each epoch is judged on the records up to it alone, so the answer does not depend on how many
    epochs a report carries beyond it.
    """
    monitor = spec.monitor
    maximize = "accuracy" in monitor
    values = [v for v in (_metric(r, monitor) for r in history[:after]) if v is not None]
    for epoch in range(after + 1, len(history) + 1):
        value = _metric(history[epoch - 1], monitor)
        if value is None:
            continue  # an epoch without the metric changes nothing
        values.append(value)
        why = should_stop(values, patience=spec.patience, min_delta=spec.min_delta, maximize=maximize)
        if why is not None:
            return epoch, why
    return None


def _metric(record: object, monitor: str) -> float | None:
    value = record.get(monitor) if isinstance(record, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


class EarlyStopping:
    """Judges the epoch reports of jobs with ``patience`` and stops them through
    ``control(by, job, command, args)``; ``stopping`` holds the jobs whose stop is under way."""

    def __init__(self, jobs: JobStore, control: Callable[[str, str, str, dict], object], stopping: Container[str]):
        self.jobs = jobs
        self.control = control
        self.stopping = stopping
        #: job with patience -> epochs of its history found not to stop it (only a cache: judging the
        #: whole history again gives the same answer)
        self._clear: dict[str, int] = {}
        self._forgot = 0.0

    def on_report(self, job_id: str, history: list) -> None:
        """A progress report of ``job_id`` carrying ``history`` (its epoch records): if the job
        ran out of patience at an epoch, stop it (unless its stop is under way). A stop that cannot
        be sent (its trainer away for a moment) is decided again, at the same epoch, at the next
        report; so is a job resumed after it stopped early."""
        clear = self._clear.get(job_id, 0)
        if len(history) <= clear:
            return  # a report within an epoch, or a repeated one
        row = self.jobs.db.execute(
            "SELECT spec FROM jobs WHERE id = ? AND json_extract(spec, '$.patience') > 0", (job_id,)
        ).fetchone()
        if row is None:
            return  # no early stopping for this job
        spec = stored_spec(orjson.loads(row[0]))
        found = stop_epoch(history, spec, clear)
        if found is None:
            self._clear[job_id] = len(history)
            return
        if job_id in self.stopping:
            return
        epoch, why = found
        monitor = spec.monitor
        try:
            self.control("early stopping", job_id, JobCommand.STOP, {})
        except BusError as err:
            log.info("job %s: early stop at epoch %d not sent yet: %s", job_id, epoch, err)
            return
        self.jobs.event(job_id, f"early stopping on {monitor} at epoch {epoch}: {why}")
        log.info("job %s: early stopping on %s at epoch %d: %s", job_id, monitor, epoch, why)

    def tick(self, now: float) -> None:
        """Drop the cache of the jobs no trainer holds any more (nothing is decided here)."""
        if now - self._forgot < FORGET_S or not self._clear:
            return
        self._forgot = now
        held = self.jobs.held_watched()
        self._clear = {job: n for job, n in self._clear.items() if job in held}

"""Early stopping of single jobs, decided by the router: a job whose spec sets ``patience`` is
stopped once its validation metric (``monitor``, ``val_loss`` by default; ``val_accuracy`` is
maximised) has not improved by more than ``min_delta`` for ``patience`` epochs in a row. The stop
travels the normal command path (the job checkpoints and ends ``stopped``); the decision is an
event of the job, starting "early stopping".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from libbus.errors import BusError
from libbus.jobs.commands import JobCommand

from .store import JobStore

__all__ = ["EarlyStopping", "should_stop"]

log = logging.getLogger(__name__)

#: How often running jobs' histories are read.
CHECK_S = 0.5


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


class EarlyStopping:
    """Watches running jobs with ``patience`` and stops them through ``control(by, job, command, args)``."""

    def __init__(self, jobs: JobStore, control: Callable[[str, str, str, dict], object]):
        self.jobs = jobs
        self.control = control
        self._decided: dict[str, int] = {}  # job -> epochs seen at the last decision
        self._last = 0.0
        self._seen: dict[str, float] = {}  # job -> its ``updated`` when it was last read

    def tick(self, now: float) -> None:
        if now - self._last < CHECK_S:
            return
        self._last = now
        # only jobs with patience are read, and of those only the ones changed (a progress report)
        # since the last look: a thousand held jobs are not decoded twice a second
        watched = self.jobs.held_watched()
        fresh = [job for job, updated in watched.items() if self._seen.get(job) != updated]
        self._seen = {job: self._seen.get(job, 0.0) for job in watched}
        self._decided = {k: v for k, v in self._decided.items() if k in watched}
        for job_id in fresh:
            self._seen[job_id] = watched[job_id]
            job = self.jobs.get(job_id, events=False)
            spec = job["spec"]
            history = (job["progress"] or {}).get("history") or []
            if self._decided.get(job["id"]) == len(history):
                continue
            monitor = spec.get("monitor", "val_loss")
            values = [float(r[monitor]) for r in history if isinstance(r.get(monitor), (int, float))]
            why = should_stop(
                values, patience=spec["patience"], min_delta=spec.get("min_delta", 0.0), maximize="accuracy" in monitor
            )
            if why is None:
                self._decided[job["id"]] = len(history)
                continue
            try:
                self.control("early stopping", job["id"], JobCommand.STOP, {})
            except BusError as err:  # its trainer away for a moment: decided again next time
                log.info("job %s: early stop not sent yet: %s", job["id"], err)
                self._seen.pop(job["id"], None)
                continue
            self._decided[job["id"]] = len(history)
            self.jobs.event(job["id"], f"early stopping on {monitor}: {why}")
            log.info("job %s: early stopping on %s: %s", job["id"], monitor, why)

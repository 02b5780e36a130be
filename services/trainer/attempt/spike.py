"""Loss spikes, found and skipped by the trainer itself (the job's ``spike`` option, docs/jobs.md).

:class:`SpikeDetector` is the rule, given one loss per step: the built-in loop (:mod:`.builtin`) and an
entrypoint's ``job.step(loss=...)`` (:mod:`.jobapi`) feed it alike. :func:`skip_spike` is what is done
about a spike: the router is asked to skip the stretch of steps that led to it, by the path of
``busctl job skip --steps`` (the job rewinds to its last checkpoint before the stretch and never
trains on those samples again), or the job fails once ``max_skips`` spikes have been skipped.

In a gang, rank 0 decides from its own loss and asks; the caller then ends the other ranks at the
same step (the skip rewinds the whole job, whatever rank trained what).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass

from libbus.errors import BusError, PeerTimeout
from libbus.jobs.spec import JobSpec, SpikeSpec
from libbus.wire.messages import SkipJob

from ..reports import Reporter
from .control import Lost

__all__ = ["Spike", "SpikeDetector", "TooManySpikes", "skip_spike"]

log = logging.getLogger(__name__)

#: Tries to deliver the skip request while the router does not answer (each ``timeout_s``).
SKIP_TRIES = 5


class TooManySpikes(BusError):
    """A loss spike after ``spike.max_skips`` skipped ones: the job fails (not retried)."""

    code = "BAD_REQUEST"


@dataclass(frozen=True)
class Spike:
    """Step ``step`` (counted from 1) had loss ``loss``; ``median`` of the window before it (nan: none)."""

    step: int
    loss: float
    median: float
    window: int

    def describe(self, factor: float) -> str:
        if not math.isfinite(self.loss):
            return f"step {self.step}: loss {self.loss} (not finite)"
        return (
            f"step {self.step}: loss {self.loss:.4g} > {factor:g} x median {self.median:.4g} "
            f"of the last {self.window} step(s)"
        )


class SpikeDetector:
    """The spike rule of :class:`SpikeSpec` over one attempt's losses, one per step.

    A non-finite loss is a spike at any step. A finite one is a spike when at least ``warmup`` losses
    were seen and it is above ``factor`` times the median of the last ``window`` of them (a median, not
    a mean: one bad step before does not hide the next). A spike's loss does not join the window.
    A window whose median is not positive flags no finite loss (the rule is a ratio).
    """

    def __init__(self, rule: SpikeSpec):
        self.rule = rule
        self.losses: deque[float] = deque(maxlen=rule.window)
        self.seen = 0

    def observe(self, step: int, loss: float) -> Spike | None:
        """The spike at ``step`` if ``loss`` is one, else None (and ``loss`` joins the window)."""
        loss = float(loss)
        median = statistics.median(self.losses) if self.losses else math.nan
        if not math.isfinite(loss):
            return Spike(step, loss, median, len(self.losses))
        if self.seen >= self.rule.warmup and median > 0 and loss > self.rule.factor * median:
            return Spike(step, loss, median, len(self.losses))
        self.seen += 1
        self.losses.append(loss)
        return None


def detector_for(spec: JobSpec) -> SpikeDetector | None:
    """The job's detector, or None when its ``spike`` option is off."""
    return SpikeDetector(SpikeSpec.parse(spec.spike)) if spec.spike else None


def skip_spike(spike: Spike, spec: JobSpec, job: str, reporter: Reporter, timeout_s: float) -> None:
    """Ask the router to skip steps ``spike.step - skip_before .. spike.step`` of ``job`` (the reports
    so far first, so that it rewinds to the last checkpoint it knows before them), then raise
    :class:`Lost`: the router has taken the job back to resume it without those samples.

    Raises:
        TooManySpikes: ``spike.max_skips`` spikes were skipped already (the job fails).
        PeerTimeout: the router did not take the request (the attempt fails, retryable).
        BusError: the router refused it.
    """
    rule = SpikeSpec.parse(spec.spike)
    what = spike.describe(rule.factor)
    if len(spec.spikes) >= rule.max_skips:
        first = max(1, spike.step - rule.skip_before)
        raise TooManySpikes(
            f"loss spike at {what}; the job has skipped {len(spec.spikes)} loss spike(s) already "
            f"(spike.max_skips = {rule.max_skips}), so a data problem that does not go away is not "
            f"skipped again by itself: look at the samples (busctl job samples {job} --step {spike.step} "
            f"--where), skip them (busctl job skip {job} --steps {first}:{spike.step + 1}) and resume "
            f"the job (busctl job resume {job}), or submit it with a higher spike.max_skips"
        )
    first = max(1, spike.step - rule.skip_before)
    log.warning("job %s: spike: %s; asking the router to skip steps %d:%d", job, what, first, spike.step + 1)
    for _ in range(SKIP_TRIES):  # the checkpoint records first: the rewind target is among them
        if reporter.flush(timeout_s):
            break
    if reporter.lost is not None:
        raise Lost(str(reporter.lost))
    record = {"step": spike.step, "loss": _plain(spike.loss), "median": _plain(spike.median), "window": spike.window}
    msg = SkipJob(job=job, steps=[[first, spike.step + 1]], spike=record)
    for attempt in range(SKIP_TRIES):
        try:
            reply = reporter.link.request(msg, timeout_s=timeout_s)
            break
        except PeerTimeout:
            if attempt == SKIP_TRIES - 1:
                raise
    detail = getattr(reply, "detail", {}) or {}
    log.warning(
        "job %s: spike: skipped %s sample(s) of steps %d:%d; the job %s",
        job,
        detail.get("skipped"),
        first,
        spike.step + 1,
        detail.get("rewind", "rewinds"),
    )
    raise Lost(f"spike at step {spike.step}: the job resumes without steps {first}:{spike.step + 1}")


def _plain(value: float) -> float | str:
    """A loss as JSON carries it (nan and inf as their names)."""
    return value if math.isfinite(value) else str(value)

"""Where one batch's fill time goes on the provider: source I/O or each pipeline stage by name.

A request that asks for its timing (``BatchRequest.timing``) is read with a :class:`BatchTiming` made
current on the reading thread (:func:`timed`); a source that knows more than "all of it was reading"
(a pipeline: its source stage and each transform, :mod:`.pipeline.engine`) adds its parts to it, and
:meth:`BatchTiming.reply` turns them, with the provider's queueing and fill times, into the reply's
``timing`` field. A source that adds nothing is all read. Nothing is measured for a request that
does not ask.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypedDict

__all__ = ["BatchTiming", "TimingInfo", "current", "timed"]


class TimingInfo(TypedDict):
    """``BatchResponse.timing``: where a batch's time went on the provider, in seconds."""

    queue: float
    read: float
    #: pipeline stage name → seconds
    stages: dict[str, float]


_local = threading.local()


class BatchTiming:
    """Seconds of one batch's fill spent reading its source, and in each named stage."""

    __slots__ = ("read_s", "stages")

    def __init__(self) -> None:
        self.read_s = 0.0
        #: stage name → seconds its chunks of this batch spent in it (summed over chunks).
        self.stages: dict[str, float] = {}

    def add_pipeline(self, stages: Sequence[Any], seconds: Sequence[float]) -> None:
        """A pipeline's per-stage seconds for this batch: its first stage (the source) is the read."""
        for i, (stage, s) in enumerate(zip(stages, seconds)):
            if i == 0:
                self.read_s += s
            else:
                self.stages[stage.name] = self.stages.get(stage.name, 0.0) + s

    def reply(self, queue_s: float, fill_s: float) -> TimingInfo:
        """The reply's ``timing``: ``{"queue", "read", "stages": {name: s}}`` in seconds, adding up to
        ``queue_s + fill_s``. Without stage figures the whole fill is the read. Stage and read times
        summed over a pipeline's chunks overlap (stages run side by side): they are scaled down to the
        fill's wall time; time they do not cover is the batch's chunks waiting in the pipeline's
        queues behind other batches, which is queueing."""
        if not self.stages and not self.read_s:
            return {"queue": round(queue_s, 6), "read": round(fill_s, 6), "stages": {}}
        busy = self.read_s + sum(self.stages.values())
        scale = fill_s / busy if busy > fill_s else 1.0
        queue_s += max(0.0, fill_s - busy)
        return {
            "queue": round(queue_s, 6),
            "read": round(self.read_s * scale, 6),
            "stages": {name: round(s * scale, 6) for name, s in self.stages.items()},
        }


def current() -> BatchTiming | None:
    """The timing of the batch this thread is reading, if its request asked for one."""
    return getattr(_local, "timing", None)


@contextmanager
def timed(timing: BatchTiming | None) -> Iterator[None]:
    """Make ``timing`` current on this thread for the read inside (``None``: measure nothing)."""
    _local.timing = timing
    try:
        yield
    finally:
        _local.timing = None

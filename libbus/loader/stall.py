"""The data-stall signal: seconds a training loop spent waiting for data, for whom, and where it went.

A loader that keeps enough requests in flight hands out each batch the moment the loop asks; any
time it spends waiting for a reply instead is time the model was idle because the providers were
behind. :class:`StallMeter` sums that time, in total and by the replica that held the batch being
waited for (which says which provider is slow), and splits it into where the batch's time went:

``queue``
    the request waited at the provider before its read began (behind other requests on the serving
    loop or a fill thread, or its chunks behind other batches' in a pipeline's queues);
``read``
    the provider read the source (file, object store, a pipeline's source stage);
``stage:NAME``
    a pipeline stage, by name;
``transfer``
    what remains of the round trip: the request and the reply on the socket or the ring slot's
    hand-off, packing named fields, and the time a reply sat before the loop read it;
``other``
    waiting that came before the answered request was even sent: a resend after a timeout or a lost
    provider, no replica up, no free ring slot;
``unsplit``
    waiting on a provider that gave no timing (one older than the field, or the split turned off).

**The attribution.** The provider measures each batch's ``queue``, ``read`` and stage seconds and sends
them in its reply (``BatchResponse.timing``); the loader measures the batch's round trip ``T`` (request
sent to reply read), of which ``transfer`` is what the provider's parts leave. A batch's life is then a
timeline: queued, read, each stage in pipeline order, transferred, ending when the loop gets it. The
loop's wait of ``w`` seconds for that batch (all it waited for it, however many polls) is the *end* of
that timeline, the part prefetch did not hide, so it is charged walking the timeline backwards from
the arrival: transfer first, then the stages from the last, then the read, then the queueing, and
whatever is left (``w > T``) is ``other``. Provider parts that add up to more than ``T`` (they cannot,
unless a provider is wrong) are scaled down to ``T``, leaving no transfer. The parts always add up to
the wait.

A provider's ``queue`` starts when its serving loop takes the request. Every read that takes time
(a store's, a decode, a generator, a stage) runs on a lane off that loop, so the loop takes each
request as it arrives and the wait for its read is measured as ``queue``. Only a local file's
memory-speed gathers stay on the loop on a machine of few cores (services/provider/fillers.py), where
the requests behind one (a millisecond each) wait in the socket unmeasured and reach the loader as
``transfer``. ``tests/loader/test_stall_sources.py`` runs one slow part per source kind through both deliveries.

Why backwards rather than in proportion: with several requests in flight, a provider whose one
stage is the bottleneck keeps the requests behind the one being worked on queued, so most of each
round trip is queueing, yet the loop, which waits only for the batch it needs next, waits while that
batch is in the slow stage. Charged from the end, the wait names the stage; queueing is charged only
when the loop was already waiting while its batch had not even started, which is what a provider busy
with other loaders' (or other jobs') requests looks like.

A provider is a peer: its figures are bounded before use (:func:`read_timing`): a value that is not a
finite non-negative number counts as 0, one above :data:`MAX_SECONDS` as that, at most
:data:`MAX_STAGES` stage names a reply and in the meter's life (later ones count as ``stage:(more)``),
each cut to :data:`MAX_NAME` characters. A forged reply can shift the split of the waits it answers,
never the total waited, never the meter's size, never a NaN.

It is exported to Prometheus as ``batchbus_loader_data_wait_seconds_total{dataset, split, replica}``
and ``batchbus_loader_data_wait_part_seconds_total{dataset, split, part, stage}`` — register it with any
``prometheus_client`` registry (``REGISTRY.register(loader.stall)``) — and read from Python with
:meth:`StallMeter.breakdown`. The trainer service reports the same in its progress (``busctl job show``,
``busctl top``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from itertools import islice
from typing import Any, TypedDict

from prometheus_client.core import CounterMetricFamily, Metric

__all__ = ["MAX_NAME", "MAX_SECONDS", "MAX_STAGES", "PARTS", "StallBreakdown", "StallMeter", "read_timing"]

#: The parts of a wait other than the stages (``stage:NAME``), in the order they are shown.
PARTS = ("queue", "read", "transfer", "other", "unsplit")
#: Stage names taken from one reply, and kept by one meter; more fold into ``stage:(more)``.
MAX_STAGES = 32
#: Characters of a stage name kept.
MAX_NAME = 64
#: The most seconds one figure of a reply (or one wait) may count for: a week.
MAX_SECONDS = 7 * 86400.0
#: Where the stages past :data:`MAX_STAGES` are counted.
MORE = "stage:(more)"


def _seconds(value: Any) -> float:
    """``value`` as seconds in ``[0, MAX_SECONDS]``; 0 for anything not a finite non-negative number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        return 0.0
    return min(value, MAX_SECONDS)


def read_timing(raw: Any) -> tuple[float, float, dict[str, float]] | None:
    """A reply's ``timing`` as ``(queue, read, {stage: seconds})``, bounded (see the module docstring);
    ``None`` when it gives none (or is not a dict)."""
    if not isinstance(raw, dict):
        return None
    stages: dict[str, float] = {}
    raw_stages = raw.get("stages")
    if raw_stages and isinstance(raw_stages, dict):
        for name, value in islice(raw_stages.items(), MAX_STAGES):
            if isinstance(name, str) and name:
                key = name[:MAX_NAME]
                stages[key] = min(MAX_SECONDS, stages.get(key, 0.0) + _seconds(value))
    return _seconds(raw.get("queue")), _seconds(raw.get("read")), stages


class StallBreakdown(TypedDict):
    """Where a loader's waiting went (:meth:`StallMeter.breakdown`; a progress report's ``data_wait_split``)."""

    #: All the loop waited, in seconds.
    wait_s: float
    #: Seconds by part (``queue``, ``read``, ``stage:NAME``, ``transfer``, ``other``, ``unsplit``), largest first.
    parts: dict[str, float]
    #: The part that took most (None before any).
    largest: str | None
    #: The replica waited on longest (None before any).
    slowest: str | None


class StallMeter:
    """Seconds waited for data by one loader, by replica and by part (see the module docstring).

    Written by the loop that iterates the loader, read by a scrape thread: a lock keeps the figures
    consistent with each other.
    """

    def __init__(self, dataset: str, split: str):
        self.dataset, self.split = dataset, split
        self.seconds = 0.0
        self.by_replica: dict[str, float] = {}
        #: part (``queue``, ``read``, ``stage:NAME``, ``transfer``, ``other``, ``unsplit``) → seconds.
        self.by_part: dict[str, float] = {}
        self._stages = 0
        self._lock = threading.Lock()

    def add(self, seconds: float, replica: str = "") -> None:
        """Count ``seconds`` spent waiting for a batch that ``replica`` (a label) was to serve."""
        seconds = _seconds(seconds)
        with self._lock:
            self.seconds += seconds
            key = replica or "none"  # waiting with no replica up: for one to come back
            self.by_replica[key] = self.by_replica.get(key, 0.0) + seconds

    def attribute(self, wait_s: float, round_trip_s: float, timing: Any) -> dict[str, float]:
        """Attribute ``wait_s`` seconds waited for one batch, whose request's round trip took
        ``round_trip_s`` and whose reply said ``timing`` (``BatchResponse.timing``, or ``None``), to
        the parts; returns that batch's split. (The total is counted by :meth:`add`.)"""
        wait, trip = _seconds(wait_s), _seconds(round_trip_s)
        parsed = read_timing(timing)
        if parsed is None:
            timeline = [("unsplit", trip)]
        else:
            queue, read, stages = parsed
            provider = queue + read + sum(stages.values())
            scale = trip / provider if provider > trip else 1.0  # never more than the round trip
            timeline = [("transfer", trip - provider * scale)]
            timeline += [(f"stage:{name}", seconds * scale) for name, seconds in reversed(stages.items())]
            timeline += [("read", read * scale), ("queue", queue * scale)]
        parts: dict[str, float] = {}
        left = wait
        for part, seconds in timeline:  # from the arrival backwards (see the module docstring)
            take = min(left, max(0.0, seconds))
            if take > 0.0:
                parts[part] = parts.get(part, 0.0) + take
                left -= take
        if left > 0.0:
            parts["other"] = left
        with self._lock:
            for part, seconds in parts.items():
                key = self._key(part)
                self.by_part[key] = self.by_part.get(key, 0.0) + seconds
        return parts

    def _key(self, part: str) -> str:
        """``part``, or :data:`MORE` for a stage past the :data:`MAX_STAGES` this meter keeps (under the lock)."""
        if not part.startswith("stage:") or part in self.by_part:
            return part
        if self._stages >= MAX_STAGES:
            return MORE
        self._stages += 1
        return part

    def snapshot(self) -> tuple[float, dict[str, float]]:
        with self._lock:
            return self.seconds, dict(self.by_replica)

    def breakdown(self) -> StallBreakdown:
        """Where the waiting went, JSON-ready::

            {"wait_s": 12.5,                       # all the loop waited
             "parts": {"stage:augment": 9.1, "read": 1.7, "transfer": 0.9, "queue": 0.8},
             "largest": "stage:augment",           # the part that took most (None before any)
             "slowest": "node-2 (tcp://...)"}      # the replica waited on longest (None before any)

        ``parts`` (largest first) add up to the waits the loader attributed: all of ``wait_s`` when the
        split is on (a ``RemoteLoader``'s ``stall_breakdown``), nothing when it is off."""
        with self._lock:
            parts = sorted(self.by_part.items(), key=lambda kv: -kv[1])
            total, by_replica = self.seconds, dict(self.by_replica)
        return {
            "wait_s": total,
            "parts": dict(parts),
            "largest": parts[0][0] if parts and parts[0][1] > 0 else None,
            "slowest": max(by_replica, key=by_replica.__getitem__) if by_replica else None,
        }

    def collect(self) -> Iterator[Metric]:
        """The prometheus-client ``Collector`` interface."""
        _, by_replica = self.snapshot()
        with self._lock:
            by_part = dict(self.by_part)
        family = CounterMetricFamily(
            "batchbus_loader_data_wait_seconds",
            "Seconds the training loop waited for batches (not hidden by prefetch), by the replica "
            "that was to serve the batch waited for.",
            labels=("dataset", "split", "replica"),
        )
        for replica, seconds in sorted(by_replica.items()):
            family.add_metric([self.dataset, self.split, replica], seconds)
        yield family
        parts = CounterMetricFamily(
            "batchbus_loader_data_wait_part_seconds",
            "Seconds the training loop waited for batches, by where the batches' time went: part queue, "
            "read, stage (with the stage's name), transfer, other (before the answered request was sent) or "
            "unsplit (no provider timing).",
            labels=("dataset", "split", "part", "stage"),
        )
        for key, seconds in sorted(by_part.items()):
            part, _, stage = key.partition(":")
            parts.add_metric([self.dataset, self.split, part, stage], seconds)
        yield parts

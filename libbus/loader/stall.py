"""The data-stall signal: seconds a training loop spent waiting for data, and for whom.

A loader that keeps enough requests in flight hands out each batch the moment the loop asks; any
time it spends waiting for a reply instead is time the model was idle because the providers were
behind. :class:`StallMeter` sums that time, in total and by the replica that held the batch being
waited for (which says which provider is slow), and exports it to Prometheus as
``batchbus_loader_data_wait_seconds_total{dataset, split, replica}`` — register it with any
``prometheus_client`` registry (``REGISTRY.register(loader.stall)``). The trainer service reports the
same figure in its progress (``busctl top``'s data-wait column) and its own metrics.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

__all__ = ["StallMeter"]


class StallMeter:
    """Seconds waited for data by one loader, by replica (see the module docstring).

    Written by the loop that iterates the loader, read by a scrape thread: a lock keeps the two
    figures consistent with each other.
    """

    def __init__(self, dataset: str, split: str):
        self.dataset, self.split = dataset, split
        self.seconds = 0.0
        self.by_replica: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, seconds: float, replica: str = "") -> None:
        """Count ``seconds`` spent waiting for a batch that ``replica`` (a label) was to serve."""
        with self._lock:
            self.seconds += seconds
            key = replica or "none"  # waiting with no replica up: for one to come back
            self.by_replica[key] = self.by_replica.get(key, 0.0) + seconds

    def snapshot(self) -> tuple[float, dict[str, float]]:
        with self._lock:
            return self.seconds, dict(self.by_replica)

    def collect(self) -> Iterator[Metric]:
        """The prometheus-client ``Collector`` interface."""
        _, by_replica = self.snapshot()
        family = CounterMetricFamily(
            "batchbus_loader_data_wait_seconds",
            "Seconds the training loop waited for batches (not hidden by prefetch), by the replica "
            "that was to serve the batch waited for.",
            labels=("dataset", "split", "replica"),
        )
        for replica, seconds in sorted(by_replica.items()):
            family.add_metric([self.dataset, self.split, replica], seconds)
        yield family

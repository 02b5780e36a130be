"""A trainer's stats record and its own Prometheus metrics: the job it runs, the data stall and its parts, jobs by final
state (the metrics every service has are :mod:`libbus.serve.metrics`'s)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypedDict

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from libbus.serve.metrics import Families

__all__ = ["TrainerStats", "trainer_metrics"]


class TrainerStats(TypedDict):
    """A trainer's heartbeat stats (its ``Stats`` row, ``busctl top``, its metrics)."""

    #: The job it runs now, or None.
    job: str | None
    #: Jobs run to an end, by final state.
    tasks: dict[str, int]
    #: Whether the link to the router is up.
    connected: bool
    #: Seconds its jobs waited for data, the running one's included.
    data_wait_s: float
    #: That wait by part (provider queue, read, ``stage:NAME``, transfer, other).
    data_wait_parts: dict[str, float]


def trainer_metrics(stats: TrainerStats, fams: Families) -> Iterator[Metric]:
    yield fams.one(
        GaugeMetricFamily, "trainer_job_running", "1 while the trainer runs a job.", 1 if stats["job"] else 0
    )
    # the data-stall signal: the model idle, waiting for batches
    yield fams.one(
        CounterMetricFamily, "trainer_data_wait_seconds", "Seconds training waited for data.", stats["data_wait_s"]
    )
    parts = stats["data_wait_parts"]
    if parts:  # where that wait went (libbus.loader.stall's split)
        fam = fams.family(
            CounterMetricFamily,
            "trainer_data_wait_part_seconds",
            "Seconds training waited for data, by part: provider queue, source read, each pipeline stage "
            "(stage:NAME), transfer, other.",
            ("part",),
        )
        for part, seconds in sorted(parts.items()):
            fam.add_metric(fams.labels(str(part)), float(seconds))
        yield fam
    tasks = stats["tasks"]
    yield fams.by(CounterMetricFamily, "tasks", "Jobs this trainer ran to an end, by final state.", "state", tasks)

"""The trainer's own Prometheus metrics: the job it runs, the data stall and its parts, jobs by final
state (the metrics every service has are :mod:`libbus.serve.metrics`'s)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from libbus.serve.metrics import Families

if TYPE_CHECKING:
    from .app import TrainerStats

__all__ = ["trainer_metrics"]


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

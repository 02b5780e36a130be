"""The router's own Prometheus metrics: jobs by state, peers by role (the metrics every service has are
:mod:`libbus.serve.metrics`'s)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from libbus.serve.metrics import Families

from .handler import RouterRow, RouterStats

__all__ = ["router_metrics"]


def router_metrics(stats: RouterRow | RouterStats, fams: Families) -> Iterator[Metric]:
    yield fams.by(GaugeMetricFamily, "jobs", "Jobs in the router's queue, by state.", "state", stats["jobs"])
    yield fams.by(GaugeMetricFamily, "peers", "Peers connected to the router, by role.", "role", stats["peers"])

"""Prometheus metrics for operators: a service's live counters in the text exposition format.

Nothing is counted twice. The services already keep their counters (``Server.counters``, a
handler's ``stats``); :class:`StatsCollector` turns the service's
``stats()`` record into metric families at scrape time, on prometheus-client's HTTP thread.

This module knows only what every service has (the server's counters, sessions, requests pending,
the link to the router). Each service names its own metrics in its own ``metrics`` module
(``services/provider/metrics.py`` and its peers): a :data:`ServiceMetrics` function, given to
:func:`start_exporter`, that reads the service's stats into families made with :class:`Families`.
:class:`LatencyHistogram` is the one new piece of counting: a fixed-bucket histogram cheap enough
to observe on every batch; :class:`GcPauses` keeps one per generation of the garbage collector, timing
each collection, during which no Python code of the process runs (it holds the GIL).

Each exporter has its own :class:`~prometheus_client.CollectorRegistry` (never the process-wide
default), so several services in one process (tests, ``busctl demo``) each export only their own.
"""

from __future__ import annotations

import bisect
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from libbus.errors import BusError, ConfigError

__all__ = [
    "LATENCY_BUCKETS_S",
    "Families",
    "GcPauses",
    "LatencyHistogram",
    "MetricsExporter",
    "ServiceMetrics",
    "StatsCollector",
    "gc_pauses",
    "parse_bind",
    "start_exporter",
]

log = logging.getLogger(__name__)

PREFIX = "batchbus_"
#: Upper bounds (seconds) of the batch latency buckets: 100 µs to 5 s.
LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: A stats() call racing the service loop (a dict resized mid-copy) is retried this often.
_STATS_ATTEMPTS = 3


class LatencyHistogram:
    """Fixed buckets, cumulative only when read: :meth:`observe` is a bisect and two adds.

    Written by the service loop, read by the scrape thread; a scrape may see one observation in
    the count and not yet in the sum, which Prometheus tolerates (rates over scrapes are unaffected).
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Iterable[float] = LATENCY_BUCKETS_S):
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def snapshot(self) -> tuple[list[tuple[str, int]], float]:
        """``([(le, cumulative count), ..., ("+Inf", total)], sum)`` as Prometheus wants them."""
        counts, total = list(self.counts), 0
        buckets = []
        for bound, n in zip((*map(repr, self.bounds), "+Inf"), counts):
            total += n
            buckets.append((bound, total))
        return buckets, self.sum


class GcPauses:
    """How long each garbage collection of this process took, by generation (0, 1, 2): a
    ``gc.callbacks`` entry. No Python code of the process runs while one does (it holds the GIL), so
    each is a pause of the serving loop and of every reply not yet handed to ZeroMQ. One per process (:func:`gc_pauses`); every service's ``/metrics``
    exports it."""

    def __init__(self) -> None:
        self.by_generation = tuple(LatencyHistogram() for _ in range(3))
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        # One collection at a time, the GIL held throughout: each "start" is followed by its "stop".
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started:
            self.by_generation[info["generation"]].observe(time.perf_counter() - self._started)
            self._started = 0.0


_gc_pauses: list[GcPauses] = []
_gc_lock = threading.Lock()


def gc_pauses() -> GcPauses:
    """This process's :class:`GcPauses`, added to ``gc.callbacks`` by the first call (only then are
    collections timed)."""
    with _gc_lock:
        if not _gc_pauses:
            _gc_pauses.append(GcPauses())
            gc.callbacks.append(_gc_pauses[0])
        return _gc_pauses[0]


def _gc_families(pauses: GcPauses, fams: Families) -> Iterator[Metric]:
    """The process's garbage collections (every service in it reports the same figures)."""
    fam = fams.family(
        HistogramMetricFamily,
        "gc_pause_seconds",
        "Garbage collections of the service's process, by generation: no Python code runs during one.",
        ("generation",),
    )
    for generation, hist in enumerate(pauses.by_generation):
        buckets, total = hist.snapshot()
        fam.add_metric(fams.labels(str(generation)), buckets, total)
    yield fam
    yield fams.one(
        GaugeMetricFamily,
        "gc_frozen_objects",
        "Objects of the service's start-up that no collection walks (frozen once it started).",
        gc.get_freeze_count(),
    )


# Server.counters keys with their metric and help text; ``error_*`` keys become one labelled metric.
_SERVER_COUNTERS = {
    "received": ("messages_received", "Messages received on the service's ROUTER socket."),
    "sent": ("messages_sent", "Replies and pushes sent."),
    "send_dropped": ("messages_dropped", "Replies dropped because the peer was gone or its queue full."),
    "malformed": ("malformed", "Messages that could not be decoded (answered with an error)."),
    "sessions_opened": ("sessions_opened", "Sessions authenticated (Hello accepted)."),
    "sessions_closed": ("sessions_closed", "Sessions ended (silent, replaced, expired, service stopping)."),
}


class Families:
    """Makes one service's metric families: every metric named ``batchbus_<metric>`` and labelled
    with the service kind and name first (``service``, ``name``), then its own labels."""

    def __init__(self, service: str, name: str):
        self.service, self.name = service, name

    def family(self, kind: Callable[..., Any], metric: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
        """An empty family of ``kind`` (a prometheus-client ``*MetricFamily``); add samples with
        ``fam.add_metric(families.labels(*values), value)``."""
        return kind(PREFIX + metric, doc, labels=("service", "name", *labels))

    def labels(self, *values: str) -> list[str]:
        """A sample's label values: this service's, then ``values``."""
        return [self.service, self.name, *values]

    def one(self, kind: Callable[..., Any], metric: str, doc: str, value: float) -> Any:
        """A family of one unlabelled sample."""
        fam = self.family(kind, metric, doc)
        fam.add_metric(self.labels(), float(value))
        return fam

    def by(self, kind: Callable[..., Any], metric: str, doc: str, label: str, values: dict) -> Any:
        """A family of one sample per ``values`` item (label value → number), in label order."""
        fam = self.family(kind, metric, doc, (label,))
        for key, value in sorted(values.items()):
            fam.add_metric(self.labels(str(key)), float(value))
        return fam


#: A service's stats record (a ``TypedDict``: the provider's, the router's, the trainer's).
S = TypeVar("S", bound=Mapping[str, object])

#: A service's own metrics: its ``stats()`` record → the families only that service has.
ServiceMetrics = Callable[[S, Families], Iterator[Metric]]


class StatsCollector(Collector, Generic[S]):
    """Reads ``stats()`` (the record a service puts on its heartbeats) at each scrape.

    Args:
        service: ``router``, ``provider`` or ``trainer`` (the ``service`` label).
        name: the service's name (the ``name`` label).
        stats: returns the service's stats record; called on the scrape thread.
        own: the service's own metrics (its ``metrics`` module), after the ones every service has.
    """

    def __init__(self, service: str, name: str, stats: Callable[[], S], own: ServiceMetrics[S] | None = None):
        self.families = Families(service, name)
        self.stats = stats
        self.own = own
        self.gc_pauses = gc_pauses()

    @property
    def service(self) -> str:
        return self.families.service

    @property
    def name(self) -> str:
        return self.families.name

    def _read(self) -> S:
        for _ in range(_STATS_ATTEMPTS - 1):
            try:
                return self.stats()
            except RuntimeError:  # "dictionary changed size during iteration": the loop moved on
                pass
        return self.stats()

    def collect(self) -> Iterator[Metric]:
        stats = self._read()
        fams = self.families
        one = fams.one
        counters = stats.get("counters")
        if isinstance(counters, dict):
            for key, (metric, doc) in _SERVER_COUNTERS.items():
                yield one(CounterMetricFamily, metric, doc, counters.get(key, 0))
            codes: dict[str, float] = {}
            for key, value in counters.items():
                if key.startswith("error_"):
                    codes[key[len("error_") :]] = codes.get(key[len("error_") :], 0) + value
            if counters.get("internal"):
                codes["INTERNAL"] = codes.get("INTERNAL", 0) + counters["internal"]
            yield fams.by(CounterMetricFamily, "errors", "Error replies sent, by error code.", "code", codes)
        sessions, pending = stats.get("sessions"), stats.get("pending")
        if isinstance(sessions, int):
            yield one(GaugeMetricFamily, "sessions", "Sessions open now.", sessions)
        if isinstance(pending, int):
            yield one(
                GaugeMetricFamily,
                "pending_requests",
                "Requests whose reply is being computed off the loop (evaluations).",
                pending,
            )
        if "connected" in stats:
            yield one(
                GaugeMetricFamily,
                "router_connected",
                "1 while the link to the router is up.",
                1 if stats["connected"] else 0,
            )
        yield from _gc_families(self.gc_pauses, fams)
        if self.own is not None:
            yield from self.own(stats, fams)


def parse_bind(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) → ``(host, port)``; port 0 picks a free one.

    Raises :class:`ConfigError` naming the expected form.
    """
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"metrics_bind must be HOST:PORT (e.g. 127.0.0.1:9464), got {value!r}")
    return host, int(port)


@dataclass
class MetricsExporter:
    """A running ``/metrics`` HTTP endpoint. Build it with :meth:`start`; :meth:`close` stops it."""

    host: str
    port: int
    _server: WSGIServer | None
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    @classmethod
    def start(cls, bind: str, collector: StatsCollector) -> MetricsExporter:
        """Serve ``collector`` (plus the process's CPU and memory) on ``bind`` (``HOST:PORT``).

        Raises :class:`ConfigError` for a malformed address, :class:`BusError` (``UNAVAILABLE``) if it
        cannot be bound.
        """
        host, port = parse_bind(bind)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        ProcessCollector(namespace="batchbus", registry=registry)
        try:
            server, thread = start_http_server(port, host, registry=registry)
        except OSError as err:
            raise BusError(f"cannot bind metrics on {bind}: {err.strerror or err}", code="UNAVAILABLE") from err
        exporter = cls(host, server.server_address[1], server, thread)
        log.info("%s %s: metrics on %s", collector.service, collector.name, exporter.url)
        return exporter

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout_s)
        self._server = None


def start_exporter(
    bind: str, service: str, name: str, stats: Callable[[], S], own: ServiceMetrics[S] | None = None
) -> MetricsExporter | None:
    """:meth:`MetricsExporter.start` when ``bind`` is set, else ``None`` (metrics off). ``own``:
    the service's own metrics (see :class:`StatsCollector`)."""
    if not bind:
        return None
    return MetricsExporter.start(bind, StatsCollector(service, name, stats, own))

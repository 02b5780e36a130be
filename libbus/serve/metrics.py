"""Prometheus metrics for operators: a service's live counters in the text exposition format.

Nothing is counted twice. The services already keep their counters (``Server.counters``, a
handler's :meth:`~libbus.serve.server.Handler.stats`); :class:`StatsCollector` turns the service's
``stats()`` dict into metric families at scrape time, on prometheus-client's HTTP thread.
:class:`LatencyHistogram` is the one new piece of counting: a fixed-bucket histogram cheap enough
to observe on every batch.

Each exporter has its own :class:`~prometheus_client.CollectorRegistry` (never the process-wide
default), so several services in one process (tests, ``busctl demo``) each export only their own.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
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
    "LatencyHistogram",
    "MetricsExporter",
    "StatsCollector",
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


# Server.counters keys with their metric and help text; ``error_*`` keys become one labelled metric.
_SERVER_COUNTERS = {
    "received": ("messages_received", "Messages received on the service's ROUTER socket."),
    "sent": ("messages_sent", "Replies and pushes sent."),
    "send_dropped": ("messages_dropped", "Replies dropped because the peer was gone or its queue full."),
    "malformed": ("malformed", "Messages that could not be decoded (answered with an error)."),
    "sessions_opened": ("sessions_opened", "Sessions authenticated (Hello accepted)."),
    "sessions_closed": ("sessions_closed", "Sessions ended (silent, replaced, expired, service stopping)."),
}
_SERVED = {
    "samples": ("samples_served", "Samples served, by dataset (socket and shared memory)."),
    "bytes": ("bytes_served", "Sample and label bytes served, by dataset."),
    "batches": ("batches_served", "Batches served, by dataset (socket and shared memory)."),
    "shm_batches": ("shm_batches_served", "Batches written into a trainer's shared-memory ring, by dataset."),
    "evaluations": ("evaluations", "Evaluations run on the provider's own test split, by dataset."),
    "queue_s": (
        "batch_queue_seconds",
        "Seconds batch requests waited at the provider before their read began (behind its dataset's other batches), by dataset.",
    ),
    "fill_s": (
        "batch_fill_seconds",
        "Seconds spent reading batches into their reply or ring slot (source I/O and pipeline stages), by dataset.",
    ),
}

#: A pipeline stage's stats keys (``queue_*``: its output queue's) with their metric and help text.
_STAGE_METRICS: dict[str, tuple[type[Metric], str, str]] = {
    "items_in": (CounterMetricFamily, "stage_items_in", "Samples a pipeline stage took in, by dataset and stage."),
    "items_out": (CounterMetricFamily, "stage_items_out", "Samples a pipeline stage put out."),
    "errors": (CounterMetricFamily, "stage_errors", "Chunks a pipeline stage failed on (each failed its batch)."),
    "busy_s": (CounterMetricFamily, "stage_busy_seconds", "Seconds a pipeline stage spent working."),
    "bad_images": (CounterMetricFamily, "stage_bad_images", "Bad images a decode stage met (skipped or failed)."),
    "queue_size": (GaugeMetricFamily, "stage_queue_size", "Chunks waiting in a stage's output queue now."),
    "queue_capacity": (GaugeMetricFamily, "stage_queue_capacity", "Chunks a stage's output queue holds."),
    "queue_put": (CounterMetricFamily, "stage_queue_put", "Chunks put into a stage's output queue."),
    "queue_get": (CounterMetricFamily, "stage_queue_get", "Chunks taken from a stage's output queue."),
    "queue_drop": (
        CounterMetricFamily,
        "stage_queue_drop",
        "Chunks taken from a stage's output queue and dropped: their batch had already failed.",
    ),
}


#: A remote dataset's reads (provider stats ``remote_reads``, per dataset).
_REMOTE_READS: dict[str, tuple[type[Metric], str, str]] = {
    "inflight": (GaugeMetricFamily, "remote_requests_inflight", "Requests of a remote dataset in flight now."),
    "inflight_limit": (
        GaugeMetricFamily,
        "remote_requests_limit",
        "Requests a remote dataset may have in flight now (it climbs with throughput: the bandwidth-delay product).",
    ),
    "ram_cache_bytes": (GaugeMetricFamily, "ram_cache_bytes", "Bytes of whole blocks a dataset's RAM cache holds."),
    "ram_cache_hits": (CounterMetricFamily, "ram_cache_hits", "Blocks read from a dataset's RAM cache."),
    "ram_cache_fetches": (CounterMetricFamily, "ram_cache_fetches", "Blocks fetched whole into a dataset's RAM cache."),
    "ram_cache_evictions": (CounterMetricFamily, "ram_cache_evictions", "Blocks evicted from a dataset's RAM cache."),
}

#: Object-store reads (provider stats ``object_store``) and its disk caches' (``object_store.caches``).
_OBJECT_METRICS: dict[str, tuple[type[Metric], str, str]] = {
    "requests": (CounterMetricFamily, "object_requests", "Ranged requests sent to object stores, retries included."),
    "retries": (
        CounterMetricFamily,
        "object_retries",
        "Object-store requests retried (429, 503 SlowDown, 5xx, drops).",
    ),
    "failures": (CounterMetricFamily, "object_failures", "Object-store reads that failed their batch (UNAVAILABLE)."),
    "bytes_fetched": (CounterMetricFamily, "object_bytes_fetched", "Bytes read from object stores."),
}
_CACHE_METRICS: dict[str, tuple[type[Metric], str, str]] = {
    "hits": (CounterMetricFamily, "object_cache_hits", "Blocks served from the provider's disk cache."),
    "misses": (CounterMetricFamily, "object_cache_misses", "Blocks not in the disk cache (fetched)."),
    "evictions": (CounterMetricFamily, "object_cache_evictions", "Blocks evicted from the disk cache (LRU)."),
    "bytes_hit": (CounterMetricFamily, "object_cache_bytes_hit", "Bytes served from the disk cache."),
    "bytes_stored": (CounterMetricFamily, "object_cache_bytes_stored", "Bytes this provider stored in the cache."),
    "bytes": (GaugeMetricFamily, "object_cache_bytes", "Bytes the cache directory holds now (all its providers)."),
    "limit_bytes": (GaugeMetricFamily, "object_cache_limit_bytes", "The most bytes the cache holds."),
}

#: The provider's decode cache (stats ``decode_cache``; docs/datasets.md §7.7): per dataset, then the
#: whole RAM tier, then its disk tier (``decode_cache.disk``).
_DECODE_PER_DATASET: dict[str, tuple[type[Metric], str, str]] = {
    "hits": (CounterMetricFamily, "decode_cache_hits", "Samples the decode cache answered, by dataset."),
    "misses": (CounterMetricFamily, "decode_cache_misses", "Samples not in the decode cache (decoded), by dataset."),
    "hit_rate": (GaugeMetricFamily, "decode_cache_hit_rate", "Decode cache hits / lookups so far, by dataset."),
    "entries": (GaugeMetricFamily, "decode_cache_dataset_entries", "Samples in the RAM tier now, by dataset."),
    "bytes": (GaugeMetricFamily, "decode_cache_dataset_bytes", "Bytes in the RAM tier now, by dataset."),
    "final_hits": (
        CounterMetricFamily,
        "decode_cache_final_hits",
        "Samples served whole from the cache (final outputs).",
    ),
    "final_misses": (CounterMetricFamily, "decode_cache_final_misses", "Samples whose final output was not cached."),
}
_DECODE_CACHE: dict[str, tuple[type[Metric], str, str]] = {
    "bytes": (GaugeMetricFamily, "decode_cache_bytes", "Bytes the decode cache's RAM tier holds now."),
    "limit_bytes": (GaugeMetricFamily, "decode_cache_limit_bytes", "The most bytes the RAM tier holds."),
    "entries": (GaugeMetricFamily, "decode_cache_entries", "Samples the RAM tier holds now."),
    "evictions": (CounterMetricFamily, "decode_cache_evictions", "Samples evicted from the RAM tier (LRU)."),
}
_DECODE_DISK: dict[str, tuple[type[Metric], str, str]] = {
    "bytes": (GaugeMetricFamily, "decode_cache_disk_bytes", "Bytes the decode cache's disk tier holds now."),
    "limit_bytes": (GaugeMetricFamily, "decode_cache_disk_limit_bytes", "The most bytes the disk tier holds."),
    "entries": (GaugeMetricFamily, "decode_cache_disk_entries", "Samples the disk tier holds now."),
    "hits": (CounterMetricFamily, "decode_cache_disk_hits", "Samples the disk tier gave back to RAM."),
    "corrupt": (
        CounterMetricFamily,
        "decode_cache_disk_corrupt",
        "Disk-tier files found truncated or corrupt: removed, their samples decoded again.",
    ),
}


class StatsCollector(Collector):
    """Reads ``stats()`` (the dict a service puts on its heartbeats) at each scrape.

    Args:
        service: ``router``, ``provider`` or ``trainer`` (the ``service`` label).
        name: the service's name (the ``name`` label).
        stats: returns the service's stats dict; called on the scrape thread.
        latency: per dataset, the batch-serving latency histogram (provider only).
    """

    def __init__(
        self,
        service: str,
        name: str,
        stats: Callable[[], dict],
        latency: Callable[[], dict[str, LatencyHistogram]] | None = None,
    ):
        self.service = service
        self.name = name
        self.stats = stats
        self.latency = latency

    def _read(self) -> dict:
        for attempt in range(_STATS_ATTEMPTS):
            try:
                return self.stats()
            except RuntimeError:  # "dictionary changed size during iteration": the loop moved on
                if attempt == _STATS_ATTEMPTS - 1:
                    raise
        return {}

    def collect(self) -> Iterator[Metric]:
        stats = self._read()

        def family(kind, metric: str, doc: str, labels: tuple[str, ...] = ()):
            return kind(PREFIX + metric, doc, labels=("service", "name", *labels))

        def one(kind, metric: str, doc: str, value) -> Metric:
            fam = family(kind, metric, doc)
            fam.add_metric([self.service, self.name], float(value))
            return fam

        counters = stats.get("counters")
        if isinstance(counters, dict):
            for key, (metric, doc) in _SERVER_COUNTERS.items():
                yield one(CounterMetricFamily, metric, doc, counters.get(key, 0))
            errors = family(CounterMetricFamily, "errors", "Error replies sent, by error code.", ("code",))
            codes: dict[str, float] = {}
            for key, value in counters.items():
                if key.startswith("error_"):
                    codes[key[len("error_") :]] = codes.get(key[len("error_") :], 0) + value
            if counters.get("internal"):
                codes["INTERNAL"] = codes.get("INTERNAL", 0) + counters["internal"]
            for code, value in sorted(codes.items()):
                errors.add_metric([self.service, self.name, code], float(value))
            yield errors
        if "sessions" in stats:
            yield one(GaugeMetricFamily, "sessions", "Sessions open now.", stats["sessions"])
        if "pending" in stats:
            yield one(
                GaugeMetricFamily,
                "pending_requests",
                "Requests whose reply is being computed off the loop (evaluations).",
                stats["pending"],
            )
        if "connected" in stats:
            yield one(
                GaugeMetricFamily,
                "router_connected",
                "1 while the link to the router is up.",
                1 if stats["connected"] else 0,
            )
        yield from self._provider(stats, family)
        yield from self._router(stats, family)
        yield from self._trainer(stats, family, one)

    def _provider(self, stats: dict, family) -> Iterator[Metric]:
        refused = stats.get("refused")
        if isinstance(refused, dict):
            fam = family(
                CounterMetricFamily,
                "refused",
                "Requests refused before serving, by reason (scope, unassigned, split_private, ring, stale_slot).",
                ("reason",),
            )
            for reason, value in sorted(refused.items()):
                fam.add_metric([self.service, self.name, reason], float(value))
            yield fam
        datasets = stats.get("datasets")
        if isinstance(datasets, dict):
            for key, (metric, doc) in _SERVED.items():
                fam = family(CounterMetricFamily, metric, doc, ("dataset",))
                for dataset, served in sorted(datasets.items()):
                    fam.add_metric([self.service, self.name, dataset], float(served.get(key, 0)))
                yield fam
        if "evaluations_running" in stats:
            fam = family(GaugeMetricFamily, "evaluations_running", "Evaluations running now.")
            fam.add_metric([self.service, self.name], float(stats["evaluations_running"]))
            yield fam
        pipelines = stats.get("pipelines")
        if isinstance(pipelines, dict):
            yield from self._stages(pipelines, family)
        objects = stats.get("object_store")
        if isinstance(objects, dict):
            yield from self._object_store(objects, family)
        remote = stats.get("remote_reads")
        if isinstance(remote, dict) and remote:
            for key, (kind, metric, doc) in _REMOTE_READS.items():
                fam = family(kind, metric, doc, ("dataset",))
                for dataset, row in sorted(remote.items()):
                    if key in row:
                        fam.add_metric([self.service, self.name, dataset], float(row[key]))
                yield fam
        decode = stats.get("decode_cache")
        if isinstance(decode, dict):
            yield from self._decode_cache(decode, family)
        if self.latency is not None:
            fam = family(
                HistogramMetricFamily,
                "batch_seconds",
                "Time to assemble one batch (read samples, fill the reply or ring slot), by dataset.",
                ("dataset",),
            )
            for dataset, hist in sorted(self.latency().items()):
                buckets, total = hist.snapshot()
                fam.add_metric([self.service, self.name, dataset], buckets, total)
            yield fam

    def _object_store(self, objects: dict, family) -> Iterator[Metric]:
        """Requests to object stores (s3://, gs://, az://) and, per cache directory, the disk cache."""
        for key, (kind, metric, doc) in _OBJECT_METRICS.items():
            fam = family(kind, metric, doc)
            fam.add_metric([self.service, self.name], float(objects.get(key, 0)))
            yield fam
        caches = objects.get("caches")
        if isinstance(caches, dict):
            for key, (kind, metric, doc) in _CACHE_METRICS.items():
                fam = family(kind, metric, doc, ("cache_dir",))
                for where, c in sorted(caches.items()):
                    fam.add_metric([self.service, self.name, where], float(c.get(key, 0)))
                yield fam

    def _decode_cache(self, cache: dict, family) -> Iterator[Metric]:
        """The decode cache: per dataset, its RAM tier, its disk tier (when it has one)."""
        datasets = cache.get("datasets")
        if isinstance(datasets, dict):
            for key, (kind, metric, doc) in _DECODE_PER_DATASET.items():
                fam = family(kind, metric, doc, ("dataset",))
                for dataset, row in sorted(datasets.items()):
                    fam.add_metric([self.service, self.name, dataset], float(row.get(key, 0)))
                yield fam
        for tier, table in ((cache, _DECODE_CACHE), (cache.get("disk"), _DECODE_DISK)):
            if isinstance(tier, dict):
                for key, (kind, metric, doc) in table.items():
                    fam = family(kind, metric, doc)
                    fam.add_metric([self.service, self.name], float(tier.get(key, 0)))
                    yield fam

    def _stages(self, pipelines: dict, family) -> Iterator[Metric]:
        """Per stage of each pipeline dataset: its counters, and its output queue's (the pipeline's
        request queue under the stage name ``(requests)``)."""
        labels = ("dataset", "stage")
        fams = {key: family(kind, metric, doc, labels) for key, (kind, metric, doc) in _STAGE_METRICS.items()}
        for dataset, pipeline in sorted(pipelines.items()):
            rows: list[tuple[str, dict, dict]] = [("(requests)", {}, pipeline.get("requests", {}))]
            rows += [(st.get("name", "?"), st, st.get("queue", {})) for st in pipeline.get("stages", [])]
            for stage, counters, queue in rows:
                values = {
                    **{k: counters.get(k) for k in ("items_in", "items_out", "errors", "busy_s", "bad_images")},
                    **{f"queue_{k}": queue.get(k) for k in ("size", "capacity", "put", "get", "drop")},
                }
                for key, value in values.items():
                    if isinstance(value, (int, float)):
                        fams[key].add_metric([self.service, self.name, dataset, stage], float(value))
        yield from fams.values()

    def _router(self, stats: dict, family) -> Iterator[Metric]:
        jobs = stats.get("jobs")
        if isinstance(jobs, dict):
            fam = family(GaugeMetricFamily, "jobs", "Jobs in the router's queue, by state.", ("state",))
            for state, n in sorted(jobs.items()):
                fam.add_metric([self.service, self.name, state], float(n))
            yield fam
        peers = stats.get("peers")
        if isinstance(peers, dict):
            fam = family(GaugeMetricFamily, "peers", "Peers connected to the router, by role.", ("role",))
            for role, n in sorted(peers.items()):
                fam.add_metric([self.service, self.name, role], float(n))
            yield fam

    def _trainer(self, stats: dict, family, one) -> Iterator[Metric]:
        if self.service != "trainer":
            return
        yield one(
            GaugeMetricFamily, "trainer_job_running", "1 while the trainer runs a job.", 1 if stats.get("job") else 0
        )
        wait = stats.get("data_wait_s")
        if isinstance(wait, (int, float)):  # the data-stall signal: the model idle, waiting for batches
            yield one(CounterMetricFamily, "trainer_data_wait_seconds", "Seconds training waited for data.", wait)
        parts = stats.get("data_wait_parts")
        if isinstance(parts, dict) and parts:  # where that wait went (libbus.loader.stall's split)
            fam = family(
                CounterMetricFamily,
                "trainer_data_wait_part_seconds",
                "Seconds training waited for data, by part: provider queue, source read, each pipeline stage "
                "(stage:NAME), transfer, other.",
                ("part",),
            )
            for part, seconds in sorted(parts.items()):
                fam.add_metric([self.service, self.name, str(part)], float(seconds))
            yield fam
        tasks = stats.get("tasks")
        if isinstance(tasks, dict):
            fam = family(CounterMetricFamily, "tasks", "Jobs this trainer ran to an end, by final state.", ("state",))
            for state, n in sorted(tasks.items()):
                fam.add_metric([self.service, self.name, state], float(n))
            yield fam


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
    bind: str,
    service: str,
    name: str,
    stats: Callable[[], dict],
    latency: Callable[[], dict[str, LatencyHistogram]] | None = None,
) -> MetricsExporter | None:
    """:meth:`MetricsExporter.start` when ``bind`` is set, else ``None`` (metrics off)."""
    if not bind:
        return None
    return MetricsExporter.start(bind, StatsCollector(service, name, stats, latency))

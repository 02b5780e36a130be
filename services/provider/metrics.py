"""The provider's stats records and its own Prometheus metrics (docs/operations.md lists them).

:class:`ProviderStats` is what its handler's ``stats()`` returns (the ``Stats`` reply, cut to what a
token may see by :func:`stats_within_scope`), :class:`ProviderBeat` what its heartbeats carry and
:class:`ProviderRow` what its metrics read: what it served, by dataset; what it refused; its
pipelines' stages; its remote reads, object stores and caches; the time each batch took.
:func:`provider_metrics` is what :class:`~.app.ProviderService` gives its exporter; the metrics every
service has are :mod:`libbus.serve.metrics`'s."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from libbus.security.auth import Claims
from libbus.serve.metrics import Families, LatencyHistogram, ServiceMetrics
from libbus.serve.server import ServerStats

from .destination import DatasetServed
from .sources import Source
from .sources.pipeline.engine import PipelineRow
from .sources.storage.blockmemory import ReadStats
from .sources.storage.objects import ObjectStoreRow

__all__ = [
    "ProviderStats",
    "ProviderBeat",
    "ProviderRow",
    "provider_metrics",
    "remote_read_stats",
    "stats_within_scope",
]


class ProviderStats(PipelineRow, ObjectStoreRow):
    """A provider handler's own stats (its ``Stats`` reply, after its server's figures on its heartbeats and
    metrics): what it served and refused, its evaluations, its remote reads; ``pipelines``,
    ``decode_cache`` and ``object_store`` where it has them."""

    #: Per dataset, what it served.
    datasets: dict[str, DatasetServed]
    #: Batch requests waiting for the router to assign their trainer.
    waiting_assignment: int
    #: Requests refused, by reason.
    refused: dict[str, int]
    evaluations_running: int
    #: Per remote dataset read from files, how its reads go now.
    remote_reads: dict[str, ReadStats]
    evaluations_queued: int


class ProviderBeat(ServerStats, ProviderStats):
    """A provider's heartbeat stats (its row of the router's ``Stats``): its server's figures, then its
    handler's."""


class ProviderRow(ProviderBeat):
    """What a provider's metrics read: its heartbeat stats, and whether its link to the router is up."""

    connected: bool


V = TypeVar("V")


def remote_read_stats(datasets: dict[str, Source]) -> dict[str, ReadStats]:
    """Per remote dataset read from files (``http(s)://``, an object store): its requests in flight and
    their limit now, and its RAM cache's counters (``busctl queues --json``, the metrics)."""
    out = {}
    for name, source in datasets.items():
        location = getattr(source, "location", None)
        if source.remote and location is not None:
            out[name] = location.stats()
    return out


def stats_within_scope(stats: ProviderStats, claims: Claims) -> ProviderStats:
    """``stats`` as ``claims`` may see them: a scoped token (a tenant's) sees the per-dataset rows of
    the datasets its ``datasets`` scope names and of no other (a ``jobs`` scope alone names none), so
    it learns neither the names nor the reads of other tenants' datasets; an unrestricted token all."""
    if not claims.scopes:
        return stats
    named = "datasets" in claims.scopes

    def seen(rows: Mapping[str, V]) -> dict[str, V]:
        return {d: v for d, v in rows.items() if named and claims.allows_dataset(d)}

    out = stats.copy()
    out["datasets"] = seen(stats["datasets"])
    out["remote_reads"] = seen(stats["remote_reads"])
    if "pipelines" in stats:
        out["pipelines"] = seen(stats["pipelines"])
    return out


#: Per dataset, the batch-serving latency histogram.
Latency = Callable[[], dict[str, LatencyHistogram]]

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


def _served(stats: ProviderRow, fams: Families, latency: Latency | None) -> Iterator[Metric]:
    fam = fams.family(
        CounterMetricFamily,
        "refused",
        "Requests refused before serving, by reason (scope, unassigned, split_private, ring, stale_slot).",
        ("reason",),
    )
    for reason, value in sorted(stats["refused"].items()):
        fam.add_metric(fams.labels(reason), float(value))
    yield fam
    datasets: Mapping[str, Mapping[str, Any]] = stats["datasets"]  # read by the table's keys
    for key, (metric, doc) in _SERVED.items():
        fam = fams.family(CounterMetricFamily, metric, doc, ("dataset",))
        for dataset, served in sorted(datasets.items()):
            fam.add_metric(fams.labels(dataset), float(served.get(key, 0)))
        yield fam
    yield fams.one(GaugeMetricFamily, "evaluations_running", "Evaluations running now.", stats["evaluations_running"])
    if "pipelines" in stats:
        yield from _stages(stats["pipelines"], fams)
    if "object_store" in stats:
        yield from _object_store(stats["object_store"], fams)
    remote: Mapping[str, Mapping[str, Any]] = stats["remote_reads"]
    if remote:
        for key, (kind, metric, doc) in _REMOTE_READS.items():
            fam = fams.family(kind, metric, doc, ("dataset",))
            for dataset, row in sorted(remote.items()):
                if key in row:
                    fam.add_metric(fams.labels(dataset), float(row[key]))
            yield fam
    if "decode_cache" in stats:
        yield from _decode_cache(stats["decode_cache"], fams)
    if latency is not None:
        fam = fams.family(
            HistogramMetricFamily,
            "batch_seconds",
            "Time to assemble one batch (read samples, fill the reply or ring slot), by dataset.",
            ("dataset",),
        )
        for dataset, hist in sorted(latency().items()):
            buckets, total = hist.snapshot()
            fam.add_metric(fams.labels(dataset), buckets, total)
        yield fam


def _object_store(objects: Mapping[str, Any], fams: Families) -> Iterator[Metric]:
    """Requests to object stores (s3://, gs://, az://) and, per cache directory, the disk cache."""
    for key, (kind, metric, doc) in _OBJECT_METRICS.items():
        fam = fams.family(kind, metric, doc)
        fam.add_metric(fams.labels(), float(objects.get(key, 0)))
        yield fam
    caches = objects.get("caches")
    if isinstance(caches, dict):
        for key, (kind, metric, doc) in _CACHE_METRICS.items():
            fam = fams.family(kind, metric, doc, ("cache_dir",))
            for where, c in sorted(caches.items()):
                fam.add_metric(fams.labels(where), float(c.get(key, 0)))
            yield fam


def _decode_cache(cache: Mapping[str, Any], fams: Families) -> Iterator[Metric]:
    """The decode cache: per dataset, its RAM tier, its disk tier (when it has one)."""
    datasets = cache.get("datasets")
    if isinstance(datasets, dict):
        for key, (kind, metric, doc) in _DECODE_PER_DATASET.items():
            fam = fams.family(kind, metric, doc, ("dataset",))
            for dataset, row in sorted(datasets.items()):
                fam.add_metric(fams.labels(dataset), float(row.get(key, 0)))
            yield fam
    for tier, table in ((cache, _DECODE_CACHE), (cache.get("disk"), _DECODE_DISK)):
        if isinstance(tier, dict):
            for key, (kind, metric, doc) in table.items():
                fam = fams.family(kind, metric, doc)
                fam.add_metric(fams.labels(), float(tier.get(key, 0)))
                yield fam


def _stages(pipelines: Mapping[str, Mapping[str, Any]], fams: Families) -> Iterator[Metric]:
    """Per stage of each pipeline dataset: its counters, and its output queue's (the pipeline's
    request queue under the stage name ``(requests)``)."""
    labels = ("dataset", "stage")
    by_key = {key: fams.family(kind, metric, doc, labels) for key, (kind, metric, doc) in _STAGE_METRICS.items()}
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
                    by_key[key].add_metric(fams.labels(dataset, stage), float(value))
    yield from by_key.values()


def provider_metrics(latency: Latency | None = None) -> ServiceMetrics[ProviderRow]:
    """The provider's metrics, with ``latency`` (per dataset, the time to assemble a batch) as a histogram."""

    def families(stats: ProviderRow, fams: Families) -> Iterator[Metric]:
        return _served(stats, fams, latency)

    return families

"""A pipeline dataset at run time: its stages on threads joined by bounded queues, served as a Source.

:class:`Pipeline` is a :class:`~..base.Source`, built by :mod:`.factory` from a
``pipeline://FILE.toml`` (docs/datasets.md §4). Each stage runs on its own thread, reading chunks of
a batch from a bounded :class:`~.stages.StageQueue` and writing to the next, so that the stages
work on different chunks at once; the batch is written into its destination (a reply buffer or a
trainer's ring slot) chunk by chunk, and ``read_into`` returns when the last chunk is in.
:func:`pipeline_stats` and :func:`find_stage` are what the provider's handler asks of its pipelines.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import cast

import numpy as np

from libbus.errors import (
    BadRequest,
    BusError,
    ConfigError,
    DatasetError,
    Internal,
    NotFound,
    Timeout,
)
from libbus.wire.fields import is_xy

from ..base import MAX_LOCATION_CHARS, SPLITS, Field, FieldBatch, ReadPolicy, Source, SourceInfo, joined_locations
from ..pipeline_metrics import PipelineMetrics
from ..timing import current as current_timing
from .decode_cache.entries import OBJECT_KINDS
from .decode_cache.pipeline_bindings import FinalCache, PrefixCache
from .decode_cache.store import DecodeCache, DecodeCacheRow, decode_cache_stats
from .fields import FieldsPlan
from .stages import Chunk, RandomStage, Spec, Stage, StageQueue, source_of
from .text_stages import Pack

__all__ = ["Pipeline", "PipelineRow", "find_stage", "pipeline_stats", "stage_control"]

log = logging.getLogger(__name__)

#: How long a stage thread waits on its queue before looking at the stop flag.
POLL_S = 0.1
#: How long a read waits for its batch before giving up on it.
BATCH_TIMEOUT_S = 60.0


class _Job:
    """One read in flight: where its rows go, how many chunks are still out, the first failure."""

    def __init__(self, x: np.ndarray | None, y: np.ndarray | None, chunks: int):
        self.x, self.y = x, y
        #: Named fields (no ``x``): each chunk's fields by its first row.
        self.parts: dict[int, dict] = {}
        self.remaining = chunks
        #: Seconds this read's chunks spent in each stage (by position), when its request asked for
        #: its timing; each entry is written by its stage's thread alone, read once ``done`` is set.
        self.times: list[float] | None = None
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.done = threading.Event()

    @property
    def failed(self) -> bool:
        return self.error is not None

    def fail(self, err: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = err
            self.done.set()

    def write(self, chunk: Chunk) -> None:
        """Copy a finished chunk into its rows, unless the read already ended (failed, timed out)."""
        with self.lock:
            if self.error is not None:
                return
            end = chunk.start + len(chunk.indices)
            x, y = self.x, self.y
            if x is None or y is None:
                # named fields: the source stage set them and every stage acts on one of them
                self.parts[chunk.start] = cast(dict, chunk.fields)
            else:
                x[chunk.start : end] = chunk.x
                y[chunk.start : end] = chunk.y
            self.remaining -= 1
            if self.remaining == 0:
                self.done.set()


def _stage_worker(
    stage: Stage,
    at: int,
    inbox: StageQueue,
    outbox: StageQueue,
    stop: threading.Event,
    cached: bool = False,
    after: Callable[[Chunk], None] | None = None,
) -> None:
    """Run ``stage`` (the pipeline's stage number ``at``) on every chunk of ``inbox`` into ``outbox``.
    ``cached``: the stage is in the decode cache's prefix, and a chunk the cache answered whole passes
    it untouched; ``after`` runs on each chunk once the stage is done (the last prefix stage's: the
    cache's merge). A chunk whose read asked for its timing gets the stage's seconds added."""
    while not stop.is_set():
        chunk = inbox.get(POLL_S)
        if chunk is None:
            continue
        if chunk.job.failed:
            inbox.drops += 1
            PrefixCache.abandon(chunk)
            continue
        try:
            seconds = 0.0
            if not (cached and chunk.cached is not None and not len(chunk.indices)):
                seconds = stage.run(chunk)
            if after is not None:
                after(chunk)
        except BusError as err:
            PrefixCache.abandon(chunk)
            chunk.job.fail(type(err)(f"stage {stage.name!r} ({stage.type}): {err}"))
            continue
        except Exception as err:  # noqa: BLE001 - a bug in a stage fails the batch, not the provider
            PrefixCache.abandon(chunk)
            log.exception("stage %s (%s) failed", stage.name, stage.type)
            chunk.job.fail(Internal(f"stage {stage.name!r} ({stage.type}): {type(err).__name__}: {err}"))
            continue
        if chunk.job.times is not None:
            chunk.job.times[at] += seconds
        outbox.put(chunk, stop, POLL_S)


def _sink_worker(inbox: StageQueue, stop: threading.Event) -> None:
    while not stop.is_set():
        chunk = inbox.get(POLL_S)
        if chunk is None:
            continue
        if chunk.job.failed:
            inbox.drops += 1
            continue
        chunk.job.write(chunk)


class Pipeline(Source):
    """A source followed by transforms, each on its own thread, joined by bounded queues.

    Args:
        uri: what the dataset was opened from (DatasetInfo ``uri``).
        stages: built stages in order, the source first.
        chunk: samples per work item; a batch is cut into chunks of this size.
        queue_capacity: chunks each queue holds before its producer waits.
        timeout_s: how long a read waits for its batch.
    """

    def __init__(
        self,
        uri: str,
        stages: list[Stage],
        *,
        chunk: int = 64,
        queue_capacity: int = 4,
        timeout_s: float = BATCH_TIMEOUT_S,
        plan: FieldsPlan | None = None,
    ):
        self.uri = uri
        self.stages = stages
        #: A source of named fields: how they go through the stages, and what comes out (:mod:`.fields`).
        self.plan = plan
        self._fields = plan.output() if plan is not None else None
        self.source: Source = source_of(stages)
        spec: Spec = stages[-1].spec
        self.sample_shape, self.dtype = spec.sample_shape, spec.dtype
        self.label_shape, self.label_dtype = spec.label_shape, spec.label_dtype
        self.num_classes, self.kind = spec.num_classes, spec.kind
        if self._fields is not None:  # named fields: the source's classes and shapes (unless x, y come out)
            self.num_classes, self.kind = self.source.num_classes, "fields"
            self.sample_shape, self.dtype = self.source.sample_shape, self.source.dtype
            self.label_shape, self.label_dtype = (), np.dtype(np.int64)
            if is_xy(self._fields):
                x, y = self._fields
                self.sample_shape, self.dtype = x.fixed_shape, x.np_dtype
                self.label_shape, self.label_dtype = y.fixed_shape, y.np_dtype
        self.class_names = list(self.source.class_names) if self.num_classes == self.source.num_classes else []
        self.chunk = chunk
        self.timeout_s = timeout_s
        #: The pipeline's input (chunks of requested batches), then each stage's output queue.
        self.requests = StageQueue("requests", queue_capacity)
        self.queues = [StageQueue("output", queue_capacity) for _ in stages]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._start_lock = threading.Lock()
        # Worker threads hold no reference to the pipeline: one that is dropped unclosed stops them.
        weakref.finalize(self, self._stop.set)
        #: A stage that makes each sample from a run of its input's (``pack`` with ``join``): it counts
        #: the samples, and a chunk goes through the stages before it as the inputs it names.
        self.regroup = self._open_regroup()
        #: Several batches read at once, off the provider's loop: a read mostly waits for the stages'
        #: threads, and the next batch's chunks then go through the first stages while the last ones
        #: finish the batch before. Not with a regrouping stage, whose look-ups run on the reading thread.
        self.read_policy = ReadPolicy.LOOP if self.regroup is not None else ReadPolicy.OVERLAP
        #: The provider's decode cache, bound to this pipeline's deterministic prefix (:meth:`use_cache`).
        self.cache: PrefixCache | None = None
        #: The same cache for the pipeline's final outputs, when it has random stages (:meth:`use_cache`).
        self.final: FinalCache | None = None

    def _open_regroup(self) -> Pack | None:
        """The regrouping stage, its index built now by reading every split through the stages before
        it, in index order on this thread (the same files give the same index); None if there is none."""
        at = next((i for i, s in enumerate(self.stages) if getattr(s, "regroups", False)), None)
        if at is None:
            return None
        stage, before = self.stages[at], self.stages[:at]
        if self.plan is not None:
            raise ConfigError(
                f"{self.uri}: stage {stage.name!r} ({stage.type}) makes each sample from several of its "
                f"input's, and a source of named fields ({', '.join(self.plan.source)}) keeps them per sample"
            )
        pack = cast(Pack, stage)  # only pack regroups, and a named-field pipeline was refused above

        def read(split: str, indices: np.ndarray) -> np.ndarray:
            chunk = Chunk(None, 0, indices, split, 0)
            for s in before:
                s.apply(chunk)
            return chunk.xy()[0]

        try:
            documents = {split: self.source.num_samples(split) for split in SPLITS}
            pack.build_index(read, documents, before)
        except (ConfigError, DatasetError) as err:
            raise type(err)(f"{self.uri}: {err}") from err
        return pack

    def num_samples(self, split: str) -> int:
        if self.regroup is not None:
            return self.regroup.num_samples(split)
        return self.source.num_samples(split)

    @property
    def fields(self) -> list[Field]:
        return list(self._fields) if self._fields is not None else super().fields

    def info(self) -> SourceInfo:
        out: SourceInfo = {**self.source.info(), **super().info()}
        out["source_uri"] = self.source.uri
        out["stages"] = [{"name": s.name, "type": s.type} for s in self.stages]
        if self.regroup is not None:
            out["pack"] = self.regroup.join_info()  # the only regrouping stage
        return out

    def locate(self, split: str, indices: np.ndarray) -> list[str]:
        """Where the source keeps each sample: its location of the same index, the stages changing
        the bytes but not where they come from. Behind a joining ``pack`` (a sample cut from a run of
        documents), each document's location in order, joined with ``"; "`` and bounded
        (:func:`~..base.joined_locations`); one ``locate`` of the source for all the documents."""
        if self.regroup is None:
            return self.source.locate(split, indices)
        index = self.regroup.indexes[split]
        first, stop = index.spans(np.asarray(indices, np.int64))
        spans = list(zip(first.tolist(), stop.tolist()))
        # only the documents a location can show: a huge join names its first ones and counts the rest
        shown = [range(a, min(b, a + MAX_LOCATION_CHARS // 4)) for a, b in spans]
        documents = np.unique(np.fromiter((d for r in shown for d in r), np.int64))
        where = dict(zip(documents.tolist(), self.source.locate(split, documents)))
        out = []
        for (a, b), r in zip(spans, shown):
            out.append(joined_locations([where[d] or f"document {d}" for d in r], b - a))
        return out

    # -- the decode cache -----------------------------------------------------------------------
    def deterministic_prefix(self) -> int:
        """How many stages, from the source, come before the first random one (all, if none is)."""
        return next((i for i, s in enumerate(self.stages) if isinstance(s, RandomStage)), len(self.stages))

    def use_cache(self, cache: DecodeCache, dataset: str) -> bool:
        """Keep this pipeline's samples in ``cache`` as they leave its deterministic prefix, under
        ``dataset``'s name. Call before the first read. Returns False (nothing cached) for a cache
        that is off, a prefix that is only the source (nothing to save), a source of named fields or
        a regrouping stage (their samples are not one row per index). With random stages after the
        prefix, the final outputs are kept too, keyed by what those stages draw from (:class:`FinalCache`)."""
        prefix = self.deterministic_prefix()
        if not cache.enabled or prefix < 2 or self.plan is not None or self.regroup is not None:
            return False
        with self._start_lock:
            if self._threads:
                raise RuntimeError(f"{self.uri}: use_cache after the pipeline started reading")
            self.cache = PrefixCache(cache, dataset, self.stages[:prefix])
            random = [s for s in self.stages[prefix:] if isinstance(s, RandomStage)]
            if random and self.stages[-1].spec.kind not in OBJECT_KINDS:
                self.final = FinalCache(cache, dataset, self.stages, random)
        return True

    # -- threads --------------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        with self._start_lock:
            if self._threads or self._stop.is_set():
                return
            inboxes = [self.requests, *self.queues[:-1]]
            prefix = self.cache.length if self.cache is not None else 0
            merge = self.cache.merge if self.cache is not None else None  # not self: see __init__
            for at, (stage, inbox, outbox) in enumerate(zip(self.stages, inboxes, self.queues)):
                self._threads.append(
                    threading.Thread(
                        target=_stage_worker,
                        args=(stage, at, inbox, outbox, self._stop, at < prefix, merge if at == prefix - 1 else None),
                        name=f"stage-{stage.name}",
                        daemon=True,
                    )
                )
            self._threads.append(
                threading.Thread(
                    target=_sink_worker, args=(self.queues[-1], self._stop), name="stage-sink", daemon=True
                )
            )
            for thread in self._threads:
                thread.start()

    def close(self) -> None:
        """Stop the stage threads (within one poll period each)."""
        self._stop.set()
        for q in (self.requests, *self.queues):
            q.closed = True
        for thread in self._threads:
            thread.join(2 * POLL_S + 1)

    # -- reading --------------------------------------------------------------------------------
    def read_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        self.serve_into(split, indices, x, y, epoch=0)

    def serve_into(self, split: str, indices: np.ndarray, x: np.ndarray, y: np.ndarray, *, epoch: int = 0) -> None:
        """Run ``indices`` through the stages into ``x``/``y``; random stages draw from ``epoch``.

        Raises the first stage error (its type, its message prefixed with the stage's name),
        :class:`BadRequest` for a negative epoch, or :class:`Timeout` if the batch is not done
        within ``timeout_s`` (default :data:`BATCH_TIMEOUT_S`).
        """
        if epoch < 0:
            raise BadRequest(f"epoch must be a non-negative integer, got {epoch}")
        if self.plan is not None:  # named fields that came out as exactly x and y
            batch = self.read_fields(split, indices, epoch)
            x[...], y[...] = batch["x"], batch["y"]
        elif len(indices):
            self._run(_Job(x, y, -(-len(indices) // self.chunk)), split, indices, epoch)

    def read_fields(self, split: str, indices: np.ndarray, epoch: int = 0) -> FieldBatch:
        """Named fields through the stages (:mod:`.fields`); raises as :meth:`serve_into`."""
        if self.plan is None or self._fields is None:
            return super().read_fields(split, indices, epoch)
        if epoch < 0:
            raise BadRequest(f"epoch must be a non-negative integer, got {epoch}")
        job = _Job(None, None, -(-len(indices) // self.chunk))
        if len(indices):
            self._run(job, split, indices, epoch)
        return self.plan.finish(self._fields, [job.parts[start] for start in sorted(job.parts)])

    def _run(self, job: _Job, split: str, indices: np.ndarray, epoch: int) -> None:
        """``indices`` into ``job``: the final outputs the cache holds, the rest through the stages."""
        if self._stop.is_set():
            raise DatasetError(f"{self.uri}: pipeline is closed")
        deadline = time.monotonic() + self.timeout_s
        final, x, y = self.final, job.x, job.y
        if final is None or x is None or y is None:
            self._run_chunks(job, split, indices, epoch, deadline)
            return
        rows = final.lookup(split, indices, epoch, self._stop, deadline)
        try:
            misses = rows.misses
            if len(misses) == len(indices):  # nothing held: straight into the destination, as uncached
                self._run_chunks(job, split, indices, epoch, deadline)
                final.store(rows, split, indices, x, y, epoch)
                return
            if len(misses):
                xm, ym = np.empty((len(misses), *x.shape[1:]), x.dtype), np.empty((len(misses), *y.shape[1:]), y.dtype)
                self._run_chunks(_Job(xm, ym, -(-len(misses) // self.chunk)), split, indices[misses], epoch, deadline)
                x[misses], y[misses] = xm, ym
                final.store(rows, split, indices[misses], xm, ym, epoch)
            rows.fill(x, y)
        finally:
            rows.release()

    def _run_chunks(self, job: _Job, split: str, indices: np.ndarray, epoch: int, deadline: float) -> None:
        """Send ``indices`` through the stages in chunks; wait until ``job`` has them all."""
        self._ensure_started()
        timing = current_timing()  # the request asked where its time went: each stage's share
        if timing is not None:
            job.times = [0.0] * len(self.stages)
        starts = range(0, len(indices), self.chunk)
        for start in starts:
            chunk = Chunk(job, start, indices[start : start + self.chunk], split, epoch)
            if self.cache is not None:
                self.cache.lookup(chunk, self._stop, deadline)
            if self.regroup is not None:  # the stages before it read the inputs these samples are made of
                chunk.requested = chunk.indices
                chunk.indices = self.regroup.source_indices(split, chunk.requested)
            if job.failed or not self.requests.put(chunk, self._stop, POLL_S, deadline):
                PrefixCache.abandon(chunk)
                break  # the wait below turns a stop or the deadline into the batch's error
        while not job.done.wait(POLL_S):
            if self._stop.is_set():
                job.fail(DatasetError(f"{self.uri}: pipeline closed while reading"))
            elif time.monotonic() > deadline:
                job.fail(
                    Timeout(
                        f"{self.uri}: batch of {len(indices)} samples not through the pipeline "
                        f"within {self.timeout_s:g} s"
                    )
                )
        if job.error is not None:
            raise job.error
        if timing is not None and job.times is not None:
            timing.add_pipeline(self.stages, job.times)

    # -- metrics and control --------------------------------------------------------------------
    def metrics(self) -> PipelineMetrics:
        """Every stage's counters with its output queue's, and the request queue's."""
        return {
            "requests": self.requests.metrics(),
            "stages": [{**s.metrics(), "queue": q.metrics()} for s, q in zip(self.stages, self.queues)],
        }

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise NotFound(f"{self.uri} has no stage {name!r}; its stages are {', '.join(s.name for s in self.stages)}")


# -- what the provider asks of its pipelines ------------------------------------------------------


class PipelineRow(DecodeCacheRow, total=False):
    """What pipelines add to a provider's stats: ``pipelines`` (each pipeline dataset's metrics) when it
    serves any, and ``decode_cache`` when they share one."""

    pipelines: dict[str, PipelineMetrics]


def pipeline_stats(datasets: dict[str, Source]) -> PipelineRow:
    """``{"pipelines": {dataset: metrics}}`` for the pipeline datasets among ``datasets`` (else ``{}``)."""
    # image sources (file://DIR?size=S) report their decoding in the same shape: one ``decode`` stage
    pipelines: dict[str, PipelineMetrics] = {}
    for name, s in datasets.items():
        if isinstance(s, Pipeline):
            pipelines[name] = s.metrics()
        elif callable(decode_metrics := getattr(s, "decode_metrics", None)):
            pipelines[name] = decode_metrics()
    caches = [s.cache.cache for s in datasets.values() if isinstance(s, Pipeline) and s.cache is not None]
    out: PipelineRow = {"pipelines": pipelines} if pipelines else {}
    return {**out, **decode_cache_stats(caches)}


def find_stage(datasets: dict[str, Source], dataset: str, stage: str) -> tuple[str, Stage]:
    """``(dataset, stage)`` for ``stage`` of pipeline ``dataset`` (``""``: the one pipeline that has it).

    Raises :class:`NotFound` (no such pipeline or stage) or :class:`BadRequest` (a stage name in several
    pipelines), each naming what exists.
    """
    pipelines = _pipelines(datasets)
    if dataset:
        return dataset, _pipeline(pipelines, dataset).stage(stage)
    candidates = [n for n, p in sorted(pipelines.items()) if any(s.name == stage for s in p.stages)]
    if not candidates:
        names = [f"{n}/{s.name}" for n, p in sorted(pipelines.items()) for s in p.stages]
        raise NotFound(f"no pipeline here has a stage {stage!r}; stages: {', '.join(names)}")
    if len(candidates) > 1:
        raise BadRequest(
            f"stage {stage!r} is in several pipelines ({', '.join(candidates)}); name the "
            "dataset (busctl control --dataset NAME)"
        )
    return candidates[0], pipelines[candidates[0]].stage(stage)


def stage_control(
    datasets: dict[str, Source],
    dataset: str,
    stage: str,
    command: str,
    args: dict,
    check_dataset: Callable[[str], None],
) -> dict:
    """Run a control command: ``{dataset, stage, type, result}`` from the stage's answer.

    ``stage`` ``"*"`` sends it to every stage of the pipeline that answers ``command`` (the seed
    spec's broadcast); ``result`` is then ``{stage: answer}``. ``check_dataset`` (the token's scope)
    may refuse the pipeline before anything runs. Raises as :func:`find_stage`, or
    :class:`BadRequest` for a command no stage answers.
    """
    if stage != "*":
        name, target = find_stage(datasets, dataset, stage)
        check_dataset(name)
        return {"dataset": name, "stage": target.name, "type": target.type, "result": target.control(command, args)}
    pipelines = _pipelines(datasets)
    if not dataset and len(pipelines) > 1:
        raise BadRequest(
            f"stage '*' needs the dataset: this provider serves {len(pipelines)} pipelines "
            f"({', '.join(sorted(pipelines))}); busctl control --dataset NAME"
        )
    name = dataset or next(iter(pipelines))
    pipeline = _pipeline(pipelines, name)
    check_dataset(name)
    targets = [s for s in pipeline.stages if command in s.commands()]
    if not targets:
        raise BadRequest(f"no stage of {name!r} answers {command!r}")
    return {"dataset": name, "stage": "*", "type": "*", "result": {s.name: s.control(command, args) for s in targets}}


def _pipelines(datasets: dict[str, Source]) -> dict[str, Pipeline]:
    pipelines = {name: s for name, s in datasets.items() if isinstance(s, Pipeline)}
    if not pipelines:
        raise NotFound(f"this provider serves no pipeline dataset (it serves {', '.join(sorted(datasets))})")
    return pipelines


def _pipeline(pipelines: dict[str, Pipeline], name: str) -> Pipeline:
    if name not in pipelines:
        raise NotFound(f"{name!r} is not a pipeline dataset here; pipelines: {', '.join(sorted(pipelines))}")
    return pipelines[name]

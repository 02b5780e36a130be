"""What every pipeline stage is made of: the base :class:`Stage` and its counters, the source stage,
the base of random stages, and the bounded queues that join stages.

A stage is configured by one TOML table (``[stages.normalize]`` …) and built knowing what its input
produces (:class:`Spec`): it checks its parameters and that input at build time, so a bad pipeline
is refused when the provider starts, never on a trainer's batch. :meth:`Stage.apply` then turns one
:class:`Chunk` (a slice of a batch) into its output. The transforms are in :mod:`.transforms`.

Random stages draw every sample's numbers as a hash of ``(seed, epoch, split, stage, index)``: the
same request gives the same bytes, whatever the chunking or the threads.

Stages run on their own threads (see :mod:`.engine`); the counters a stage and a queue keep are
each written by one thread and read by any, so a reader may see a value one chunk behind.
"""

from __future__ import annotations

import hashlib
import math
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from libbus.errors import BadRequest, ConfigError, DatasetError

from ..base import SPLITS, Source
from ..pipeline_metrics import QueueMetrics, RandomState, StageMetrics
from ..splitmix import uniforms

__all__ = ["Chunk", "RandomStage", "SourceStage", "Spec", "Stage", "StageQueue", "source_of"]


@dataclass(frozen=True)
class Spec:
    """What one sample and its label look like at some point of a pipeline."""

    sample_shape: tuple[int, ...]
    dtype: np.dtype
    label_shape: tuple[int, ...]
    label_dtype: np.dtype
    num_classes: int
    kind: str


@dataclass
class Chunk:
    """Rows ``start:start + len(indices)`` of one batch on their way through the stages."""

    job: Any
    start: int
    indices: np.ndarray
    split: str
    epoch: int
    x: np.ndarray | None = None
    y: np.ndarray | None = None
    #: A source of named fields: every field by name (:mod:`.fields`); None in an x/y pipeline.
    fields: dict | None = None
    #: A stage that makes samples from runs of its input's (``pack`` with ``join``): the requested sample
    #: indices, while ``indices`` are those the stages before it read; None otherwise.
    requested: np.ndarray | None = None
    #: With a decode cache (:mod:`.decode_cache`): the whole chunk's indices and the hits found for it, while
    #: ``indices`` are the misses the deterministic prefix reads; None otherwise.
    cached: Any = None

    def xy(self) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)``, which every stage after the source has (a named-field stage sets its field's)."""
        if self.x is None or self.y is None:
            raise RuntimeError("a pipeline stage ran on a chunk before its source read it")
        return self.x, self.y


class StageQueue:
    """A bounded FIFO between two stages, with the counters of the seed spec's ``QueueBase``.

    ``put`` blocks while the queue is full (backpressure on the producer), in waits of ``poll_s``
    so that a stopping pipeline is noticed. ``drop`` counts items a consumer took and discarded
    because their batch had already failed or been abandoned.
    """

    def __init__(self, name: str, capacity: int):
        self.name = name
        self.capacity = capacity
        self._q: queue.Queue = queue.Queue(capacity)
        self.puts = self.gets = self.drops = 0
        self.closed = False

    def size(self) -> int:
        return self._q.qsize()

    def put(self, item, stop, poll_s: float, deadline: float = math.inf) -> bool:
        """Enqueue ``item``; False if the pipeline stopped or ``deadline`` (monotonic) passed first."""
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                self._q.put(item, timeout=poll_s)
            except queue.Full:
                continue
            self.puts += 1
            return True
        return False

    def get(self, poll_s: float):
        """The next item, or None after ``poll_s`` with nothing queued."""
        try:
            item = self._q.get(timeout=poll_s)
        except queue.Empty:
            return None
        self.gets += 1
        return item

    def metrics(self) -> QueueMetrics:
        return {
            "name": self.name,
            "size": self.size(),
            "capacity": self.capacity,
            "put": self.puts,
            "get": self.gets,
            "drop": self.drops,
            "closed": self.closed,
        }


def _stable_key(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


#: What a stage's input is: the :class:`Spec` of the stage before it, or None for the source.
InSpec = TypeVar("InSpec", bound="Spec | None")


class Stage(Generic[InSpec]):
    """One named stage. Subclasses set ``type``, ``params`` (key → default) and implement
    :meth:`check` (params and input, at build time) and :meth:`apply` (one chunk)."""

    type: ClassVar[str] = ""
    #: Known parameters and their defaults; a key not listed is refused.
    params: ClassVar[dict[str, Any]] = {}

    def __init__(self, name: str, config: dict, input_spec: InSpec):
        self.name = name
        unknown = sorted(set(config) - set(self.params))
        if unknown:
            raise self.error(
                f"unknown parameter(s) {', '.join(unknown)}; {self.type} takes {', '.join(self.params) or 'none'}"
            )
        self.config = {**self.params, **config}
        self.input_spec = input_spec
        self.spec = self.check(input_spec)
        self.items_in = self.items_out = self.errors = 0
        self.busy_s = 0.0

    def error(self, what: str) -> ConfigError:
        return ConfigError(f"stage {self.name!r} ({self.type}): {what}")

    def check(self, spec: InSpec) -> Spec:
        """Check parameters against the input ``spec``; return this stage's output spec."""
        raise NotImplementedError

    def apply(self, chunk: Chunk) -> None:
        """Replace ``chunk.x`` / ``chunk.y`` with this stage's output."""
        raise NotImplementedError

    def run(self, chunk: Chunk) -> float:
        """:meth:`apply` with the stage's counters; returns the seconds it took."""
        n = len(chunk.indices)
        self.items_in += n
        started = time.perf_counter()
        try:
            self.apply(chunk)
        except Exception:
            self.errors += 1
            raise
        finally:
            took = time.perf_counter() - started
            self.busy_s += took
        self.items_out += n
        return took

    def metrics(self) -> StageMetrics:
        return {
            "name": self.name,
            "type": self.type,
            "items_in": self.items_in,
            "items_out": self.items_out,
            "errors": self.errors,
            "busy_s": round(self.busy_s, 6),
        }

    # -- control --------------------------------------------------------------------------------
    def commands(self) -> tuple[str, ...]:
        return ("stats",)

    def control(self, command: str, args: dict) -> dict:
        """Answer a control command (``busctl control``). Raises :class:`BadRequest` naming the stage."""
        if command not in self.commands():
            raise BadRequest(
                f"stage {self.name!r} ({self.type}) has no command {command!r}; it answers {', '.join(self.commands())}"
            )
        if args:
            raise BadRequest(f"stage {self.name!r}: {command} takes no arguments, got {', '.join(args)}")
        return dict(self.metrics().items())

    # -- parameter helpers ----------------------------------------------------------------------
    def _number_list(self, key: str, length: int) -> np.ndarray:
        value = self.config[key]
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise self.error(f"{key} must be a number or a list of numbers, got {value!r}")
        if len(values) not in (1, length):
            raise self.error(
                f"{key} has {len(values)} values but samples have {length} channels "
                f"(shape {self.input_spec.sample_shape if self.input_spec is not None else ()}); give 1 or {length}"
            )
        return np.asarray(values, np.float64)

    def _dtype(self, key: str, kinds: str) -> np.dtype:
        value = self.config[key]
        try:
            dtype = np.dtype(value)
        except (TypeError, ValueError):
            dtype = None
        if dtype is None or dtype.kind not in kinds:
            what = (
                "a float type (float16, float32, float64)"
                if kinds == "f"
                else "a number type (bool, int8…int64, uint8…uint64, float16…float64)"
            )
            raise self.error(f"{key} must be {what}, got {value!r}")
        return dtype


class SourceStage(Stage[None]):
    """``source``: reads the samples from any URI a provider opens (``mock://``, ``file://`` …)."""

    type = "source"
    params = {"uri": None}

    def __init__(self, name: str, config: dict, input_spec: None, *, open_source: Callable[[str], Source]):
        self._open_source = open_source  # the registry's, handed down: a stage does not import it
        super().__init__(name, config, input_spec)

    def check(self, spec: None) -> Spec:
        uri = self.config["uri"]
        if not isinstance(uri, str) or not uri:
            raise self.error('needs uri = "SCHEME://…" (for example mock://cifar10)')
        if uri.startswith("pipeline:"):
            raise self.error(f"a pipeline's source cannot be another pipeline ({uri})")
        try:
            self.source = self._open_source(uri)
        except DatasetError as err:
            raise DatasetError(f"stage {self.name!r} (source): {err}") from err
        s = self.source
        return Spec(
            tuple(s.sample_shape),
            np.dtype(s.dtype),
            tuple(s.label_shape),
            np.dtype(s.label_dtype),
            s.num_classes,
            s.kind,
        )

    def apply(self, chunk: Chunk) -> None:
        if not self.source.xy:  # named fields, for stages that name theirs (:mod:`.fields`)
            chunk.fields = dict(self.source.read_fields(chunk.split, chunk.indices, chunk.epoch))
            return
        chunk.x, chunk.y = self.source.read(chunk.split, chunk.indices)


def source_of(stages: list[Stage]) -> Source:
    """The source a pipeline's stages read: its first stage's (a chain starts at its one source)."""
    first = stages[0]
    if not isinstance(first, SourceStage):
        raise ConfigError(f"a pipeline starts at its source stage, not at {first.name!r} ({first.type})")
    return first.source


class RandomStage(Stage[Spec]):
    """A stage whose output depends on random numbers drawn per sample from ``(seed, epoch, split,
    stage, index)``. It applies to the splits listed in ``splits`` (default train only); other splits
    get its deterministic counterpart. ``seed`` and the epoch can be set by control commands."""

    def __init__(self, name: str, config: dict, input_spec: Spec, seed: int):
        super().__init__(name, config, input_spec)
        splits = self.config["splits"]
        if not isinstance(splits, list) or not all(s in SPLITS for s in splits):
            raise self.error(f"splits must be a list of {', '.join(SPLITS)}, got {splits!r}")
        self.splits = frozenset(splits)
        self.key = _stable_key(name)
        self.default_seed = seed
        self.seed = seed
        #: An epoch pinned by ``set epoch=N``; None draws from each request's epoch.
        self.epoch: int | None = None
        self.items_since_anchor = 0

    def uniforms(self, chunk: Chunk, draws: int) -> np.ndarray:
        """``(len(chunk.indices), draws)`` numbers in [0, 1), each a function of (seed, epoch, split,
        stage, index, draw) alone: SplitMix64 at a counter, so a whole chunk is drawn at once."""
        epoch = chunk.epoch if self.epoch is None else self.epoch
        self.items_since_anchor += len(chunk.indices)
        key = np.uint64(_stable_key(repr((self.seed, epoch, SPLITS.index(chunk.split), self.key))))
        counters = chunk.indices.astype(np.uint64)[:, None] * np.uint64(draws) + np.arange(draws, dtype=np.uint64)
        return uniforms(key, counters)

    def commands(self) -> tuple[str, ...]:
        return ("stats", "get", "set", "reset")

    def state(self) -> RandomState:
        return {
            "seed": self.seed,
            "epoch": "request" if self.epoch is None else self.epoch,
            "items_since_anchor": self.items_since_anchor,
        }

    def control(self, command: str, args: dict) -> dict:
        """``stats``, or ``get`` / ``set seed=N epoch=N|request`` / ``reset``: the seed spec's shuffle
        anchor, for the stage's random numbers. Each but ``stats`` answers :meth:`state`."""
        if command == "set":
            unknown = sorted(set(args) - {"seed", "epoch"})
            if unknown or not args:
                raise BadRequest(
                    f"stage {self.name!r}: set takes seed=N and/or epoch=N (or epoch=request), "
                    f"got {', '.join(unknown) or 'nothing'}"
                )
            seed = _nonneg(self.name, "seed", args["seed"]) if "seed" in args else self.seed
            epoch = self.epoch
            if "epoch" in args:
                epoch = None if args["epoch"] == "request" else _nonneg(self.name, "epoch", args["epoch"])
            self.seed, self.epoch, self.items_since_anchor = seed, epoch, 0
            return dict(self.state().items())
        answer = super().control(command, args)  # checks the command and that it has no arguments
        if command == "reset":
            self.seed, self.epoch, self.items_since_anchor = self.default_seed, None, 0
        return answer if command == "stats" else dict(self.state().items())

    def metrics(self) -> StageMetrics:
        return {**super().metrics(), **self.state()}


def _nonneg(stage: str, key: str, value) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = -1
    if isinstance(value, bool) or number < 0 or (isinstance(value, float) and value != number):
        raise BadRequest(f"stage {stage!r}: {key} must be a non-negative integer, got {value!r}")
    return number

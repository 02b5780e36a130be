"""The stages a pipeline dataset is built from, and the bounded queues that connect them.

A stage is configured by one TOML table (``[stages.normalize]`` …) and built knowing what its input
produces (:class:`Spec`): it checks its parameters and that input at build time, so a bad pipeline
is refused when the provider starts, never on a trainer's batch. :meth:`Stage.apply` then turns one
:class:`Chunk` (a slice of a batch) into its output.

Random stages draw every sample's numbers as a hash of ``(seed, epoch, split, stage, index)``: the
same request gives the same bytes, whatever the chunking or the threads.

Stages run on their own threads (see :mod:`.pipeline`); the counters a stage and a queue keep are
each written by one thread and read by any, so a reader may see a value one chunk behind.
"""

from __future__ import annotations

import hashlib
import math
import queue
import time
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from libbus.errors import BadRequest, ConfigError, DatasetError

from .sources import SPLITS

__all__ = ["STAGE_TYPES", "TRANSFORMS", "Chunk", "SourceStage", "Spec", "Stage", "StageQueue"]


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

    def metrics(self) -> dict:
        return {"name": self.name, "size": self.size(), "capacity": self.capacity, "put": self.puts,
                "get": self.gets, "drop": self.drops, "closed": self.closed}


def _stable_key(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class Stage:
    """One named stage. Subclasses set ``type``, ``params`` (key → default) and implement
    :meth:`check` (params and input, at build time) and :meth:`apply` (one chunk)."""

    type: ClassVar[str] = ""
    #: Known parameters and their defaults; a key not listed is refused.
    params: ClassVar[dict[str, Any]] = {}
    random: ClassVar[bool] = False

    def __init__(self, name: str, config: dict, input_spec: Spec | None):
        self.name = name
        unknown = sorted(set(config) - set(self.params))
        if unknown:
            raise self.error(f"unknown parameter(s) {', '.join(unknown)}; {self.type} takes "
                             f"{', '.join(self.params) or 'none'}")
        self.config = {**self.params, **config}
        self.input_spec = input_spec
        self.spec = self.check(input_spec)
        self.items_in = self.items_out = self.errors = 0
        self.busy_s = 0.0

    def error(self, what: str) -> ConfigError:
        return ConfigError(f"stage {self.name!r} ({self.type}): {what}")

    def check(self, spec: Spec | None) -> Spec:
        """Check parameters against the input ``spec``; return this stage's output spec."""
        raise NotImplementedError

    def apply(self, chunk: Chunk) -> None:
        """Replace ``chunk.x`` / ``chunk.y`` with this stage's output."""
        raise NotImplementedError

    def run(self, chunk: Chunk) -> None:
        """:meth:`apply` with the stage's counters."""
        n = len(chunk.indices)
        self.items_in += n
        started = time.perf_counter()
        try:
            self.apply(chunk)
        except Exception:
            self.errors += 1
            raise
        finally:
            self.busy_s += time.perf_counter() - started
        self.items_out += n

    def metrics(self) -> dict:
        return {"name": self.name, "type": self.type, "items_in": self.items_in,
                "items_out": self.items_out, "errors": self.errors, "busy_s": round(self.busy_s, 6)}

    # -- control --------------------------------------------------------------------------------
    def commands(self) -> tuple[str, ...]:
        return ("stats",)

    def control(self, command: str, args: dict) -> dict:
        """Answer a control command (``busctl control``). Raises :class:`BadRequest` naming the stage."""
        if command not in self.commands():
            raise BadRequest(f"stage {self.name!r} ({self.type}) has no command {command!r}; it answers "
                             f"{', '.join(self.commands())}")
        if command == "stats":
            if args:
                raise BadRequest(f"stage {self.name!r}: stats takes no arguments, got {', '.join(args)}")
            return self.metrics()
        return self.control_random(command, args)

    def control_random(self, command: str, args: dict) -> dict:  # pragma: no cover - see RandomStage
        raise NotImplementedError

    # -- parameter helpers ----------------------------------------------------------------------
    def _number_list(self, key: str, length: int) -> np.ndarray:
        value = self.config[key]
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise self.error(f"{key} must be a number or a list of numbers, got {value!r}")
        if len(values) not in (1, length):
            raise self.error(f"{key} has {len(values)} values but samples have {length} channels "
                             f"(shape {self.input_spec.sample_shape}); give 1 or {length}")
        return np.asarray(values, np.float64)

    def _dtype(self, key: str, kinds: str) -> np.dtype:
        value = self.config[key]
        try:
            dtype = np.dtype(value)
        except (TypeError, ValueError):
            dtype = None
        if dtype is None or dtype.kind not in kinds:
            what = "a float type (float16, float32, float64)" if kinds == "f" else \
                "a number type (bool, int8…int64, uint8…uint64, float16…float64)"
            raise self.error(f"{key} must be {what}, got {value!r}")
        return dtype


class SourceStage(Stage):
    """``source``: reads the samples from any URI a provider opens (``mock://``, ``file://`` …)."""

    type = "source"
    params = {"uri": None}

    def check(self, spec: Spec | None) -> Spec:
        from .sources import open_source  # noqa: PLC0415 - sources imports nothing from here

        uri = self.config["uri"]
        if not isinstance(uri, str) or not uri:
            raise self.error("needs uri = \"SCHEME://…\" (for example mock://cifar10)")
        if uri.startswith("pipeline:"):
            raise self.error(f"a pipeline's source cannot be another pipeline ({uri})")
        try:
            self.source = open_source(uri)
        except DatasetError as err:
            raise DatasetError(f"stage {self.name!r} (source): {err}") from err
        s = self.source
        return Spec(tuple(s.sample_shape), np.dtype(s.dtype), tuple(s.label_shape), np.dtype(s.label_dtype),
                    s.num_classes, s.kind)

    def apply(self, chunk: Chunk) -> None:
        chunk.x, chunk.y = self.source.read(chunk.split, chunk.indices)


class Normalize(Stage):
    """``normalize``: ``(x - mean) / std`` per channel (the first sample axis), as float."""

    type = "normalize"
    params = {"mean": 0.0, "std": 1.0, "dtype": "float32"}

    def check(self, spec: Spec) -> Spec:
        if spec.kind == "tokens" or spec.dtype.kind not in "biuf":
            raise self.error(f"needs numeric image samples, got {spec.kind} samples of {spec.dtype}")
        channels = spec.sample_shape[0] if spec.sample_shape else 1
        mean, std = self._number_list("mean", channels), self._number_list("std", channels)
        if np.any(std <= 0):
            raise self.error(f"std must be positive, got {self.config['std']!r}")
        dtype = self._dtype("dtype", "f")
        trailing = (1,) * max(0, len(spec.sample_shape) - 1)
        self.mean = mean.astype(dtype).reshape(-1, *trailing)
        self.scale = (1.0 / std).astype(dtype).reshape(-1, *trailing)
        return replace(spec, dtype=dtype)

    def apply(self, chunk: Chunk) -> None:
        x = chunk.x.astype(self.spec.dtype)
        x -= self.mean
        x *= self.scale
        chunk.x = x


class OneHot(Stage):
    """``one_hot``: a class id label becomes a ``(num_classes,)`` row with a single 1."""

    type = "one_hot"
    params = {"num_classes": None, "dtype": "float32"}

    def check(self, spec: Spec) -> Spec:
        if spec.label_shape != () or spec.label_dtype.kind not in "iu":
            raise self.error(f"needs one integer class id per sample, got labels of shape "
                             f"{list(spec.label_shape)} and dtype {spec.label_dtype}")
        classes = self.config["num_classes"] if self.config["num_classes"] is not None else spec.num_classes
        if not isinstance(classes, int) or isinstance(classes, bool) or classes < 1:
            raise self.error(f"num_classes must be a positive integer (the input has "
                             f"{spec.num_classes}), got {classes!r}")
        self.classes = classes
        return replace(spec, label_shape=(classes,), label_dtype=self._dtype("dtype", "fiub"),
                       num_classes=classes)

    def apply(self, chunk: Chunk) -> None:
        y = chunk.y
        if len(y) and (y.min() < 0 or y.max() >= self.classes):
            bad = int(y.min()) if y.min() < 0 else int(y.max())
            raise DatasetError(f"stage {self.name!r} (one_hot): label {bad} is outside the "
                               f"{self.classes} classes 0..{self.classes - 1}")
        out = np.zeros((len(y), self.classes), self.spec.label_dtype)
        out[np.arange(len(y)), y] = 1
        chunk.y = out


class Cast(Stage):
    """``cast``: samples and/or labels to another numeric dtype (values converted as numpy does)."""

    type = "cast"
    params = {"dtype": None, "label_dtype": None}

    def check(self, spec: Spec) -> Spec:
        if self.config["dtype"] is None and self.config["label_dtype"] is None:
            raise self.error("give dtype, label_dtype or both")
        out = spec
        if self.config["dtype"] is not None:
            out = replace(out, dtype=self._dtype("dtype", "fiub"))
        if self.config["label_dtype"] is not None:
            out = replace(out, label_dtype=self._dtype("label_dtype", "fiub"))
        if spec.kind == "tokens" and out.dtype.kind not in "iu":
            raise self.error(f"token samples must stay integers, not {out.dtype}")
        return out

    def apply(self, chunk: Chunk) -> None:
        chunk.x = chunk.x.astype(self.spec.dtype, copy=False)
        chunk.y = chunk.y.astype(self.spec.label_dtype, copy=False)


class RandomStage(Stage):
    """A stage whose output depends on random numbers drawn per sample from ``(seed, epoch, split,
    stage, index)``. It applies to the splits listed in ``splits`` (default train only); other splits
    get its deterministic counterpart. ``seed`` and the epoch can be set by control commands."""

    random = True

    def __init__(self, name: str, config: dict, input_spec: Spec | None, seed: int):
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
        stage, index, draw) alone: SplitMix64 of a counter, so a whole chunk is drawn at once."""
        epoch = chunk.epoch if self.epoch is None else self.epoch
        self.items_since_anchor += len(chunk.indices)
        key = np.uint64(_stable_key(repr((self.seed, epoch, SPLITS.index(chunk.split), self.key))))
        counters = chunk.indices.astype(np.uint64)[:, None] * np.uint64(draws) + np.arange(draws, dtype=np.uint64)
        return (_splitmix64(counters + key) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53

    def commands(self) -> tuple[str, ...]:
        return ("stats", "get", "set", "reset")

    def state(self) -> dict:
        return {"seed": self.seed, "epoch": "request" if self.epoch is None else self.epoch,
                "items_since_anchor": self.items_since_anchor}

    def control_random(self, command: str, args: dict) -> dict:
        if command == "reset":
            if args:
                raise BadRequest(f"stage {self.name!r}: reset takes no arguments, got {', '.join(args)}")
            self.seed, self.epoch, self.items_since_anchor = self.default_seed, None, 0
        elif command == "set":
            unknown = sorted(set(args) - {"seed", "epoch"})
            if unknown or not args:
                raise BadRequest(f"stage {self.name!r}: set takes seed=N and/or epoch=N (or epoch=request), "
                                 f"got {', '.join(unknown) or 'nothing'}")
            seed = _nonneg(self.name, "seed", args["seed"]) if "seed" in args else self.seed
            epoch = self.epoch
            if "epoch" in args:
                epoch = None if args["epoch"] == "request" else _nonneg(self.name, "epoch", args["epoch"])
            self.seed, self.epoch, self.items_since_anchor = seed, epoch, 0
        elif args:
            raise BadRequest(f"stage {self.name!r}: get takes no arguments, got {', '.join(args)}")
        return self.state()

    def metrics(self) -> dict:
        return {**super().metrics(), **self.state()}


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on uint64 arrays (wrapping arithmetic): a well-mixed hash."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _nonneg(stage: str, key: str, value) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = -1
    if isinstance(value, bool) or number < 0 or (isinstance(value, float) and value != number):
        raise BadRequest(f"stage {stage!r}: {key} must be a non-negative integer, got {value!r}")
    return number


def _spatial(stage: Stage, spec: Spec) -> None:
    if spec.kind == "tokens" or len(spec.sample_shape) < 2:
        raise stage.error(f"needs image samples with height and width (C, H, W) or (H, W), got "
                          f"{spec.kind} samples of shape {list(spec.sample_shape)}")


class RandomCrop(RandomStage):
    """``random_crop``: pad the last two axes by ``padding``, then cut a ``size`` window at a random
    place (the centre on splits it does not apply to)."""

    type = "random_crop"
    params = {"size": None, "padding": 0, "fill": 0, "mode": "constant", "splits": ["train"]}
    MODES = ("constant", "edge", "reflect")

    def check(self, spec: Spec) -> Spec:
        _spatial(self, spec)
        h, w = spec.sample_shape[-2:]
        pad = self.config["padding"]
        if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
            raise self.error(f"padding must be a non-negative integer, got {pad!r}")
        size = self.config["size"]
        size = [h, w] if size is None else [size, size] if isinstance(size, int) else size
        if (not isinstance(size, list) or len(size) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in size)):
            raise self.error(f"size must be a positive integer or [height, width], got {self.config['size']!r}")
        if size[0] > h + 2 * pad or size[1] > w + 2 * pad:
            raise self.error(f"size {size} does not fit samples of {h}x{w} padded by {pad}")
        if self.config["mode"] not in self.MODES:
            raise self.error(f"mode must be one of {', '.join(self.MODES)}, got {self.config['mode']!r}")
        if self.config["mode"] == "reflect" and pad >= min(h, w):
            raise self.error(f"reflect padding {pad} needs samples larger than it, got {h}x{w}")
        if not isinstance(self.config["fill"], (int, float)) or isinstance(self.config["fill"], bool):
            raise self.error(f"fill must be a number, got {self.config['fill']!r}")
        self.pad, self.size = pad, tuple(size)
        return replace(spec, sample_shape=(*spec.sample_shape[:-2], *size))

    def apply(self, chunk: Chunk) -> None:
        x, p = chunk.x, self.pad
        if p:
            widths = [(0, 0)] * (x.ndim - 2) + [(p, p), (p, p)]
            extra = {"constant_values": self.config["fill"]} if self.config["mode"] == "constant" else {}
            x = np.pad(x, widths, mode=self.config["mode"], **extra)
        ch, cw = self.size
        room_h, room_w = x.shape[-2] - ch, x.shape[-1] - cw
        if chunk.split not in self.splits:
            top, left = room_h // 2, room_w // 2
            chunk.x = np.ascontiguousarray(x[..., top:top + ch, left:left + cw])
            return
        u = self.uniforms(chunk, 2)
        top = (u[:, 0] * (room_h + 1)).astype(np.intp)
        left = (u[:, 1] * (room_w + 1)).astype(np.intp)
        windows = np.lib.stride_tricks.sliding_window_view(x, (ch, cw), axis=(-2, -1))
        # (N, …, H', W', ch, cw) → each row's window at (top, left): (N, …, ch, cw), one gather
        chunk.x = windows[np.arange(len(x)), ..., top, left, :, :]


class Flip(RandomStage):
    """``flip``: mirror a sample left-right (its last axis) with probability ``p``."""

    type = "flip"
    params = {"p": 0.5, "splits": ["train"]}

    def check(self, spec: Spec) -> Spec:
        _spatial(self, spec)
        p = self.config["p"]
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p <= 1:
            raise self.error(f"p must be a probability between 0 and 1, got {p!r}")
        self.p = float(p)
        return spec

    def apply(self, chunk: Chunk) -> None:
        if chunk.split not in self.splits:
            return
        flips = self.uniforms(chunk, 1)[:, 0] < self.p
        if flips.any():
            x = np.array(chunk.x)
            x[flips] = x[flips][..., ::-1]
            chunk.x = x


#: Transform stage types by their TOML key.
TRANSFORMS: dict[str, type[Stage]] = {cls.type: cls for cls in (Normalize, OneHot, Cast, RandomCrop, Flip)}
#: Every stage type: the source and the transforms.
STAGE_TYPES: dict[str, type[Stage]] = {"source": SourceStage, **TRANSFORMS}

"""Messages of the data plane: discovery and datasets, batches and read-ahead, shared memory, evaluation,
pipeline control, where samples live (sessions, stats, peers and security are :mod:`libbus.wire.msg_session`'s).
Each is declared with :func:`~libbus.wire.frames.message`
(which registers it) and, when it is a request, names its reply as its base; import them from
:mod:`libbus.wire.messages`.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any, ClassVar, TypedDict

import numpy as np

from libbus.constants import MAX_BATCH_INDICES, MAX_FRAMES
from libbus.errors import BadRequest, OutOfRange, TooLarge
from libbus.wire.frames import Message, Request, frame_buffer, message
from libbus.wire.msg_session import Ok

__all__ = [
    "EvaluateModel",
    "REPLICA_FIELDS",
    "info_mismatch",
    "Resolve",
    "Resolved",
    "DatasetInfoRequest",
    "DatasetInfo",
    "BatchRequest",
    "BatchResponse",
    "ReadAhead",
    "AttachRing",
    "RingAttached",
    "Evaluate",
    "Evaluation",
    "EvaluationReport",
    "ChargeEvaluation",
    "EvaluationCharged",
    "StageControl",
    "LocateSamples",
    "SampleLocations",
]


# -- discovery and datasets -------------------------------------------------------------------


@message
class Resolve(Request["Resolved"]):
    dataset: str


@message
class Resolved(Message):
    dataset: str
    info: dict
    providers: list


@message
class DatasetInfoRequest(Request["DatasetInfo"]):
    dataset: str


@message
class DatasetInfo(Message):
    """What a trainer needs to size its model and its requests. See docs/protocol.md for ``info``.

    ``host_id`` is the provider's machine: a trainer with the same one may offer a ring, and
    connect through ``local_endpoint`` (an ``ipc://`` Unix socket) instead of TCP.
    """

    dataset: str
    info: dict
    host_id: str = ""
    local_endpoint: str = ""


@message
class BatchRequest(Request["BatchResponse"]):
    """Samples by index: either ``range=[start, end)`` or one int64 payload frame of indices
    (:meth:`for_indices` picks, :meth:`indices` reads them back, checked).

    With ``slot`` and ``seq`` (after :class:`AttachRing`) the provider writes the batch into that
    ring slot, if the slot still awaits request ``seq``, instead of sending it back. ``epoch`` seeds
    a pipeline dataset's random stages, so a resent request gets the same bytes. ``timing`` asks the
    provider where the batch's time went (the reply's ``timing``); a provider that predates it
    ignores it.
    """

    nframes: ClassVar[tuple[int, int]] = (0, 1)
    dataset: str
    split: str
    range: list | None = None
    slot: int | None = None
    seq: int | None = None
    epoch: int = 0
    timing: bool = False

    # The indices' wire rule, both ways: the loader encodes with for_indices, the provider decodes with indices.
    @classmethod
    def for_indices(cls, indices: np.ndarray, *, dataset: str, split: str, **fields: Any) -> BatchRequest:
        """A request for ``indices``: ``range=[a, b)`` when they run up by one (the header says it
        all), else one int64 little-endian frame (a view of ``indices`` when they are already that:
        sent without a copy). ``fields``: the other header fields (``epoch``, ``slot``, ``seq``)."""
        if len(indices) and indices[-1] - indices[0] == len(indices) - 1 and bool(np.all(np.diff(indices) == 1)):
            return cls(dataset=dataset, split=split, range=[int(indices[0]), int(indices[-1]) + 1], **fields)
        frame = np.ascontiguousarray(indices, dtype="<i8").data
        return cls(dataset=dataset, split=split, frames=[frame], **fields)

    def indices(self, num_samples: int) -> np.ndarray:
        """The int64 indices this request names, checked against its split's ``num_samples``.

        Raises :class:`BadRequest` (neither or both of range/frame, a bad frame), :class:`TooLarge`
        (more than ``MAX_BATCH_INDICES``) or :class:`OutOfRange` (naming the first bad index).
        """
        if self.range is not None and self.frames:
            raise BadRequest("BatchRequest gives both a range and an indices frame; send one")
        if self.range is not None:
            r = self.range
            if len(r) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in r) or r[0] > r[1]:
                raise BadRequest(f"BatchRequest.range must be [start, end) integers with start <= end, got {r}")
            start, end = r
            if end - start > MAX_BATCH_INDICES:
                raise TooLarge(f"range of {end - start} samples; at most {MAX_BATCH_INDICES} per request")
            if start < 0 or end > num_samples:
                raise OutOfRange(f"range [{start}, {end}) is outside {self.split} (0..{num_samples})")
            return np.arange(start, end, dtype=np.int64)
        if not self.frames:
            raise BadRequest("BatchRequest needs a range or an int64 indices frame")
        return indices_frame(self.frames[0], self.split, num_samples)


def indices_frame(frame: Any, split: str, num_samples: int) -> np.ndarray:
    """One int64 little-endian frame of sample indices of ``split``, checked: :class:`BadRequest` (not
    whole int64s), :class:`TooLarge` (over ``MAX_BATCH_INDICES``), :class:`OutOfRange` (the first bad one)."""
    buf = frame_buffer(frame)
    size = memoryview(buf).nbytes
    if size % 8:
        raise BadRequest(f"indices frame is {size} bytes; expected a multiple of 8 (int64)")
    if size // 8 > MAX_BATCH_INDICES:
        raise TooLarge(f"{size // 8} indices; at most {MAX_BATCH_INDICES} per request")
    indices = np.frombuffer(buf, dtype="<i8")
    if len(indices):
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= num_samples:
            bad = lo if lo < 0 else hi
            raise OutOfRange(f"index {bad} is outside {split} (0..{num_samples - 1})")
    return indices


@message
class ReadAhead(Request[Ok]):
    """The samples of ``split`` a loader will ask for next, in the order it will ask (one int64 frame, at
    most ``MAX_BATCH_INDICES``): a provider whose dataset keeps a RAM cache of a remote store's blocks
    (DatasetInfo ``read_ahead``) fetches the blocks they lie in before they are asked for. Each replaces
    the session's last for that dataset (a new pass, a seek: a new plan); an empty frame cancels it, as
    the session's end does. Best effort: answered ``Ok`` whatever the provider does with it; refused as a
    :class:`BatchRequest` of those samples would be (scope, assignment, the private test split)."""

    nframes: ClassVar[tuple[int, int]] = (1, 1)
    dataset: str
    split: str


@message
class BatchResponse(Message):
    """A batch's fields, C-contiguous, their shapes and dtypes in the header, or no frames when the
    batch is in ring slot ``slot`` under sequence ``seq``.

    ``names`` lists the fields (absent: ``x`` and ``y``, data then labels); ``shapes[i]`` and
    ``dtypes[i]`` describe field ``i``: a fixed field is one frame of its batch array; a variable
    field (``-1`` in its shape for a varying dimension, dtype ``bytes`` or ``str`` for byte strings
    and text) is its values frame, then its index frame (see :mod:`libbus.wire.fields`).

    ``timing``, for a request that asked: seconds the batch spent at the provider, as
    ``{"queue": s, "read": s, "stages": {name: s}}`` (queueing before its read began, source I/O, each
    pipeline stage); a peer's figures, which :mod:`libbus.loader.stall` bounds before using.
    """

    nframes: ClassVar[tuple[int, int]] = (0, MAX_FRAMES - 2)
    shapes: list
    dtypes: list
    nbytes: int
    names: list | None = None
    slot: int | None = None
    seq: int | None = None
    timing: dict | None = None


# -- shared memory ------------------------------------------------------------------------------


@message
class AttachRing(Request["RingAttached"]):
    """Map the trainer's ring ``name`` (same host only) for this session's batch requests.

    The provider checks the ring's header (magic, version) and geometry against these fields, and
    that the file is this user's and private, before it writes a byte.
    """

    name: str
    slots: int
    slot_bytes: int
    label_offset: int


@message
class RingAttached(Message):
    name: str


# -- evaluation ------------------------------------------------------------------------------


class EvaluateModel(TypedDict, total=False):
    """``Evaluate.model``: a built-in model by ``name``, or an ``evaluator`` (``module:function``), with its
    ``kwargs``."""

    name: str
    evaluator: str
    kwargs: dict[str, Any]


@message
class Evaluate(Request["Evaluation"]):
    """Weights (safetensors bytes) in one payload frame; the provider scores them on its test split.

    ``model`` is ``{"name": built-in, "kwargs": {...}}`` or ``{"evaluator": "module:function",
    "kwargs": {...}}`` (a module the provider's ``evaluator_modules`` allows)."""

    nframes: ClassVar[tuple[int, int]] = (1, 1)
    dataset: str
    model: dict
    job: str = ""
    split: str = "test"


@message
class Evaluation(Message):
    """The scores as released (rounded and noised on a private split; always finite), the samples
    read, an evaluator's extra ``metrics``, and the sha256 of the weights scored. ``epsilon``: the
    privacy parameter they were released at (0: exact; None: the provider did not say), from which
    ``services.provider.score_release.margin`` gives each score's noise."""

    loss: float
    accuracy: float
    n: int
    metrics: dict = field(default_factory=dict)
    sha256: str = ""
    epsilon: float | None = None


@message
class EvaluationReport(Request[Ok]):
    """Provider → router: what it released for an ``Evaluate`` naming ``job``, sent by token subject
    ``subject``. The router records a job's test score from this, never from a trainer's word.
    ``epsilon`` as in :class:`Evaluation`."""

    job: str
    dataset: str
    subject: str
    split: str
    loss: float
    accuracy: float
    n: int
    metrics: dict = field(default_factory=dict)
    sha256: str = ""
    epsilon: float | None = None


@message
class ChargeEvaluation(Request["EvaluationCharged"]):
    """Provider → router, before it releases a score of ``dataset``'s private test split: spend one
    evaluation of the dataset's daily budget, kept at the router for every replica and restart
    (``per_day``: the provider's ``eval_per_dataset_day``; 0 = unlimited). Refused ``RATE_LIMITED``
    when the day's evaluations are spent; only a provider serving ``dataset`` may ask."""

    dataset: str
    per_day: int


@message
class EvaluationCharged(Message):
    """The router's answer to :class:`ChargeEvaluation`: the evaluations ``left`` today and the
    dataset's noise ``key`` (64 hex digits, the same for every replica and across restarts), under
    which the provider draws the released score's noise. ``left`` is None for an unlimited budget."""

    dataset: str
    key: str
    left: float | None = None


# -- pipeline control ----------------------------------------------------------------------------


@message
class StageControl(Request[Ok]):
    """Admin → provider: ``command`` for ``stage`` of pipeline ``dataset`` (``""``: the one pipeline
    with such a stage). Reply: ``Ok{detail: {dataset, stage, type, result}}``."""

    stage: str
    command: str
    dataset: str = ""
    args: dict = field(default_factory=dict)


#: The DatasetInfo fields replicas must agree on: what a loader's order and a model are built
#: from. Others (``uri``, ``path``, ``memory``, ``format``) describe one node's copy and may differ.
REPLICA_FIELDS = (
    "splits",
    "sample_shape",
    "label_shape",
    "dtype",
    "label_dtype",
    "num_classes",
    "class_names",
    "kind",
    "seq_len",
    "vocab_size",
    "val_fraction",
    "fields",
)
#: Per split, what must agree (``shuffle`` is only a hint).
SPLIT_FIELDS = ("num_samples", "available")


def _split_view(splits: Any) -> Any:
    if not isinstance(splits, dict):
        return splits
    return {name: {k: s.get(k) for k in SPLIT_FIELDS} if isinstance(s, dict) else s for name, s in splits.items()}


def info_mismatch(ours: dict, theirs: dict, here: str = "here", there: str = "there") -> str | None:
    """The first :data:`REPLICA_FIELDS` field on which two DatasetInfos differ, as
    ``"FIELD is OURS <here>, THEIRS <there>"`` (a dotted path for split sizes, e.g.
    ``splits.train.num_samples is 600 on node-1, 500 on node-2``); ``None`` when they agree."""
    for name in REPLICA_FIELDS:
        a, b = ours.get(name), theirs.get(name)
        if name == "splits":
            a, b = _split_view(a), _split_view(b)
            if isinstance(a, dict) and isinstance(b, dict):
                for split in [*a, *(k for k in b if k not in a)]:
                    for key in SPLIT_FIELDS:
                        x, y = (a.get(split) or {}).get(key), (b.get(split) or {}).get(key)
                        if x != y:
                            return f"splits.{split}.{key} is {x!r} {here}, {y!r} {there}"
                continue
        if a != b:
            return f"{name} is {a!r} {here}, {b!r} {there}"
    return None


# -- where samples live --------------------------------------------------------------------------


@message
class LocateSamples(Request["SampleLocations"]):
    """Where samples ``indices`` of ``split`` of ``dataset`` live (at most
    :data:`~libbus.constants.MAX_LOCATE_INDICES`): a provider answers with one short string per index,
    a path relative to the dataset's root and a byte offset, row or member (``""`` where its source
    does not know). Scoped and refused as a :class:`BatchRequest` is (the private test split too)."""

    dataset: str
    split: str
    indices: list


@message
class SampleLocations(Message):
    """``locations[i]``: where ``indices[i]`` of the request lives, e.g. ``train.npy@128+784`` (file, byte
    offset and length), ``shard-000012.tar:000345.jpg@5632+1201``, ``data/train-0.parquet row 812``."""

    locations: list

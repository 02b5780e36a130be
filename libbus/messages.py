"""Every message on the batchbus wire, defined once: its type name, header fields and payload frames.

A message is ``[b"BB1", header, *payload]``: ``header`` is an orjson object with ``type`` and the
message's fields; bulk data (indices, samples, labels, weights) travels only in ``payload`` frames.
:func:`encode` and :func:`decode` are the only code that touch frame positions.

Field types are checked on decode against the dataclass annotations, so a handler can trust
``msg.field`` to have its declared type. Unknown header keys are ignored (forward compatibility).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

from . import PROTOCOL
from .constants import MAX_FRAMES, MAX_HEADER_BYTES, MAX_HEADER_DEPTH, MAX_MSG_BYTES
from .errors import BadRequest, BusError, TooLarge
from .schema import schema_of, too_deep, type_name

__all__ = [
    "Message",
    "MESSAGE_TYPES",
    "encode",
    "decode",
    "error_reply",
    "frame_buffer",
    "request_id_of",
    "Hello",
    "Welcome",
    "Heartbeat",
    "Error",
    "Ok",
    "Resolve",
    "Resolved",
    "DatasetInfoRequest",
    "DatasetInfo",
    "BatchRequest",
    "BatchResponse",
    "AttachRing",
    "RingAttached",
    "SubmitJob",
    "JobSubmitted",
    "ListJobs",
    "JobList",
    "GetJob",
    "JobInfo",
    "ControlJob",
    "GetTask",
    "Task",
    "Rendezvous",
    "NoTask",
    "Progress",
    "PushResult",
    "Command",
    "CommandAck",
    "Checkpointed",
    "GetModel",
    "Model",
    "Evaluate",
    "Evaluation",
    "StageControl",
    "Stats",
    "StatsReply",
    "ListPeers",
    "PeerList",
    "RevokeToken",
    "ListRevoked",
    "RevokedList",
    "Entitlements",
    "Goodbye",
    "SubmitStudy",
    "ListStudies",
    "GetStudy",
    "StopStudy",
    "StudyInfo",
    "StudyList",
]

MESSAGE_TYPES: dict[str, type[Message]] = {}


@dataclass(kw_only=True)
class Message:
    """Base of all messages. ``id`` pairs a request with its reply; ``frames`` are the raw payload."""

    type: ClassVar[str] = ""
    #: Payload frames this message must carry: (min, max).
    nframes: ClassVar[tuple[int, int]] = (0, 0)

    id: int = 0
    frames: list = field(default_factory=list, repr=False, compare=False)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.type = cls.__name__
        MESSAGE_TYPES[cls.type] = cls

    def header(self) -> dict[str, Any]:
        out = {"type": self.type}
        for name in schema_of(type(self)):
            out[name] = getattr(self, name)
        return out


# -- session -------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Hello(Message):
    """First message on every connection: who I am, and the token that proves it."""

    role: str
    name: str
    token: str
    host_id: str = ""
    pid: int = 0
    version: str = ""
    caps: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class Welcome(Message):
    session: str
    heartbeat_ms: int


@dataclass(kw_only=True)
class Heartbeat(Message):
    """Both ways, every heartbeat interval. Services carry their queue metrics in ``stats``."""

    stats: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class Goodbye(Message):
    """Client → any service, no reply: the client is done; the service closes its session now
    instead of keeping it until it expires."""


@dataclass(kw_only=True)
class Error(Message):
    code: str
    message: str


@dataclass(kw_only=True)
class Ok(Message):
    """A plain acknowledgement."""

    detail: dict = field(default_factory=dict)


# -- discovery and datasets -------------------------------------------------------------------


@dataclass(kw_only=True)
class Resolve(Message):
    dataset: str


@dataclass(kw_only=True)
class Resolved(Message):
    dataset: str
    info: dict
    providers: list


@dataclass(kw_only=True)
class DatasetInfoRequest(Message):
    dataset: str


@dataclass(kw_only=True)
class DatasetInfo(Message):
    """What a trainer needs to size its model and its requests. See docs/protocol.md for ``info``.

    ``host_id`` is the provider's machine: a trainer with the same one may offer a ring, and
    connect through ``local_endpoint`` (an ``ipc://`` Unix socket) instead of TCP.
    """

    dataset: str
    info: dict
    host_id: str = ""
    local_endpoint: str = ""


@dataclass(kw_only=True)
class BatchRequest(Message):
    """Samples by index: either ``range=[start, end)`` or one int64 payload frame of indices.

    With ``slot`` and ``seq`` (after :class:`AttachRing`) the provider writes the batch into that
    ring slot, if the slot still awaits request ``seq``, instead of sending it back. ``epoch`` seeds
    a pipeline dataset's random stages, so a resent request gets the same bytes.
    """

    nframes: ClassVar[tuple[int, int]] = (0, 1)
    dataset: str
    split: str
    range: list | None = None
    slot: int | None = None
    seq: int | None = None
    epoch: int = 0


@dataclass(kw_only=True)
class BatchResponse(Message):
    """Data then labels, C-contiguous, shapes and dtypes in the header: two payload frames, or
    none when the batch is in ring slot ``slot`` under sequence ``seq``."""

    nframes: ClassVar[tuple[int, int]] = (0, 2)
    shapes: list
    dtypes: list
    nbytes: int
    slot: int | None = None
    seq: int | None = None


# -- shared memory ------------------------------------------------------------------------------


@dataclass(kw_only=True)
class AttachRing(Message):
    """Map the trainer's ring ``name`` (same host only) for this session's batch requests.

    The provider checks the ring's header (magic, version) and geometry against these fields, and
    that the file is this user's and private, before it writes a byte.
    """

    name: str
    slots: int
    slot_bytes: int
    label_offset: int


@dataclass(kw_only=True)
class RingAttached(Message):
    name: str


# -- jobs ---------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class SubmitJob(Message):
    """A job spec; an ``evaluate`` task of an uploaded model carries it as one payload frame
    (safetensors bytes), which the router keeps as ``artifact:ID``."""

    nframes: ClassVar[tuple[int, int]] = (0, 1)
    spec: dict


@dataclass(kw_only=True)
class JobSubmitted(Message):
    job: str


@dataclass(kw_only=True)
class ListJobs(Message):
    """Jobs, newest first: ``limit`` of them after the ``offset`` newest (pages)."""

    state: str | None = None
    limit: int = 100
    offset: int = 0


@dataclass(kw_only=True)
class JobList(Message):
    jobs: list
    #: Set when the list was cut to fit one reply: what was left out and how to see it.
    note: str = ""


@dataclass(kw_only=True)
class GetJob(Message):
    """One job; with ``progress`` > 0 also its last ``progress`` progress reports; ``events``
    events and checkpoint records, newest first after skipping ``offset`` of them (pages)."""

    job: str
    progress: int = 0
    events: int = 200
    offset: int = 0


@dataclass(kw_only=True)
class JobInfo(Message):
    job: dict
    #: Set when history was cut to fit one reply.
    note: str = ""


@dataclass(kw_only=True)
class ControlJob(Message):
    """stop, pause, resume, checkpoint, set (``args``: the hyper-parameters to change), or eval."""

    job: str
    command: str
    args: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class GetTask(Message):
    """Trainer → router: give me work. ``key`` names this one ask: the same ``key`` again (the
    link resends after a reconnect, the trainer asks again after a lost reply) gets the job it
    was already given, at no cost of an attempt."""

    key: str = ""


@dataclass(kw_only=True)
class Task(Message):
    """A job for the trainer that asked. In a gang (``world_size`` > 1) every rank gets one;
    ranks above 0 get theirs once rank 0 has reported ``rendezvous`` (``tcp://host:port``).
    An ``evaluate`` task carries the model to score as one payload frame (safetensors bytes)."""

    nframes: ClassVar[tuple[int, int]] = (0, 1)
    job: str
    spec: dict
    rank: int = 0
    world_size: int = 1
    resume: dict | None = None
    rendezvous: str = ""


@dataclass(kw_only=True)
class Rendezvous(Message):
    """Trainer (rank 0 of a gang) → router: where the other ranks meet it (``tcp://host:port``,
    a torch.distributed TCPStore). Answered with ``Ok``."""

    job: str
    address: str


@dataclass(kw_only=True)
class NoTask(Message):
    retry_ms: int


@dataclass(kw_only=True)
class Progress(Message):
    job: str
    progress: dict


@dataclass(kw_only=True)
class PushResult(Message):
    """A job's end (or hand-back). A succeeded job's final weights may ride along as one payload
    frame (safetensors bytes, sha256 in ``result.model``) for the router to keep."""

    nframes: ClassVar[tuple[int, int]] = (0, 1)
    job: str
    state: str
    result: dict = field(default_factory=dict)
    error: str = ""


@dataclass(kw_only=True)
class GetModel(Message):
    """Admin → router: the final weights of a succeeded job."""

    job: str


@dataclass(kw_only=True)
class Model(Message):
    """The weights as one payload frame (safetensors bytes) and their sha256; ``step`` and ``epoch``
    of a running job's current weights (``busctl job model --current``), 0 for a final model."""

    nframes: ClassVar[tuple[int, int]] = (1, 1)
    job: str
    sha256: str
    nbytes: int
    step: int = 0
    epoch: int = 0


@dataclass(kw_only=True)
class Command(Message):
    """Router → trainer, unsolicited (``id`` 0): stop, pause, resume, checkpoint, set, eval.
    The trainer answers a non-zero ``seq`` with :class:`CommandAck` once it has applied it."""

    job: str
    command: str
    args: dict = field(default_factory=dict)
    seq: int = 0


@dataclass(kw_only=True)
class CommandAck(Message):
    """Trainer → router: command ``seq`` of ``job`` was applied; ``state`` is the job's state on the
    trainer now (running or paused); ``detail`` says what was done (a checkpoint's record...).
    ``model`` (``busctl job model --current``) carries the copied weights as one payload frame."""

    nframes: ClassVar[tuple[int, int]] = (0, 1)
    job: str
    command: str
    seq: int
    state: str
    detail: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class Checkpointed(Message):
    """Trainer → router: a checkpoint of ``job`` is on disk (``checkpoint``: path, sha256, step,
    epoch, cursor); the job resumes from the latest one if its trainer is lost."""

    job: str
    checkpoint: dict


# -- evaluation ------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Evaluate(Message):
    """Weights (safetensors bytes) in one payload frame; the provider scores them on its test split."""

    nframes: ClassVar[tuple[int, int]] = (1, 1)
    dataset: str
    model: dict
    job: str = ""
    split: str = "test"


@dataclass(kw_only=True)
class Evaluation(Message):
    loss: float
    accuracy: float
    n: int


# -- pipeline control ----------------------------------------------------------------------------


@dataclass(kw_only=True)
class StageControl(Message):
    """Admin → provider: ``command`` for ``stage`` of pipeline ``dataset`` (``""``: the one pipeline
    with such a stage). Reply: ``Ok{detail: {dataset, stage, type, result}}``."""

    stage: str
    command: str
    dataset: str = ""
    args: dict = field(default_factory=dict)


# -- stats and peers -------------------------------------------------------------------------


@dataclass(kw_only=True)
class Stats(Message):
    pass


@dataclass(kw_only=True)
class StatsReply(Message):
    services: dict


@dataclass(kw_only=True)
class ListPeers(Message):
    pass


@dataclass(kw_only=True)
class PeerList(Message):
    peers: list


# -- security ------------------------------------------------------------------------------


@dataclass(kw_only=True)
class RevokeToken(Message):
    """Admin → router: refuse the token ``jti`` on every service until ``exp`` (its own expiry,
    after which it is dead anyway). Answered with ``Ok``."""

    jti: str
    exp: float
    reason: str = ""


@dataclass(kw_only=True)
class ListRevoked(Message):
    pass


@dataclass(kw_only=True)
class RevokedList(Message):
    """``revoked``: ``[{jti, exp, at, reason}]``, newest first."""

    revoked: list


@dataclass(kw_only=True)
class Entitlements(Message):
    """Router → provider, unsolicited, when the provider connects and whenever either part changes:
    the revoked ``jti``s still unexpired, and per dataset the token subjects of the trainers
    assigned to a running job on it (``{dataset: [sub, ...]}``)."""

    revoked: list
    assigned: dict


# -- studies (services/router/studies.py) ------------------------------------------------------


@dataclass(kw_only=True)
class SubmitStudy(Message):
    """Admin → router: a study file's tables (``{base, space, study}``). Reply: :class:`StudyInfo`."""

    spec: dict


@dataclass(kw_only=True)
class ListStudies(Message):
    pass


@dataclass(kw_only=True)
class GetStudy(Message):
    study: str


@dataclass(kw_only=True)
class StopStudy(Message):
    """Admin → router: stop a study and its running trials. Reply: ``Ok``."""

    study: str


@dataclass(kw_only=True)
class StudyInfo(Message):
    """A study: ``{id, state, objective, direction, trials: [{number, job, params, state, value,
    epochs, reports}], best, epochs_trained, epochs_budget, spec}``."""

    study: dict


@dataclass(kw_only=True)
class StudyList(Message):
    studies: list


# -- encode / decode -------------------------------------------------------------------------


def encode(msg: Message) -> list:
    """Frames for ``msg``: protocol tag, JSON header, then its payload frames untouched."""
    try:
        head = orjson.dumps(msg.header(), option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as err:
        raise BadRequest(f"{msg.type}: header is not JSON-serialisable: {err}") from err
    if len(head) > MAX_HEADER_BYTES:
        # The peer would drop it as malformed and wait out its timeout: refuse it here, loudly.
        raise TooLarge(f"{msg.type} header is {len(head)} bytes; a peer accepts at most {MAX_HEADER_BYTES}")
    return [PROTOCOL, head, *msg.frames]


def frame_buffer(frame) -> bytes | memoryview:
    """The bytes of a received payload frame without a copy: a ``zmq.Frame``'s buffer, or the bytes
    themselves (frames received with ``copy=True``, or built locally)."""
    return frame.buffer if hasattr(frame, "buffer") else frame


def decode(frames: list) -> Message:
    """Parse and check one message. Raises :class:`BadRequest` naming what is wrong.

    ``frames`` may be bytes or ``zmq.Frame`` objects; payload frames are passed through as received.
    """
    if len(frames) < 2:
        raise BadRequest(f"expected at least 2 frames (protocol tag, header), got {len(frames)}")
    if len(frames) > MAX_FRAMES:
        raise TooLarge(f"message has {len(frames)} frames; at most {MAX_FRAMES} are accepted")
    total = sum(memoryview(frame_buffer(f)).nbytes for f in frames)
    if total > MAX_MSG_BYTES:
        raise TooLarge(f"message is {total} bytes in all; at most {MAX_MSG_BYTES} are accepted")
    tag = bytes(frame_buffer(frames[0]))
    if tag != PROTOCOL:
        raise BadRequest(f"unknown protocol tag {tag[:16]!r}; expected {PROTOCOL!r}")
    raw = frame_buffer(frames[1])
    if len(raw) > MAX_HEADER_BYTES:
        raise TooLarge(f"header is {len(raw)} bytes; at most {MAX_HEADER_BYTES} are accepted")
    try:
        head = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise BadRequest(f"header is not valid JSON: {err}") from err
    if not isinstance(head, dict):
        raise BadRequest(f"header must be a JSON object, got {type(head).__name__}")
    if too_deep(head, MAX_HEADER_DEPTH):
        # orjson reads 1024 levels but writes 254: a header that deep could be stored (stats,
        # caps) and then break every reply that echoes it.
        raise BadRequest(f"header nests deeper than {MAX_HEADER_DEPTH} levels")
    mtype = head.get("type")
    cls = MESSAGE_TYPES.get(mtype) if isinstance(mtype, str) else None
    if cls is None:
        raise BadRequest(f"unknown message type {mtype!r}")
    payload = list(frames[2:])
    lo, hi = cls.nframes
    if not lo <= len(payload) <= hi:
        want = f"{lo}" if lo == hi else f"{lo} to {hi}"
        raise BadRequest(f"{mtype} carries {want} payload frame(s), got {len(payload)}")
    kwargs = {}
    for name, (accepts, required, annotation) in schema_of(cls).items():
        if name not in head:
            if required:
                raise BadRequest(f"{mtype} is missing field '{name}'")
            continue
        value = head[name]
        if not accepts(value):
            raise BadRequest(f"{mtype}.{name} must be {type_name(annotation)}, got {type(value).__name__}")
        kwargs[name] = value
    try:
        return cls(**kwargs, frames=payload)
    except TypeError as err:  # pragma: no cover - the schema above mirrors the dataclass
        raise BadRequest(f"{mtype}: {err}") from err


def error_reply(request_id: int, err: BusError) -> Error:
    return Error(id=request_id, code=err.code, message=str(err))


def request_id_of(frames: list) -> int:
    """Best-effort ``id`` of a message that failed to decode, so its Error can still be matched (0 if none)."""
    try:
        raw = frame_buffer(frames[1])
        if len(raw) > MAX_HEADER_BYTES:
            return 0
        head = orjson.loads(raw)
        rid = head.get("id", 0) if isinstance(head, dict) else 0
        return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0
    except Exception:  # noqa: BLE001 - any garbage means "no id"
        return 0

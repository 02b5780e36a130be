"""The batchbus wire format: the :class:`Message` base, the :func:`message` decorator that registers a
message type, :class:`Request` (a message that declares its reply), and the only code that touches frame
positions.

A message is ``[b"BB2", header, *payload]``: ``header`` is an orjson object with ``type`` and the
message's fields; bulk data (indices, samples, labels, weights) travels only in ``payload`` frames.
:func:`encode` and :func:`decode` are the only code that touch frame positions.

The tag carries the wire version (``BB`` + digits). A message tagged with another version is
refused with :class:`WrongVersion`, naming both; the reply to it (an ``Error``) goes back under the
peer's own tag, so an older peer can read why.

Field types are checked on decode against the dataclass annotations, so a handler can trust
``msg.field`` to have its declared type. Unknown header keys are ignored (forward compatibility).

The message classes themselves live by family in :mod:`libbus.wire.msg_data` and :mod:`libbus.wire.msg_jobs`;
each is declared with ``@message``, which makes it a keyword-only dataclass and registers it in
:data:`MESSAGE_TYPES` under its class name when its module is imported (:mod:`libbus.wire.messages`, the
public face, imports every family). A request names its reply once, as its base:
``class GetJob(Request["JobInfo"])``; :meth:`libbus.connect.client.Client.request` then returns a ``JobInfo``
to the type checker (the reply is not checked at run time: a test handler may answer as it likes).
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass, field
from typing import Any, ClassVar, ForwardRef, Generic, TypeVar, dataclass_transform, get_args, get_origin

import orjson

from libbus.constants import MAX_FRAMES, MAX_HEADER_BYTES, MAX_HEADER_DEPTH, MAX_MSG_BYTES, PROTOCOL
from libbus.errors import BadRequest, TooLarge
from libbus.wire.schema import schema_of, too_deep, type_name

__all__ = [
    "Message",
    "MESSAGE_TYPES",
    "Request",
    "message",
    "WrongVersion",
    "encode",
    "decode",
    "frame_buffer",
    "request_id_of",
]

MESSAGE_TYPES: dict[str, type[Message]] = {}

_TAG = re.compile(rb"BB([0-9]{1,4})")


class WrongVersion(BadRequest):
    """A peer speaks another wire version; ``tag`` is its tag (the reply goes back under it)."""

    def __init__(self, tag: bytes, peer: str = "the peer", us: str = "this service"):
        self.tag = tag
        theirs = _TAG.fullmatch(tag)
        ours = _TAG.fullmatch(PROTOCOL)
        super().__init__(
            f"wire version mismatch: {peer} speaks batchbus wire version {int(theirs[1]) if theirs else '?'} "
            f"({tag!r}), {us} version {int(ours[1]) if ours else '?'} ({PROTOCOL!r}); "
            "run the same batchbus release on both sides"
        )


@dataclass(kw_only=True)
class Message:
    """Base of all messages. ``id`` pairs a request with its reply; ``frames`` are the raw payload."""

    type: ClassVar[str] = ""
    #: Payload frames this message must carry: (min, max).
    nframes: ClassVar[tuple[int, int]] = (0, 0)

    #: The tag this message is sent under: the class's, or a refused older peer's (see :func:`encode`).
    wire_tag: ClassVar[bytes] = PROTOCOL

    id: int = 0
    frames: list = field(default_factory=list, repr=False, compare=False)

    def header(self) -> dict[str, Any]:
        out = {"type": self.type}
        for name in schema_of(type(self)):
            out[name] = getattr(self, name)
        return out


ReplyT = TypeVar("ReplyT", bound=Message, covariant=True)


@dataclass(kw_only=True)
class Request(Message, Generic[ReplyT]):
    """A message its receiver answers with a ``ReplyT`` (or an ``Error``). A request class names its
    reply once, as its base: ``class GetJob(Request["JobInfo"])``, a union for several
    (``Request["Task | NoTask"]``); quoted when the reply is declared further down."""

    @classmethod
    def reply_types(cls) -> tuple[type[Message], ...]:
        """The message types this request may be answered with (besides ``Error``), from its base."""
        found = _REPLIES.get(cls)
        if found is None:
            found = _REPLIES[cls] = _replies_of(cls)
        return found


_REPLIES: dict[type, tuple[type[Message], ...]] = {}


def _replies_of(cls: type) -> tuple[type[Message], ...]:
    for klass in cls.__mro__:
        for base in klass.__dict__.get("__orig_bases__", ()):
            if get_origin(base) is not Request:
                continue
            (reply,) = get_args(base)
            if isinstance(reply, ForwardRef):
                kinds: tuple = tuple(MESSAGE_TYPES.get(name.strip()) for name in reply.__forward_arg__.split("|"))
            else:
                kinds = get_args(reply) if isinstance(reply, types.UnionType) else (reply,)
            out: list[type[Message]] = []
            for kind in kinds:
                if not (isinstance(kind, type) and issubclass(kind, Message)):
                    raise TypeError(f"{cls.__name__}: Request[...] must name registered message types, got {reply!r}")
                out.append(kind)
            return tuple(out)
    raise TypeError(f"{cls.__name__} names no reply: declare it as Request[ReplyType]")


M = TypeVar("M", bound=type[Message])


@dataclass_transform(kw_only_default=True, field_specifiers=(field,))
def message(cls: M) -> M:
    """Class decorator: ``cls`` becomes a keyword-only dataclass and a message type of the wire, named
    by its class name (the header's ``type``). The one way to declare a message; a name used twice is
    refused at import."""
    dataclass(kw_only=True)(cls)  # in place: the class itself comes back
    name = cls.__name__
    if name in MESSAGE_TYPES:
        raise TypeError(f"message type {name!r} is declared twice ({MESSAGE_TYPES[name].__module__}, {cls.__module__})")
    cls.type = name
    MESSAGE_TYPES[name] = cls
    return cls


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
    return [msg.wire_tag, head, *msg.frames]


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
    if tag != PROTOCOL and _TAG.fullmatch(tag):
        raise WrongVersion(tag)
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

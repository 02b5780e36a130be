"""Socket construction and sending, with the limits every batchbus socket carries."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

from libbus.constants import HWM, MAX_MSG_BYTES, ZERO_COPY_THRESHOLD
from libbus.wire.messages import Message, encode

__all__ = ["SocketLimits", "make_socket", "send_message", "send_tracked", "frame_len", "drain_monitor"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SocketLimits:
    max_msg_bytes: int = MAX_MSG_BYTES
    hwm: int = HWM


def make_socket(ctx: zmq.Context, kind: int, limits: SocketLimits = SocketLimits()) -> zmq.Socket:
    """A socket with linger 0, MAXMSGSIZE and high-water marks set (ROUTERs report unroutable sends)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_msg_bytes)
    sock.setsockopt(zmq.SNDHWM, limits.hwm)
    sock.setsockopt(zmq.RCVHWM, limits.hwm)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def frame_len(frame) -> int:
    return len(frame.buffer) if isinstance(frame, zmq.Frame) else memoryview(frame).nbytes


def send_message(sock: zmq.Socket, msg: Message, routing_id: bytes | None = None) -> bool:
    """Send without blocking; large payload frames go zero-copy. Returns False when the peer is gone
    or its queue is full (the message is dropped, never blocks the service loop)."""
    return send_tracked(sock, msg, routing_id)[0]


def send_tracked(
    sock: zmq.Socket, msg: Message, routing_id: bytes | None = None, track_min: int | None = None
) -> tuple[bool, SentTracker | None, int]:
    """:func:`send_message` that can also tell when the message has left this process.

    With ``track_min``, a message of at least that many bytes goes out with one frame watched: the
    last of those sent zero-copy anyway (payloads of ``ZERO_COPY_THRESHOLD`` or more), else its last
    frame, sent zero-copy for the purpose. libzmq releases a frame once it is written to the kernel,
    and frames leave in order, so once the watched frame is released, at most that message's small
    copied tail (under ``ZERO_COPY_THRESHOLD`` a frame) is still held. Watching a frame that goes
    zero-copy anyway costs about a microsecond; a second zero-copy frame would cost a trip through
    pyzmq's garbage thread per reply. Returns ``(sent, tracker or None, bytes)``."""
    frames = encode(msg)
    nbytes = sum(frame_len(f) for f in frames)
    if routing_id is not None:
        frames.insert(0, routing_id)
    last = len(frames) - 1
    watch = -1
    if track_min is not None and nbytes >= track_min:
        big = [i for i, f in enumerate(frames) if frame_len(f) >= ZERO_COPY_THRESHOLD]
        watch = big[-1] if big else last
    tracker = None
    try:
        for i, frame in enumerate(frames):
            flags = zmq.NOBLOCK | (zmq.SNDMORE if i < last else 0)
            if i == watch:
                tracker = _send_watched(sock, frame.buffer if isinstance(frame, zmq.Frame) else frame, flags)
            elif isinstance(frame, zmq.Frame):
                sock.send(frame, flags, copy=False)
            else:
                sock.send(frame, flags, copy=frame_len(frame) < ZERO_COPY_THRESHOLD)
    except zmq.Again:
        log.warning("dropped %s: peer's queue is full", msg.type)
        return False, None, nbytes
    except zmq.ZMQError as err:
        if err.errno == zmq.EHOSTUNREACH:
            log.debug("dropped %s: peer is gone", msg.type)
            return False, None, nbytes
        raise
    return True, tracker, nbytes


class SentTracker:
    """Done once libzmq has released a zero-copy frame: pyzmq holds the frame's buffer object until
    libzmq frees the frame, then lets it go; a weak reference to that object tells when."""

    __slots__ = ("_ref",)

    def __init__(self, obj: object):
        self._ref = weakref.ref(obj)

    @property
    def done(self) -> bool:
        return self._ref() is None


def _send_watched(sock: zmq.Socket, data, flags: int) -> SentTracker:
    """Send ``data`` zero-copy, watched by a :class:`SentTracker` on a memoryview of its own (owned
    by nobody else); ``copy=False`` on the Frame itself, as pyzmq copies small buffers otherwise.
    Cheaper than pyzmq's ``track=True``, which makes an Event per frame."""
    view = memoryview(data)
    tracker = SentTracker(view)
    sock.send(view if view.nbytes >= ZERO_COPY_THRESHOLD else zmq.Frame(view, copy=False), flags, copy=False)
    return tracker


def drain_monitor(monitor: zmq.Socket | None, event: int) -> bool:
    """Read every event queued on a socket monitor without waiting; True if ``event`` was among
    them (a client's refused handshake, a replica's lost connection)."""
    if monitor is None:
        return False
    seen = False
    while True:
        try:
            frames = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return seen
        seen = seen or parse_monitor_message(frames)["event"] == event

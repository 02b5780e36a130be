"""Socket construction and sending, with the limits every batchbus socket carries."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

from .constants import HWM, MAX_MSG_BYTES, ZERO_COPY_THRESHOLD
from .messages import Message, encode

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
) -> tuple[bool, zmq.MessageTracker | None, int]:
    """:func:`send_message` that can also tell when the message has left this process.

    With ``track_min``, a message of at least that many bytes goes out with its last frame
    zero-copy and tracked: libzmq releases that frame once the whole message is written to the
    kernel (its frames leave in order), so the tracker is done exactly when the message no longer
    occupies this process's memory. Returns ``(sent, tracker or None, bytes)``."""
    frames = encode(msg)
    nbytes = sum(frame_len(f) for f in frames)
    track = track_min is not None and nbytes >= track_min
    if routing_id is not None:
        frames.insert(0, routing_id)
    last = len(frames) - 1
    tracker = None
    try:
        for i, frame in enumerate(frames):
            flags = zmq.NOBLOCK | (zmq.SNDMORE if i < last else 0)
            if track and i == last:
                # copy=False on the Frame itself: pyzmq copies small buffers otherwise, and a
                # copied frame's tracker is done at once
                data = frame.buffer if isinstance(frame, zmq.Frame) else frame
                tracked = zmq.Frame(data, track=True, copy=False)
                sock.send(tracked, flags, copy=False)
                tracker = tracked.tracker
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

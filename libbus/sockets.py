"""Socket construction and sending, with the limits every batchbus socket carries."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import zmq

from .constants import HWM, MAX_MSG_BYTES, ZERO_COPY_THRESHOLD
from .messages import Message, encode

__all__ = ["SocketLimits", "make_socket", "send_message", "frame_len"]

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
    frames = encode(msg)
    if routing_id is not None:
        frames.insert(0, routing_id)
    last = len(frames) - 1
    try:
        for i, frame in enumerate(frames):
            flags = zmq.NOBLOCK | (zmq.SNDMORE if i < last else 0)
            if isinstance(frame, zmq.Frame):
                sock.send(frame, flags, copy=False)
            else:
                sock.send(frame, flags, copy=frame_len(frame) < ZERO_COPY_THRESHOLD)
    except zmq.Again:
        log.warning("dropped %s: peer's queue is full", msg.type)
        return False
    except zmq.ZMQError as err:
        if err.errno == zmq.EHOSTUNREACH:
            log.debug("dropped %s: peer is gone", msg.type)
            return False
        raise
    return True

"""The channel between a trainer service and the child process running one attempt of an
entrypoint job (:mod:`.service.attempt_run` is the parent's side, :mod:`.attempt.child` the child's).

One Unix socket pair, framed by :class:`multiprocessing.connection.Connection` (raw bytes only:
nothing on it is pickled). A message is a JSON header (``op`` and its fields) followed by
``header["nframes"]`` raw frames (an encoded wire message, a model's bytes). Sends are
serialized by a lock: the child's reporter thread, its beat thread and the function share it.
"""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection
from typing import Any

import orjson

__all__ = ["LOST", "Channel", "ChannelClosed"]

#: How an attempt ends when the router gave its job to another trainer (its ``result``'s state, beside
#: the job states): no job state, nothing is pushed.
LOST = "lost"
#: The most frames one channel message carries (a relayed wire message has a few).
MAX_FRAMES = 16
#: The largest header the other side may send (frames are bounded by the wire's own limits).
MAX_HEADER = 1 << 20


class ChannelClosed(EOFError):
    """The other side is gone (its process ended, or closed the channel)."""


class Channel:
    def __init__(self, fd: int):
        self.conn = Connection(fd)
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()

    def send(self, op: str, frames: list[bytes] | None = None, **fields: Any) -> None:
        frames = frames or []
        header = orjson.dumps({**fields, "op": op, "nframes": len(frames)})
        try:
            with self._send_lock:
                self.conn.send_bytes(header)
                for frame in frames:
                    self.conn.send_bytes(frame)
        except (OSError, ValueError) as err:
            raise ChannelClosed(str(err)) from err

    def recv(self, timeout_s: float | None = None) -> tuple[dict, list[bytes]] | None:
        """The next message, or ``None`` if none came within ``timeout_s`` (``None``: wait)."""
        try:
            with self._recv_lock:
                if timeout_s is not None and not self.conn.poll(timeout_s):
                    return None
                header = orjson.loads(self.conn.recv_bytes(MAX_HEADER))
                if not isinstance(header, dict) or not isinstance(header.get("op"), str):
                    raise ChannelClosed("malformed message on the attempt channel")
                count = header.get("nframes", 0)
                if not isinstance(count, int) or not 0 <= count <= MAX_FRAMES:
                    raise ChannelClosed(f"message with {count!r} frames on the attempt channel")
                frames = [self.conn.recv_bytes() for _ in range(count)]
        except (EOFError, OSError, orjson.JSONDecodeError) as err:
            raise ChannelClosed(str(err) or "closed") from err
        return header, frames

    def close(self) -> None:
        self.conn.close()

"""A file descriptor a poll loop watches, set from any thread.

Work a handler finishes off the loop (a deferred reply's :class:`~concurrent.futures.Future`: an
evaluation, a ring slot filled by the provider's fill thread) sets it, so :class:`libbus.serve.server.Server`
sends the reply at once instead of at its next poll timeout (up to 10 ms, and with every request of
a loader in flight no new request arrives to wake it sooner).
"""

from __future__ import annotations

import os
import threading

__all__ = ["Wakeup"]


class Wakeup:
    """An ``eventfd``: :meth:`set` makes :attr:`fd` readable until :meth:`clear`."""

    def __init__(self):
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()  # a set() racing close() never writes into a reused fd number

    def set(self, *_args) -> None:
        """Wake the loop (any thread; takes and ignores a Future, so it serves as a done callback)."""
        with self._lock:
            if self.fd >= 0:
                try:
                    os.eventfd_write(self.fd, 1)
                except BlockingIOError:  # the counter is full: readable anyway
                    pass

    def clear(self) -> None:
        """Unset (on the loop's thread, before it looks at what is done)."""
        try:
            os.eventfd_read(self.fd)
        except (OSError, ValueError):  # not set, or closed
            pass

    def close(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()

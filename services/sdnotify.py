"""systemd's notify protocol (``sd_notify(3)``), spoken directly: no dependency.

A ``Type=notify`` service sends newline-separated ``KEY=VALUE`` lines as one datagram to the
``AF_UNIX`` socket named by ``$NOTIFY_SOCKET`` (a path, or ``@name`` in the abstract namespace):
``READY=1`` once it serves, ``STATUS=...`` for ``systemctl status``, ``STOPPING=1`` when it begins to
shut down, and ``WATCHDOG=1`` at least once per ``$WATCHDOG_USEC`` when the unit sets
``WatchdogSec=``. Outside systemd (no ``$NOTIFY_SOCKET``) every call is a cheap no-op.

The watchdog is fed by the caller's main loop (:meth:`Notifier.watchdog` once per turn), never by a
thread of its own: a loop that is stuck must stop feeding it, or the watchdog protects nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping

__all__ = ["Notifier"]

log = logging.getLogger(__name__)


class Notifier:
    """Sends notifications to the service manager listening on ``address``.

    Args:
        address: ``$NOTIFY_SOCKET``: a filesystem path or ``@name`` (abstract); "" disables.
        watchdog_usec: ``$WATCHDOG_USEC``; 0 leaves the watchdog off.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, address: str = "", watchdog_usec: int = 0, clock: Callable[[], float] = time.monotonic):
        self.address = address
        self.watchdog_usec = watchdog_usec if address else 0
        self._clock = clock
        self._sock: socket.socket | None = None
        self._last_watchdog = float("-inf")
        self._last_status = ""
        self._stopping = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Notifier:
        """The notifier systemd set up for this process: ``NOTIFY_SOCKET``, plus ``WATCHDOG_USEC``
        unless ``WATCHDOG_PID`` names another process (the variables were inherited, not meant
        for us)."""
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if not usec.isdigit() or (pid and pid != str(os.getpid())):
            usec = "0"
        return cls(env.get("NOTIFY_SOCKET", ""), int(usec))

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    @property
    def watchdog_s(self) -> float:
        """The watchdog interval in seconds (0: off)."""
        return self.watchdog_usec / 1e6

    def send(self, *lines: str) -> bool:
        """Send ``lines`` as one notification. False when no manager listens or sending failed
        (logged; a service never dies of its notifications)."""
        if not self.address:
            return False
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(lines).encode(), target)
            return True
        except OSError as err:
            log.warning("cannot notify the service manager at %s: %s", self.address, err)
            return False

    def ready(self, status: str = "") -> bool:
        """``READY=1``: the service's sockets are bound and it serves. Arms the watchdog's clock."""
        self._last_status = status
        self._last_watchdog = self._clock()
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        """``STATUS=text`` (shown by ``systemctl status``); repeating the current text sends nothing."""
        if text == self._last_status:
            return False
        self._last_status = text
        return self.send(f"STATUS={text}")

    def stopping(self, status: str = "") -> bool:
        """``STOPPING=1``, once: the service began to shut down."""
        if self._stopping:
            return False
        self._stopping = True
        self._last_status = status or self._last_status
        return self.send("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        """Feed the watchdog, at most once per half interval (call it every turn of the main loop)."""
        if not self.watchdog_usec:
            return False
        now = self._clock()
        if now - self._last_watchdog < self.watchdog_s / 2:
            return False
        self._last_watchdog = now
        return self.send("WATCHDOG=1")

    @contextlib.contextmanager
    def extended(self, seconds: float) -> Iterator[None]:
        """Allow the main loop one bounded wait longer than the watchdog interval (an evaluation
        with its own timeout): the interval becomes ``seconds`` plus one normal interval, then
        goes back. A wait that overruns even that still trips the watchdog."""
        if not self.watchdog_usec or seconds * 1e6 <= self.watchdog_usec / 2:
            yield
            return
        longer = int(seconds * 1e6) + self.watchdog_usec
        self.send(f"WATCHDOG_USEC={longer}", "WATCHDOG=1")
        try:
            yield
        finally:
            self._last_watchdog = self._clock()
            self.send(f"WATCHDOG_USEC={self.watchdog_usec}", "WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

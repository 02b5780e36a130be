"""A service's long-lived connection to the router, kept alive by a background I/O thread.

The thread owns the DEALER socket: it says ``Hello``, sends ``Heartbeat{stats}`` every interval,
notices a silent router (``heartbeat_liveness`` intervals) and reconnects, and hands pushed messages
(``Command``) to a callback. Other threads call :meth:`Link.request`, which is thread-safe: the
request is queued, the I/O thread is woken through a pipe, and the caller waits on a future. A request
that cannot be encoded (a header past the 1 MiB a peer accepts) fails with its error; the thread goes on.

While the router is away, requests wait (up to their timeout) and are sent once it is back, so a
trainer keeps training through a router restart.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar, overload

import zmq

from libbus.connect.client import Client, Identity, remember_nonce
from libbus.errors import AuthExpired, AuthInvalid, BusError, Forbidden, PeerTimeout, error_from_code
from libbus.wire.messages import Error, Heartbeat, Message, Request, Welcome
from libbus.wire.sockets import SocketLimits

__all__ = ["Link"]

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Message)

_FATAL = (AuthInvalid, AuthExpired, Forbidden)
#: Most messages taken per turn of the link's loop before its timers run again.
RECEIVE_BURST = 256


class Link:
    """Connection to the router with heartbeats and reconnection, driven by its own thread.

    Args:
        endpoint: the router's address.
        identity: role, name and token; ``caps.heartbeat`` is set for you.
        heartbeat_ms / liveness: the beat period and how many silent periods mean "router gone".
        on_push: called on the I/O thread with each pushed message; keep it quick (queue it).
        stats: called on the I/O thread each beat; its record (the service's stats) rides on the heartbeat.
    """

    def __init__(
        self,
        endpoint: str,
        identity: Identity,
        *,
        heartbeat_ms: int = 1000,
        liveness: int = 5,
        on_push: Callable[[Message], None] | None = None,
        stats: Callable[[], Mapping[str, object]] | None = None,
        ctx: zmq.Context | None = None,
        limits: SocketLimits = SocketLimits(),
    ):
        identity.caps = {**identity.caps, "heartbeat": True}
        self.client = Client(endpoint, identity, ctx=ctx, limits=limits, server_key=identity.router_key)
        self.heartbeat_s = heartbeat_ms / 1000
        self.liveness = liveness
        self.on_push = on_push or (lambda msg: None)
        self.stats = stats or dict
        self.connected = threading.Event()
        #: Set when the router refused us for good (bad token, wrong role): services exit on it.
        self.fatal: BusError | None = None
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, tuple[Message, Future, float]] = {}
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name=f"link-{identity.role}", daemon=True)
        self._hello_id = 0
        self._hello_sent = 0.0

    # -- public -------------------------------------------------------------------------------
    def start(self) -> Link:
        self._thread.start()
        return self

    def wait_connected(self, timeout_s: float) -> bool:
        """True once the router has welcomed us; raises the fatal error if it refused us."""
        deadline = time.monotonic() + timeout_s
        while not self.connected.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if self.fatal is not None:
                raise self.fatal
            if time.monotonic() >= deadline:
                return False
        return True

    @overload
    def request(self, msg: Request[R], timeout_s: float = 10.0) -> R: ...

    @overload
    def request(self, msg: Message, timeout_s: float = 10.0) -> Message: ...

    def request(self, msg: Message, timeout_s: float = 10.0) -> Message:
        """Send ``msg`` to the router and wait for the reply (thread-safe); for the type checker, a
        :class:`Request` gets its declared reply type.

        Raises the reply's typed error, or :class:`PeerTimeout` if no reply came within ``timeout_s``
        (including time spent waiting for the router to come back).
        """
        if self.fatal is not None:
            raise self.fatal
        fut: Future = Future()
        self._outgoing.put((msg, fut, time.monotonic() + timeout_s))
        self._wake()
        try:
            return fut.result(timeout_s + 1.0)
        except FutureTimeout as err:
            raise PeerTimeout(
                f"router {self.client.endpoint} did not answer {msg.type} within {timeout_s:.1f} s"
            ) from err

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # -- the I/O thread -------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # pipe full (already woken) or closed (stopping)

    def _run(self) -> None:
        client = self.client
        last_beat = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if not self.connected.is_set() and now - self._hello_sent > self.heartbeat_s * 2:
                    self._send_hello()
                poller = zmq.Poller()
                poller.register(client.socket, zmq.POLLIN)
                poller.register(self._wake_r, zmq.POLLIN)
                events = dict(poller.poll(int(self.heartbeat_s * 500) or 1))
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                if client.socket in events:
                    self._receive()
                if self.connected.is_set():
                    self._send_queued()
                now = time.monotonic()
                if self.connected.is_set() and now - last_beat >= self.heartbeat_s:
                    last_beat = now
                    self._beat()
                if self.connected.is_set() and now - client.last_recv > self.heartbeat_s * self.liveness:
                    log.warning("router %s silent for %.1f s; reconnecting", client.endpoint, now - client.last_recv)
                    self._reconnect()
                self._expire(now)
        except Exception:  # noqa: BLE001 - log, fail waiting callers, never hang them
            log.exception("router link failed")
            self.fatal = self.fatal or BusError("router link thread failed; see the log")
        finally:
            for _, fut, _ in self._pending.values():
                if not fut.done():
                    fut.set_exception(PeerTimeout("router link closed"))
            while not self._outgoing.empty():
                _, fut, _ = self._outgoing.get_nowait()
                fut.set_exception(PeerTimeout("router link closed"))
            client.close()

    def _send(self, msg: Message) -> None:
        try:
            self.client.send(msg)
        except PeerTimeout:
            log.warning("router send queue full; %s dropped", msg.type)

    def _renewable(self) -> bool:
        """The handshake was refused for the token minted with this socket, now expired (libzmq
        presents it again at every reconnection): a service that mints its tokens starts over on a
        fresh socket with a fresh one."""
        return callable(self.client.identity.token) and self.client.handshake_expired()

    def _send_hello(self) -> None:
        if self._hello_sent and self.client.handshake_refused() and not self._renewable():
            # The router's handshake refused our token (wrong secret, another cluster, revoked):
            # as fatal as an AUTH_INVALID reply to Hello.
            self.fatal = AuthInvalid(
                f"router {self.client.endpoint} refused this service's token at the "
                "connection handshake; check the token and the cluster secret"
            )
            log.error("router refused this service: %s", self.fatal)
            self._stop.set()
            return
        if self._hello_sent:  # the last Hello went unanswered: start over on a fresh socket
            self.client.reset()
        self._hello_id = self.client.next_id()
        self._hello_sent = time.monotonic()
        try:
            self.client.send(self.client.identity.hello(self._hello_id, endpoint=self.client.endpoint))
        except PeerTimeout as err:
            # not queued (a fresh socket not connected yet, or its queue full): unanswered like a lost
            # Hello, so the next turn after the Hello timeout starts over on a fresh socket; not fatal
            log.warning("Hello to router %s not sent (%s); trying again", self.client.endpoint, err)
        except BusError as err:  # e.g. a token callable that cannot mint
            self.fatal = err

    def _reconnect(self) -> None:
        self.connected.clear()
        self.client.reset()
        self._hello_sent = 0.0
        # Requests sent on the old socket are resent after the next Welcome.
        for msg, fut, deadline in list(self._pending.values()):
            self._outgoing.put((msg, fut, deadline))
        self._pending.clear()

    def _receive(self) -> None:
        client = self.client
        for _ in range(RECEIVE_BURST):  # bounded: a flooding router must not starve heartbeats and deadlines
            msg = client.recv(0)
            if msg is None:
                break
            if msg.id == self._hello_id:
                self._on_hello_reply(msg)
            elif isinstance(msg, Error) and msg.code in ("AUTH_REQUIRED", "AUTH_EXPIRED"):
                # The router forgot our session (it restarted, or our token expired), as the reply to
                # a heartbeat or a request says: Hello again with a fresh token, then resend.
                log.warning("router dropped our session (%s); saying Hello again", msg.code)
                self._reconnect()
                break
            elif msg.id in self._pending:
                _, fut, _ = self._pending.pop(msg.id)
                if isinstance(msg, Error):
                    fut.set_exception(error_from_code(msg.code, msg.message))
                else:
                    fut.set_result(msg)
        while client.pushes:
            push = client.pushes.popleft()
            try:
                self.on_push(push)
            except Exception:  # noqa: BLE001
                log.exception("push handler failed for %s", push.type)

    def _on_hello_reply(self, msg: Message) -> None:
        if isinstance(msg, Welcome):
            self.client.session = msg.session
            remember_nonce(self.client.endpoint, self.client.identity, msg.nonce)
            self.connected.set()
            log.info("connected to router %s (session %s)", self.client.endpoint, msg.session)
        elif isinstance(msg, Error):
            err = error_from_code(msg.code, msg.message)
            if isinstance(err, _FATAL):
                log.error("router refused this service: %s", err)
                self.fatal = err
                self._stop.set()
            else:
                log.warning("router refused Hello (%s); retrying", err)

    def _beat(self) -> None:
        try:
            self._send(Heartbeat(id=0, stats=self._safe_stats()))
        except BusError as err:  # stats that cannot be encoded: the beat goes without them
            log.error("heartbeat stats not sent: %s", err)
            self._send(Heartbeat(id=0, stats={}))

    def _send_queued(self) -> None:
        while not self._outgoing.empty():
            msg, fut, deadline = self._outgoing.get_nowait()
            msg.id = self.client.next_id()
            self._pending[msg.id] = (msg, fut, deadline)
            try:
                self._send(msg)
            except BusError as err:  # it cannot be encoded (too large, not JSON): that request fails, not us
                del self._pending[msg.id]
                fut.set_exception(err)

    def _expire(self, now: float) -> None:
        for rid, (msg, fut, deadline) in list(self._pending.items()):
            if now > deadline:
                del self._pending[rid]
                fut.set_exception(PeerTimeout(f"router did not answer {msg.type} in time"))
        # Requests still queued while disconnected also run out.
        if not self.connected.is_set() and not self._outgoing.empty():
            keep = []
            while not self._outgoing.empty():
                item = self._outgoing.get_nowait()
                if now > item[2]:
                    item[1].set_exception(
                        PeerTimeout(f"router {self.client.endpoint} unreachable; {item[0].type} not sent")
                    )
                else:
                    keep.append(item)
            for item in keep:
                self._outgoing.put(item)

    def _safe_stats(self) -> dict[str, object]:
        try:
            return dict(self.stats())
        except Exception:  # noqa: BLE001
            log.exception("stats callback failed")
            return {}

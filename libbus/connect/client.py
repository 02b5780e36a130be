"""The calling side: a DEALER connection to one batchbus service, used by one thread.

:class:`Client` follows the zguide's "lazy pirate" pattern: a request that gets no reply within the
timeout is resent on a fresh socket (after a new ``Hello``), up to ``retries`` times, and then
:class:`PeerTimeout` is raised. ``Error`` replies become the typed exception of their code. A session
the server dropped for idleness (``AUTH_REQUIRED``), or whose token expired (``AUTH_EXPIRED``) when
the identity mints fresh tokens (a callable ``token``), is re-established once, transparently.

Messages the server pushes unsolicited (``Command``, ``Heartbeat``) are kept in :attr:`Client.pushes`.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

import zmq

from libbus.constants import HELLO_TIMEOUT_S, REQUEST_RETRIES, REQUEST_TIMEOUT_S, VERSION
from libbus.errors import AuthExpired, AuthInvalid, AuthRequired, BusError, ConfigError, PeerTimeout, error_from_code
from libbus.security.admission import admit_client
from libbus.security.auth import LEEWAY_S, inspect_token
from libbus.security.curve import CurveKeys, secure_client
from libbus.wire.frames import Request, WrongVersion
from libbus.wire.messages import Error, Goodbye, Heartbeat, Hello, Message, Welcome, decode, request_id_of
from libbus.wire.sockets import SocketLimits, drain_monitor, make_socket, send_message

__all__ = ["Identity", "Client", "connect", "pick_provider"]

#: One of ``Resolved.providers`` (:class:`~libbus.wire.dataset_info.ProviderEntry`), as its reader holds it.
Entry = TypeVar("Entry", bound=Mapping[str, Any])

log = logging.getLogger(__name__)

#: How long a closing client's Goodbye may wait to leave (the process may exit right after).
GOODBYE_LINGER_MS = 200

R = TypeVar("R", bound=Message)

#: The router's Welcome nonce per (endpoint, role, name): this process's proof, in its next Hello,
#: that it is the one holding the identity's live session (a restarted process has none).
_NONCES: dict[tuple[str, str, str], str] = {}


def remember_nonce(endpoint: str, identity: Identity, nonce: str) -> None:
    if nonce:
        _NONCES[(endpoint, identity.role, identity.name)] = nonce


@dataclass
class Identity:
    """Who a client says it is in ``Hello``. ``token`` may be a callable returning a fresh token.

    ``curve`` is the client's CURVE key pair when the cluster runs CURVE (its name must be the
    token's subject); ``router_key`` then is the router's public key."""

    role: str
    name: str
    token: str | Callable[[], str]
    host_id: str = ""
    caps: dict = field(default_factory=dict)
    curve: CurveKeys | None = None
    router_key: bytes | None = None
    #: Without CURVE: present the token in the connection's PLAIN handshake (libbus/security/admission.py),
    #: as every batchbus server requires unless its ``handshake_auth`` is off.
    handshake: bool = True

    def current_token(self) -> str:
        return self.token() if callable(self.token) else self.token

    def hello(self, request_id: int, token: str | None = None, endpoint: str = "") -> Hello:
        token = token or self.current_token()
        return Hello(
            id=request_id,
            role=self.role,
            name=self.name,
            token=token,
            host_id=self.host_id,
            pid=os.getpid(),
            version=VERSION,
            caps=dict(self.caps),
            nonce=_NONCES.get((endpoint, self.role, self.name), ""),
        )


class Client:
    """A synchronous request/reply connection. Not thread-safe: one thread owns it."""

    def __init__(
        self,
        endpoint: str,
        identity: Identity,
        *,
        ctx: zmq.Context | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
        retries: int = REQUEST_RETRIES,
        limits: SocketLimits = SocketLimits(),
        server_key: bytes | None = None,
    ):
        """``server_key``: the server's CURVE public key (with ``identity.curve``); a provider's
        comes from ``Resolved``, the router's is ``identity.router_key``."""
        if identity.curve is not None and not server_key:
            raise ConfigError(f"CURVE is on but the public key of {endpoint} is unknown")
        self.endpoint = endpoint
        self.server_key = server_key
        self.identity = identity
        self.ctx = ctx or zmq.Context.instance()
        self.timeout_s = timeout_s
        self.retries = retries
        self.limits = limits
        self.session: str | None = None
        self.heartbeat_ms = 0
        self.pushes: deque[Message] = deque(maxlen=1000)
        self.last_recv = 0.0
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._socket_token: str | None = None
        self._presented = ""  # the token of this socket's handshake (to say why it was refused)
        self._next_id = 0
        self._poller = zmq.Poller()

    # -- connection ---------------------------------------------------------------------------
    @property
    def socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = make_socket(self.ctx, zmq.DEALER, self.limits)
            if self.identity.curve is not None and self.server_key is not None:  # __init__ refuses curve without it
                secure_client(self._sock, self.identity.curve, self.server_key)
            elif self.identity.handshake:
                try:
                    # minted once for the handshake and the socket's first Hello
                    self._socket_token = self._presented = self.identity.current_token()
                    admit_client(self._sock, self._socket_token)
                except BaseException:
                    self._sock.close(0)
                    self._sock = None
                    raise
            # A handshake the server refuses (its ZAP handler: a token or key it does not accept)
            # never produces a reply; its monitor event is how the client can say why it waits.
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            self._sock.connect(self.endpoint)
            self._poller = zmq.Poller()
            self._poller.register(self._sock, zmq.POLLIN)
        return self._sock

    def next_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def reset(self) -> None:
        """Drop the socket (and anything queued on it); the next call connects afresh."""
        if self._sock is not None:
            self._close_monitor()
            self._sock.close(0)
            self._sock = None
        self.session = None

    def _close_monitor(self) -> None:
        if self._monitor is not None:
            try:
                if self._sock is not None:
                    self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._monitor = None

    def _check_refused(self) -> bool:
        """Raise :class:`AuthExpired` (our token had expired) or :class:`AuthInvalid` when the server
        refused our handshake (returns False otherwise)."""
        if not self.handshake_refused():
            return False
        expired = self.handshake_expired()
        self.reset()
        if expired:
            raise AuthExpired(
                f"{self.endpoint} refused this connection at the handshake: its token expired; "
                "issue a new one with 'busctl token issue'"
            )
        raise AuthInvalid(
            f"{self.endpoint} refused this connection at the handshake: it does not accept its "
            + ("CURVE key" if self.identity.curve else "token")
            + " (signed for another cluster or with another key, revoked, or no token at all); "
            "check the token and the cluster's secret or keys"
        )

    def handshake_refused(self) -> bool:
        """Whether the server refused this socket's handshake (token or CURVE key not accepted)."""
        # only a ZAP refusal counts (a monitor replaced by another one reports MONITOR_STOPPED)
        return drain_monitor(self._monitor, zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def close(self) -> None:
        """Say ``Goodbye`` (the service closes our session now rather than when it expires) and
        drop the socket."""
        if self._sock is not None and self.session is not None:
            self._close_monitor()
            try:
                self._sock.setsockopt(zmq.LINGER, GOODBYE_LINGER_MS)
                send_message(self._sock, Goodbye())
            except (zmq.ZMQError, BusError):
                pass
            self._sock.close()
            self._sock = None
        self.reset()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def hello(self, timeout_s: float | None = None) -> Welcome:
        """Open a session; raises the server's auth error, or :class:`PeerTimeout`.

        A socket's handshake carries the token minted when the socket was made, and libzmq presents
        it again on every reconnection: once it has expired the server refuses it there. An identity
        that mints its tokens then says Hello once more, on a fresh socket with a fresh token."""
        try:
            return self._hello(timeout_s)
        except AuthExpired:
            if not callable(self.identity.token):
                raise
            return self._hello(timeout_s)

    def handshake_expired(self) -> bool:
        """Whether this socket's handshake presented a token that has expired (no CURVE)."""
        return self.identity.curve is None and _expired(self._presented)

    def _hello(self, timeout_s: float | None) -> Welcome:
        timeout_s = HELLO_TIMEOUT_S if timeout_s is None else timeout_s
        _ = self.socket
        token, self._socket_token = self._socket_token, None
        hello = self.identity.hello(self.next_id(), token, self.endpoint)
        deadline = time.monotonic() + timeout_s
        reply = None
        try:
            self.send(hello)
        except PeerTimeout:  # no connection to queue on: a refused handshake tears it down
            while time.monotonic() < deadline and not self._check_refused():
                time.sleep(0.05)
        else:
            while True:
                reply = self.wait_for(hello.id, min(0.1, max(0.0, deadline - time.monotonic())))
                if reply is not None or time.monotonic() >= deadline:
                    break
                self._check_refused()
        if reply is None:
            self.reset()
            raise PeerTimeout(
                f"{self.endpoint} did not answer Hello within {timeout_s:.1f} s (is the service running and reachable?)"
            )
        welcome = self.check(reply)
        if not isinstance(welcome, Welcome):
            raise BusError(f"{self.endpoint} answered Hello with {welcome.type}")
        self.session = welcome.session
        self.heartbeat_ms = welcome.heartbeat_ms
        remember_nonce(self.endpoint, self.identity, welcome.nonce)
        return welcome

    # -- low level: for pipelining callers ------------------------------------------------------
    def send(self, msg: Message) -> int:
        """Send ``msg`` (assigning an id if it has none) and return its id."""
        if not msg.id:
            msg.id = self.next_id()
        if not send_message(self.socket, msg):
            raise PeerTimeout(f"{self.endpoint}: send queue full")
        return msg.id

    def recv(self, timeout_s: float) -> Message | None:
        """The next reply (pushes are stored aside), or None when ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        sock = self.socket
        first = True
        while True:
            # The deadline holds even while a peer floods us with pushes or stale replies.
            if not first and time.monotonic() >= deadline:
                return None
            first = False
            try:  # a reply is usually waiting already: take it without a poll
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                left = max(0.0, deadline - time.monotonic())
                if not self._poller.poll(int(left * 1000)):
                    return None
                frames = sock.recv_multipart(copy=False)
            self.last_recv = time.monotonic()
            try:
                msg = decode(frames)
            except WrongVersion as err:  # an older service: its refusal is the answer, not a timeout
                if reply := self._version_refusal(frames, err):
                    return reply
                continue
            except BusError as err:
                log.warning("%s sent a malformed message: %s", self.endpoint, err)
                continue
            if msg.id == 0:
                if not isinstance(msg, Heartbeat):
                    self.pushes.append(msg)
                continue
            return msg

    def _version_refusal(self, frames: list, err: WrongVersion) -> Error | None:
        """The ``Error`` a service of another wire version sent back (an Error reads the same in every
        version), as this client's refusal naming both versions; None for a message with no request id."""
        request_id = request_id_of(frames)
        mismatch = WrongVersion(err.tag, peer=self.endpoint, us="this client")
        log.warning("%s", mismatch)
        if not request_id:
            return None
        return Error(id=request_id, code=mismatch.code, message=str(mismatch))

    def wait_for(self, request_id: int, timeout_s: float) -> Message | None:
        """The reply to ``request_id``; stale replies to earlier attempts are discarded."""
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.recv(deadline - time.monotonic())
            if msg is None or msg.id == request_id:
                return msg
            log.debug("discarding stale reply %s to request %d", msg.type, msg.id)
            if time.monotonic() >= deadline:
                return None

    @staticmethod
    def check(reply: Message) -> Message:
        """Return ``reply``, or raise the typed exception an ``Error`` reply stands for."""
        if isinstance(reply, Error):
            raise error_from_code(reply.code, reply.message)
        return reply

    # -- request/reply ------------------------------------------------------------------------
    @overload
    def request(self, msg: Request[R], *, timeout_s: float | None = None, retries: int | None = None) -> R: ...

    @overload
    def request(self, msg: Message, *, timeout_s: float | None = None, retries: int | None = None) -> Message: ...

    def request(self, msg: Message, *, timeout_s: float | None = None, retries: int | None = None) -> Message:
        """Send ``msg`` and return its reply, resending on a fresh connection after a timeout.

        For the type checker, a :class:`Request` gets its declared reply type (``request(GetJob(...))`` is
        a ``JobInfo``). Raises the typed :class:`BusError` of an ``Error`` reply, or :class:`PeerTimeout`
        after ``retries`` resends went unanswered.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        retries = self.retries if retries is None else retries
        rehello_done = False
        attempt = 0
        while True:
            reply = None
            try:
                if self.session is None:
                    self.hello(timeout_s)
                msg.id = self.next_id()
                self.send(msg)
                reply = self.wait_for(msg.id, timeout_s)
            except PeerTimeout:
                pass
            if reply is None:
                attempt += 1
                if attempt > retries:
                    self.reset()
                    raise PeerTimeout(
                        f"{self.endpoint} did not answer {msg.type} within {timeout_s:.1f} s after {retries} retries"
                    )
                log.warning(
                    "%s: no reply to %s in %.1f s; reconnecting (retry %d of %d)",
                    self.endpoint,
                    msg.type,
                    timeout_s,
                    attempt,
                    retries,
                )
                self.reset()
                continue
            try:
                answer = self.check(reply)
            except (AuthRequired, AuthExpired) as err:
                # The server dropped our idle session, or our token ran out: say Hello again
                # (with a fresh token when the identity mints them), once per request.
                if rehello_done or (isinstance(err, AuthExpired) and not callable(self.identity.token)):
                    raise
                rehello_done = True
                self.session = None
                continue
            return answer  # a Request's reply type, by the protocol (the overloads above say so)


def _expired(token: str) -> bool:
    """Whether ``token`` is past its ``exp`` and the servers' leeway (read unverified: only to say
    why a server refused it; the server decided)."""
    try:
        exp = inspect_token(token)[1].get("exp")
    except AuthInvalid:
        return False
    return isinstance(exp, (int, float)) and exp <= time.time() - LEEWAY_S


def connect(endpoint: str, identity: Identity, **kw) -> Client:
    """A :class:`Client` with its session open (Hello answered)."""
    client = Client(endpoint, identity, **kw)
    try:
        client.hello()
    except BaseException:
        client.close()
        raise
    return client


def pick_provider(providers: list[Entry], local_host: str) -> Entry:
    """Prefer a provider on this host (its batches need not cross the network), else the first."""
    for p in providers:
        if p.get("host_id") == local_host:
            return p
    return providers[0]

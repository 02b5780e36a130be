"""The serving side of every batchbus service: a ROUTER socket, sessions, auth, dispatch.

:class:`Server` is the thin I/O loop; a service's logic is a :class:`Handler` that answers
"given this session and this message, what goes out" and can be tested without a socket.

No connection is admitted before its handshake proved something (:mod:`libbus.security.admission`): a listed
CURVE key, or without CURVE a valid token in the PLAIN handshake. Per connection the first message
must then be ``Hello`` with a valid token; the session is bound to the ZeroMQ routing id, and every
later request is checked against it (expiry, role, revocation, the per-session in-flight cap and rate
limit). With CURVE on, the connection's key name (the ZAP ``User-Id``) must equal the token's subject.
Sessions that heartbeat (``caps.heartbeat``) are dropped after ``heartbeat_liveness`` silent
intervals; other sessions (data-plane loaders) after ``idle_session_s`` — they say ``Hello`` again
transparently; a client that is done says ``Goodbye``. Session bookkeeping and the per-subject cap
are in :mod:`libbus.serve.sessions`; the byte bound on replies a peer has not read (its requests wait,
then are refused) in :mod:`libbus.serve.backlog`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TypedDict, cast

import zmq

from libbus import constants as C
from libbus.constants import POLL_MS
from libbus.errors import AuthExpired, AuthRequired, BadRequest, BusError, Forbidden, Internal, Unavailable
from libbus.security.admission import TokenAuthenticator, admit_server
from libbus.security.curve import KeyAuthenticator, secure_server
from libbus.security.tokencheck import TokenCheck
from libbus.serve.backlog import Backlogs, BacklogStats
from libbus.serve.handler import Handler, ServerConfig
from libbus.serve.sessions import Session, SessionTable, check_labels, frame_property, is_local_peer
from libbus.serve.wakeup import Wakeup
from libbus.wire.messages import Goodbye, Heartbeat, Hello, Message, Welcome, decode, error_reply, request_id_of
from libbus.wire.schema import check_stored
from libbus.wire.sockets import make_socket, send_message, send_tracked

__all__ = ["Session", "Handler", "Server", "ServerConfig", "ServerStats", "is_local_peer"]

log = logging.getLogger(__name__)


class ServerStats(TypedDict):
    """What every server counts (:meth:`Server.stats`): the head of a provider's or the router's
    ``Stats`` row, heartbeats and metrics, which add their handler's own records after it."""

    #: The service's name (``ServerConfig.name``).
    name: str
    #: The endpoint bound ("" before :meth:`Server.bind`).
    endpoint: str
    #: Sessions open now.
    sessions: int
    #: Requests whose reply is being computed off the loop.
    pending: int
    #: Transport counters since the start (``received``, ``sent``, ``error_<CODE>``, ...).
    counters: dict[str, int]
    backlog: BacklogStats


class Server:
    """Runs a :class:`Handler` behind a ROUTER socket until ``stop`` is set.

    Construct, call :meth:`bind` (returns the concrete endpoint, useful with port 0), then :meth:`run`.
    """

    def __init__(self, handler: Handler, config: ServerConfig, ctx: zmq.Context | None = None):
        self.handler = handler
        self.config = config
        # A ZAP handler serves one context; a server with one gets a context of its own so that
        # two services in one process (tests, `busctl demo`) never share or fight over one.
        self._own_ctx = config.curve is not None or config.handshake_auth
        self.ctx = zmq.Context() if self._own_ctx else (ctx or zmq.Context.instance())
        self._auth: KeyAuthenticator | TokenAuthenticator | None = None
        #: Token checks at the handshake and at Hello; ``tokens.revoked``: the ``jti``s refused there
        #: and whose sessions are closed (set from any thread, see :meth:`set_revoked`).
        self.tokens = TokenCheck(
            config.secret, audience=config.audience, issuer=config.issuer or None, algorithm=config.algorithm
        )
        self._revoked_changed = False
        self.table = SessionTable(config.sessions_per_subject)
        self.counters: Counter = Counter()
        self.endpoint = ""
        self._sock: zmq.Socket | None = None
        self._pending: list[tuple[Session, int, Future]] = []
        self._wake = Wakeup()  # set by a deferred reply's Future when done: the loop sends it at once
        self.backlog = Backlogs(config.session_unsent_bytes, config.unsent_wait_s)
        #: Replies this large are tracked until they leave (None: the byte bound is off).
        self._track_min = C.TRACK_MIN_BYTES if config.session_unsent_bytes > 0 else None
        self._last_beat = 0.0
        self._last_expiry = 0.0
        self._held: list[tuple[bytes, Message]] | None = None  # this turn's replies, sent after the flush

    # -- lifecycle ----------------------------------------------------------------------------
    def bind(self) -> str:
        """Bind the ROUTER socket. ``tcp://HOST:0`` picks a free port. Returns the bound endpoint."""
        sock = make_socket(self.ctx, zmq.ROUTER, self.config.limits)
        if self.config.curve is not None:
            try:
                self._auth = KeyAuthenticator(self.ctx, self.config.authorized_dir)
                self._auth.start()
            except BusError:
                sock.close(0)
                raise
            secure_server(sock, self.config.curve)
        elif self.config.handshake_auth:
            self._auth = TokenAuthenticator(self.ctx, self.tokens.handshake)
            self._auth.start()
            admit_server(sock)
        bind = self.config.bind
        try:
            if bind.startswith("tcp://") and (bind.endswith(":0") or bind.endswith(":*")):
                port = sock.bind_to_random_port(bind.rsplit(":", 1)[0])
                self.endpoint = f"{bind.rsplit(':', 1)[0]}:{port}"
            else:
                sock.bind(bind)
                self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as err:
            sock.close(0)
            self._stop_auth()
            raise BusError(f"cannot bind {bind}: {err.strerror}", code="UNAVAILABLE") from err
        self._sock = sock
        return self.endpoint

    @property
    def sessions(self) -> dict[bytes, Session]:
        """Open sessions by routing id (read-only view for tests and stats)."""
        return self.table.by_routing

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def set_revoked(self, jtis: Iterable[str]) -> None:
        """Refuse tokens with these ids from now on and close their sessions (thread-safe: the
        loop applies it on its next turn)."""
        self.tokens.set_revoked(jtis)
        self._revoked_changed = True

    def bind_also(self, endpoint: str) -> str:
        """Bind the same ROUTER socket to a second endpoint (a provider's same-host ``ipc://``).

        Sessions are per connection, whichever endpoint it came through. Returns the bound
        endpoint; raises :class:`BusError` if it cannot be bound.
        """
        sock = self._bound()
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as err:
            raise BusError(f"cannot bind {endpoint}: {err.strerror}", code="UNAVAILABLE") from err
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _bound(self) -> zmq.Socket:
        """The ROUTER socket, bound now if :meth:`bind` has not run yet."""
        if self._sock is None:
            self.bind()
        return cast(zmq.Socket, self._sock)  # bind() set it or raised

    def run(self, stop: threading.Event, on_loop: Callable[[], None] | None = None) -> None:
        """Serve until ``stop`` is set, then drain (:meth:`_drain`) and close every session and the socket.

        ``on_loop`` is called once per turn of the loop (about every poll period, and after every
        burst of messages): a service feeds systemd's watchdog there, so that a loop that is stuck
        stops feeding it.
        """
        sock = self._bound()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake.fd, zmq.POLLIN)
        try:
            while not stop.is_set():
                busy = self._pending or self.backlog.waiting
                timeout = 10 if busy else min(POLL_MS, self.config.heartbeat_ms // 2 or 1)
                events = dict(poller.poll(timeout))
                if self._wake.fd in events:
                    # unset before the turn looks at what is done: a Future done after this sets it
                    # again (cleared whenever it is seen set, so it never keeps the poll from waiting)
                    self._wake.clear()
                if sock in events:
                    self._receive(sock)
                self._turn()
                if on_loop is not None:
                    self._call(on_loop)
            self._drain(sock)
        finally:
            for session in self.table.values():
                self._close_session(session, "service stopping")
            # Replies the drain sent get ``drain_linger_s`` to leave; nothing else is waited for.
            sock.close(int(self.config.drain_linger_s * 1000))
            self._sock = None
            if self._own_ctx and self._auth is not None:
                # the handler answers until the context's last connection is gone (libbus/security/zap.py)
                self._auth.terminate()
                self._auth = None
            else:
                self._stop_auth()
                if self._own_ctx:
                    self.ctx.term()

    def _receive(self, sock: zmq.Socket) -> None:
        self._held = [] if self.handler.group_commit else None  # (others send each reply at once)
        until = time.monotonic() + C.BURST_S  # drain what is queued, bounded: timers run, replies wait little
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._on_frames(frames)
            # Pushes a message caused go out before anything handled after it: a
            # stop Command must not arrive after the reply to the next request.
            self._flush_outbox()
            if time.monotonic() > until:
                break
        self._release()  # the burst's replies leave now, not after the timers

    def _release(self) -> None:
        """The turn's end: the handler makes its replies' effects durable (group commit), then they go out."""
        held, self._held = self._held or [], None
        try:
            self.handler.flush()
        except Exception as err:  # noqa: BLE001 - nothing acknowledged: requests UNAVAILABLE, pushes dropped
            log.exception("%s: flush failed; %d held message(s) withheld", self.config.name, len(held))
            why = Unavailable(f"{self.config.name} could not store this request's effect ({err}); send it again")
            held = [(rid, error_reply(msg.id, why)) for rid, msg in held if msg.id != 0]
        for routing_id, msg in held:
            self._reply(routing_id, msg)

    def _turn(self) -> None:
        """Timers and deferred replies: everything a loop turn does besides receiving."""
        self._held = [] if self.handler.group_commit else None
        self._finish_pending()
        self.backlog.release(time.monotonic(), self._serve_waited)
        if self._revoked_changed:
            self._close_revoked()
        now = time.monotonic()
        self._expire_sessions(now)
        self._heartbeat(now)
        self._call(self.handler.tick, now)
        self._flush_outbox()
        self._release()

    def _drain(self, sock: zmq.Socket) -> None:
        """After ``stop`` (SIGTERM): answer the requests already queued, then give deferred work
        (evaluations, requests awaiting the router's word) up to ``drain_s`` to finish. Requests
        arriving after the stop are left unread: to a client the service is gone, as if killed,
        and its timeout and retry (to a restarted service or a replica) apply. Work still running
        when the time is up is answered UNAVAILABLE, so that no client waits out its timeout."""
        self._receive(sock)
        deadline = time.monotonic() + self.config.drain_s
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.01)
            self._turn()
        if self._pending:
            log.warning(
                "%s: %d request(s) still running after %.1f s of draining; answered UNAVAILABLE",
                self.config.name,
                len(self._pending),
                self.config.drain_s,
            )
        waited = [(s, m.id, None) for s, m in self.backlog.take_all_waiting()]
        for session, request_id, _fut in self._pending + waited:
            self._reply(
                session.routing_id,
                error_reply(
                    request_id,
                    Unavailable(f"{self.config.name} is stopping; this request was given up unfinished: send it again"),
                ),
            )
        self._pending = []

    def _close_revoked(self) -> None:
        self._revoked_changed = False
        for session in self.table.values():
            if session.claims.jti in self.tokens.revoked:
                self._close_session(session, "token revoked")

    # -- receiving ----------------------------------------------------------------------------
    def _on_frames(self, frames: list) -> None:
        self.counters["received"] += 1
        routing_id = frames[0].bytes
        body = frames[1:]
        try:
            msg = decode(body)
        except BusError as err:
            self.counters["malformed"] += 1
            log.debug("malformed message from %r: %s", routing_id, err)
            self._reply(routing_id, error_reply(request_id_of(body) if len(body) > 1 else 0, err))
            return
        if isinstance(msg, Hello):
            self._on_hello(routing_id, msg, body[0])
            return
        session = self.table.get(routing_id)
        if isinstance(msg, Goodbye):
            if session is not None:
                self._close_session(session, "said Goodbye")
            return
        try:
            if session is None:
                raise AuthRequired("no session: send Hello with a token first")
            now = time.monotonic()
            session.last_seen = now
            if session.claims.expired():
                self._close_session(session, "token expired")
                raise AuthExpired("token expired; reconnect with a fresh token")
            if isinstance(msg, Heartbeat):
                if not session.take_stats(msg.stats):
                    self.counters["stats_refused"] += 1
                return
            session.check_limits(now, self.config.session_inflight, self.config.session_rate, self.config.session_burst)
            allowed = self.handler.roles.get(msg.type)
            if allowed is None:
                raise BadRequest(f"{msg.type} is not a request this service ({self.config.name}) serves")
            if session.role not in allowed:
                raise Forbidden(f"{msg.type} needs role {' or '.join(allowed)}; your token's role is {session.role}")
        except BusError as err:
            self._count_error(err)
            self._reply(routing_id, error_reply(msg.id, err))
            return
        if self.backlog.must_wait(routing_id):
            # the peer has not taken its earlier replies: this one waits (libbus/serve/backlog.py)
            session.inflight += 1
            self.backlog.defer(routing_id, session, msg, now)
            return
        self._serve(session, msg)

    def _serve_waited(self, session: Session, msg: Message, refused: BusError | None) -> None:
        """A request that waited for its connection's backlog: serve it now, or refuse it."""
        session.inflight -= 1
        if self.table.get(session.routing_id) is not session:
            return  # its session closed meanwhile
        if refused is not None:
            self._count_error(refused)
            self._reply(session.routing_id, error_reply(msg.id, refused))
            return
        self._serve(session, msg)

    def _serve(self, session: Session, msg: Message) -> None:
        """Hand an admitted request to the handler and send (or defer) what it answers."""
        routing_id = session.routing_id
        try:
            reply = self.handler.handle(session, msg)
        except BusError as err:
            self._count_error(err)
            self._reply(routing_id, error_reply(msg.id, err))
            return
        except Exception as err:  # noqa: BLE001 - a bug must not kill the service
            log.exception("%s failed handling %s", self.config.name, msg.type)
            self.counters["internal"] += 1
            self._reply(routing_id, error_reply(msg.id, Internal(f"{type(err).__name__}: {err}")))
            return
        if isinstance(reply, Future):
            session.inflight += 1
            self.backlog.started(routing_id, getattr(reply, "expected_bytes", 0))
            self._pending.append((session, msg.id, reply))
            reply.add_done_callback(self._wake.set)
        elif reply is not None:
            reply.id = msg.id
            self._reply(routing_id, reply)

    def _on_hello(self, routing_id: bytes, hello: Hello, first_frame) -> None:
        try:
            claims = self.tokens.hello(hello.token)
            if hello.role != claims.role:
                raise Forbidden(f"Hello says role {hello.role!r} but the token grants {claims.role!r}")
            check_stored(hello.caps, "Hello.caps", C.STORED_JSON_DEPTH, C.STORED_JSON_BYTES)
            check_labels(hello)
            user_id = frame_property(first_frame, "User-Id")
            if self.config.curve is not None:
                if not user_id:
                    raise Forbidden(
                        "CURVE is on but this connection has no authenticated key name "
                        "(no ZAP handler answered); refusing"
                    )
                if user_id != claims.sub:
                    raise Forbidden(
                        f"the token's subject {claims.sub!r} does not own this connection's CURVE key {user_id!r}"
                    )
            old = self.table.get(routing_id)
            self.table.check_room(claims, old)
            if old is not None:
                self._close_session(old, "replaced by a new Hello")
            now = time.monotonic()
            session = Session(
                sid=secrets.token_hex(8),
                routing_id=routing_id,
                claims=claims,
                hello=hello,
                opened=time.time(),
                last_seen=now,
                heartbeat=bool(hello.caps.get("heartbeat")),
                user_id=user_id,
                peer=frame_property(first_frame, "Peer-Address"),
                _tokens=float(self.config.session_burst),
                _refilled=now,
            )
            self.handler.on_open(session)
        except BusError as err:
            self._count_error(err)
            log.info("refused Hello from %r (%s): %s", hello.name, hello.role, err)
            self._reply(routing_id, error_reply(hello.id, err))
            return
        self.table.add(session)
        self.counters["sessions_opened"] += 1
        log.info("session %s: %s %s (pid %s)", session.sid, hello.role, hello.name, hello.pid)
        self._reply(
            routing_id,
            Welcome(id=hello.id, session=session.sid, heartbeat_ms=self.config.heartbeat_ms, nonce=session.nonce),
        )

    # -- sending and timers -------------------------------------------------------------------
    def _reply(self, routing_id: bytes, msg: Message) -> None:
        if self._held is not None:  # sent by _release, after the handler's flush
            self._held.append((routing_id, msg))
            return
        sock = cast(zmq.Socket, self._sock)  # replies are sent only from inside run(), socket bound
        try:
            sent, tracker, nbytes = send_tracked(sock, msg, routing_id, self._track_min)
            if tracker is not None:
                self.backlog.track(routing_id, tracker, nbytes)
        except BusError as err:
            # A reply that cannot be encoded (a handler bug, or data a peer smuggled in) becomes
            # an INTERNAL error for that request; the loop serving everyone else goes on.
            log.error("%s: cannot send %s: %s", self.config.name, msg.type, err)
            self.counters["internal"] += 1
            sent = msg.id != 0 and send_message(
                sock, error_reply(msg.id, Internal(f"reply could not be encoded: {err}")), routing_id
            )
        if sent:
            self.counters["sent"] += 1
            self.table.sent(routing_id, time.monotonic())
        else:
            self.counters["send_dropped"] += 1

    def _count_error(self, err: BusError) -> None:
        self.counters[f"error_{err.code}"] += 1

    def _finish_pending(self) -> None:
        if not self._pending:
            return
        still = []
        for session, request_id, fut in self._pending:
            if not fut.done():
                still.append((session, request_id, fut))
                continue
            session.inflight -= 1
            self.backlog.finished(session.routing_id, getattr(fut, "expected_bytes", 0))
            err = fut.exception()
            if err is None:
                reply = fut.result()
                reply.id = request_id
            elif isinstance(err, BusError):
                self._count_error(err)
                reply = error_reply(request_id, err)
            else:
                log.error("%s: deferred work failed", self.config.name, exc_info=err)
                self.counters["internal"] += 1
                reply = error_reply(request_id, Internal(f"{type(err).__name__}: {err}"))
            self._reply(session.routing_id, reply)
        self._pending = still

    def _flush_outbox(self) -> None:
        for sid, msg in self.handler.take_outbox():
            session = self.table.by_sid.get(sid)
            if session is not None:
                self._reply(session.routing_id, msg)

    def _heartbeat(self, now: float) -> None:
        if now - self._last_beat < self.config.heartbeat_ms / 1000:
            return
        self._last_beat = now
        beat = Heartbeat(stats={})
        for session in self.table.beat_due(now, self.config.heartbeat_ms / 1000):
            self._reply(session.routing_id, beat)

    def _expire_sessions(self, now: float) -> None:
        """Close sessions silent past their limit. The scan visits every session, so it runs a
        few times per heartbeat interval, not every turn (a loop turn per message burst): a
        session closes at most a quarter interval after its limit."""
        beat_s = self.config.heartbeat_ms / 1000
        if now - self._last_expiry < min(beat_s, self.config.idle_session_s) / 4:
            return
        self._last_expiry = now
        beat_limit = beat_s * self.config.heartbeat_liveness
        for session in self.table.silent(now, beat_limit, self.config.idle_session_s):
            self._close_session(session, f"silent for {now - session.last_seen:.1f} s")

    def _close_session(self, session: Session, reason: str) -> None:
        if not self.table.remove(session):
            return
        session.inflight -= len(self.backlog.drop_waiting(session.routing_id, session))
        self.counters["sessions_closed"] += 1
        log.info("session %s (%s %s) closed: %s", session.sid, session.role, session.name, reason)
        self._call(self.handler.on_close, session, reason)

    def _call(self, fn: Callable, *args) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - timers and callbacks must not kill the loop
            log.exception("%s: %s failed", self.config.name, getattr(fn, "__name__", fn))

    def stats(self) -> ServerStats:
        """The transport's figures, for heartbeats, ``Stats`` and the metrics; a service's row puts its
        handler's own after them (:class:`ServerStats`)."""
        if isinstance(self._auth, TokenAuthenticator):
            self.counters["handshakes_refused"] = self._auth.refused
        return {
            "name": self.config.name,
            "endpoint": self.endpoint,
            "sessions": len(self.table),
            "pending": len(self._pending),
            "counters": dict(self.counters),
            "backlog": self.backlog.stats(),
        }

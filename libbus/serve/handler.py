"""What a service plugs into :mod:`libbus.serve.server`: its logic, a :class:`Handler` that answers "given
this session and this message, what goes out" with no socket (so it can be tested alone), and its
:class:`ServerConfig` (where it binds, whom it admits, its limits).

Every service registers what it serves one way: a handler method marked with :func:`serves`, naming
the message class it answers and the roles that may send it::

    class RouterHandler(Handler):
        @serves(GetJob, "admin")
        def on_GetJob(self, session: Session, msg: GetJob) -> JobInfo: ...

The class gathers the marks of its methods (those of its mixins too) into :attr:`Handler.roles` (what the
server admits) and :attr:`Handler.routes` (what :meth:`Handler.dispatch` calls)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from libbus import constants as C
from libbus.errors import BadRequest
from libbus.security.auth import ALGORITHM, VerifyKey
from libbus.security.curve import CurveKeys
from libbus.serve.sessions import Session
from libbus.wire.messages import Message
from libbus.wire.sockets import SocketLimits

__all__ = ["Handler", "ServerConfig", "serves"]

F = TypeVar("F", bound=Callable[..., Any])


def serves(msg_type: type[Message], *roles: str) -> Callable[[F], F]:
    """Mark a handler method as the one that answers ``msg_type``, sent by a peer of one of ``roles``.
    The method is called as ``method(session, msg)``."""
    if not msg_type.type:
        raise TypeError(f"{msg_type.__name__} is not a registered message (declare it with @message)")
    if not roles:
        raise TypeError(f"@serves({msg_type.type}) names no role that may send it")

    def mark(method: F) -> F:
        vars(method)["__serves__"] = (msg_type.type, roles)  # read by Handler.__init_subclass__
        return method

    return mark


class Handler:
    """A service's logic. Subclasses mark their methods with :func:`serves`, or set ``roles`` and
    override :meth:`handle`.

    ``roles`` maps a message type to the roles allowed to send it; types not listed are refused.
    :meth:`handle` returns the reply, ``None`` (no reply), or a :class:`Future` resolving to the reply
    (for slow work done off the loop). Raising a :class:`BusError` sends that error to the peer.
    Messages the service wants to push unsolicited go through :meth:`push`.
    """

    roles: ClassVar[dict[str, tuple[str, ...]]] = {}
    #: Message type → the name of the method that answers it (from the :func:`serves` marks).
    routes: ClassVar[dict[str, str]] = {}
    #: True: the server holds the replies and pushes of each burst until :meth:`flush` returns.
    group_commit = False

    def __init_subclass__(cls, **kw: Any):
        super().__init_subclass__(**kw)
        routes: dict[str, str] = {}
        roles: dict[str, tuple[str, ...]] = {}
        for klass in reversed(cls.__mro__):  # a subclass's mark wins over its bases'
            for name, attr in vars(klass).items():
                mark = getattr(attr, "__serves__", None)
                if mark is not None:
                    routes[mark[0]], roles[mark[0]] = name, mark[1]
        if routes:
            cls.routes = {**cls.routes, **routes}
            cls.roles = {**cls.roles, **roles}

    def __init__(self) -> None:
        self._outbox: list[tuple[str, Message]] = []

    def push(self, sid: str, msg: Message) -> None:
        self._outbox.append((sid, msg))

    def take_outbox(self) -> list[tuple[str, Message]]:
        out, self._outbox = self._outbox, []
        return out

    def on_open(self, session: Session) -> None:
        """A session was authenticated; raise a BusError to refuse it."""

    def on_close(self, session: Session, reason: str) -> None:
        """A session ended (dropped by silence, replaced, or the service is stopping)."""

    def handle(self, session: Session, msg: Message) -> Message | Future | None:
        """The reply to ``msg``: by default, what its :func:`serves` method answers."""
        return self.dispatch(session, msg)

    def dispatch(self, session: Session, msg: Message) -> Message | Future | None:
        """Call the method marked to serve ``msg``'s type; BAD_REQUEST when none is."""
        name = self.routes.get(msg.type)
        if name is None:
            raise BadRequest(f"{type(self).__name__} does not serve {msg.type}")
        method: Callable[[Session, Message], Message | Future | None] = getattr(self, name)
        return method(session, msg)

    def tick(self, now: float) -> None:
        """Called about every poll period for timers (leases, housekeeping)."""

    def flush(self) -> None:
        """Make durable what the replies of this burst acknowledge (with :attr:`group_commit`, the server
        holds them until this returns: the router fsyncs its job database here once per burst, not once
        per transition). Raising withholds them: each request is answered UNAVAILABLE instead."""


@dataclass
class ServerConfig:
    """How a server binds and whom it admits. ``secret`` is the token verification key: the HS256
    secret, or the Ed25519 public key when ``algorithm`` is ``EdDSA``; ``issuer`` defaults to
    ``audience``."""

    bind: str
    secret: VerifyKey
    audience: str
    name: str
    heartbeat_ms: int = 1000
    heartbeat_liveness: int = 5
    idle_session_s: float = 300.0
    limits: SocketLimits = SocketLimits()
    algorithm: str = ALGORITHM
    issuer: str = ""
    #: CURVE: this server's key pair and the directory of client keys it admits (None: no CURVE).
    curve: CurveKeys | None = None
    authorized_dir: str = ""
    session_inflight: int = C.SESSION_INFLIGHT
    session_rate: float = C.SESSION_RATE
    session_burst: int = C.SESSION_BURST
    #: On stop: how long deferred work may take to finish, and how long the replies get to leave.
    drain_s: float = C.DRAIN_S
    drain_linger_s: float = C.DRAIN_LINGER_S
    #: Most sessions one token subject may hold open here (0: no cap).
    sessions_per_subject: int = C.SESSIONS_PER_SUBJECT
    #: Most bytes of replies held for a connection that has not read them (0: no cap), and how
    #: long its next request waits for them to drain before it is refused (libbus/serve/backlog.py).
    session_unsent_bytes: int = C.SESSION_UNSENT_BYTES
    unsent_wait_s: float = C.UNSENT_WAIT_S
    #: Without CURVE: admit only connections presenting a valid token in the PLAIN handshake
    #: (libbus/security/admission.py). Off, anyone reaching the port can make the service buffer an
    #: endless multipart message before it reads a Hello.
    handshake_auth: bool = True

"""What a service plugs into :mod:`libbus.serve.server`: its logic, a :class:`Handler` that answers "given
this session and this message, what goes out" with no socket (so it can be tested alone), and its
:class:`ServerConfig` (where it binds, whom it admits, its limits)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from libbus import constants as C
from libbus.security.auth import ALGORITHM, VerifyKey
from libbus.security.curve import CurveKeys
from libbus.serve.sessions import Session
from libbus.wire.messages import Message
from libbus.wire.sockets import SocketLimits

__all__ = ["Handler", "ServerConfig"]


class Handler:
    """A service's logic. Subclasses set ``roles`` and implement :meth:`handle`.

    ``roles`` maps a message type to the roles allowed to send it; types not listed are refused.
    :meth:`handle` returns the reply, ``None`` (no reply), or a :class:`Future` resolving to the reply
    (for slow work done off the loop). Raising a :class:`BusError` sends that error to the peer.
    Messages the service wants to push unsolicited go through :meth:`push`.
    """

    roles: dict[str, tuple[str, ...]] = {}
    #: True: the server holds the replies and pushes of each burst until :meth:`flush` returns.
    group_commit = False

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
        raise NotImplementedError

    def tick(self, now: float) -> None:
        """Called about every poll period for timers (leases, housekeeping)."""

    def flush(self) -> None:
        """Make durable what the replies of this burst acknowledge (with :attr:`group_commit`, the server
        holds them until this returns: the router fsyncs its job database here once per burst, not once
        per transition). Raising withholds them: each request is answered UNAVAILABLE instead."""

    def stats(self) -> dict:
        return {}


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

"""Sessions and their limits: who is connected, under which token, and what each may still do.

Split from :mod:`libbus.serve.server` (the I/O loop) so that the bookkeeping reads in one place:

- a :class:`Session` is one authenticated connection (bound to its ZeroMQ routing id) with its
  request bucket and in-flight count;
- a :class:`SessionTable` indexes them by routing id, by session id and by token subject, and
  refuses a ``Hello`` that would open more than ``per_subject`` sessions for one subject (every
  ``busctl`` call is a session; a script looping on it must not pile them up). Clients close their
  session with ``Goodbye``; silent sessions expire.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict, cast

import zmq

from libbus.constants import SESSIONS_PER_SUBJECT, STORED_JSON_BYTES, STORED_JSON_DEPTH
from libbus.errors import BadRequest, BusError, RateLimited
from libbus.security.auth import Claims
from libbus.wire.dataset_info import SourceInfo
from libbus.wire.messages import Hello
from libbus.wire.schema import check_stored

__all__ = [
    "Session",
    "SessionInfo",
    "SessionTable",
    "is_local_peer",
    "frame_property",
    "check_labels",
    "MAX_LABEL",
    "reader_info",
    "without_host_keys",
]

#: DatasetInfo keys that say where the provider's operator keeps the data (a filesystem path, a
#: source URI holding one): only an unrestricted admin session is shown them, anyone else the rest.
HOST_INFO_KEYS = ("uri", "path", "source_uri")


def reader_info(info: Mapping[str, Any], claims: Claims) -> SourceInfo:
    """A dataset's ``info`` as ``claims`` may see it: an unrestricted admin's (the operator's) whole;
    anyone else's, a tenant's admin scoped to its datasets or jobs included, without
    :data:`HOST_INFO_KEYS`, at any depth (the name, shapes, dtypes, counts and layout are what a reader needs)."""
    # a provider's own source's, or the one its Hello gave the router: as it sent it
    return cast(SourceInfo, info if claims.role == "admin" and not claims.scopes else without_host_keys(info))


def without_host_keys(value):
    """``value`` with :data:`HOST_INFO_KEYS` dropped at any depth (a weighted dataset's ``sources``
    name each member's URI)."""
    if isinstance(value, dict):
        return {k: without_host_keys(v) for k, v in value.items() if k not in HOST_INFO_KEYS}
    if isinstance(value, list):
        return [without_host_keys(v) for v in value]
    return value


#: Longest ``Hello.name``, ``host_id`` or ``version``: stored with the session and echoed to admins.
MAX_LABEL = 128


class SessionInfo(TypedDict):
    """A session as an admin sees it (:meth:`Session.describe`, a row of ``ListPeers``)."""

    session: str
    #: The peer's label (``Hello.name``).
    name: str
    #: The token's subject.
    subject: str
    role: str
    #: The role, or ``"loader"`` (:attr:`Session.kind`).
    kind: str
    host_id: str
    pid: int
    version: str
    #: When the session opened (epoch seconds).
    since: float
    #: ZeroMQ's ``Peer-Address``.
    peer: str
    #: The key name the connection authenticated with.
    key: str
    #: When the peer was last heard (epoch seconds).
    last_seen: float


@dataclass
class Session:
    """One authenticated peer connection."""

    sid: str
    routing_id: bytes
    claims: Claims
    hello: Hello
    opened: float
    last_seen: float
    heartbeat: bool
    stats: dict = field(default_factory=dict)
    #: The key name the connection authenticated with at the handshake: the CURVE key's name, or
    #: the subject of the token presented in the PLAIN handshake ("" when neither ran).
    user_id: str = ""
    #: ZeroMQ's ``Peer-Address``: the peer's IP over TCP; over ``ipc://`` the peer's credentials.
    peer: str = ""
    #: Requests of this session being worked on (deferred replies not yet sent).
    inflight: int = 0
    #: When the server last sent this session anything (monotonic): a heartbeat is then not needed.
    last_sent: float = 0.0
    #: Sent in the Welcome; a handler may set it to a live session's of the same identity (the
    #: router: the nonce a trainer's or provider's process must present to open another session).
    nonce: str = field(default_factory=lambda: secrets.token_hex(16))
    _tokens: float = 0.0
    _refilled: float = 0.0

    @property
    def local(self) -> bool:
        """Whether the peer came through a Unix socket as this service's own user: only such a
        peer may hand this service a shared-memory ring."""
        return is_local_peer(self.peer)

    def admit(self, now: float, rate: float, burst: int) -> bool:
        """Take one token from the session's bucket (``rate`` per second, at most ``burst``)."""
        if rate <= 0:
            return True
        self._tokens = min(float(burst), self._tokens + (now - self._refilled) * rate)
        self._refilled = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def check_limits(self, now: float, inflight: int, rate: float, burst: int) -> None:
        """Refuse (:class:`RateLimited`) a request past the in-flight cap or the rate."""
        if self.inflight >= inflight:
            raise RateLimited(
                f"{self.inflight} requests of this session are in flight; at most "
                f"{inflight}: wait for replies before sending more"
            )
        if not self.admit(now, rate, burst):
            raise RateLimited(f"more than {rate:g} requests/s (burst {burst}) from this session; slow down")

    def take_stats(self, stats: dict) -> bool:
        """Keep a heartbeat's ``stats`` if within the stored-JSON bounds; else keep why not (they
        would break every StatsReply that carries them) and return False."""
        try:
            check_stored(stats, "Heartbeat.stats", STORED_JSON_DEPTH, STORED_JSON_BYTES)
        except BusError as err:
            self.stats = {"refused": str(err)}
            return False
        self.stats = stats
        return True

    @property
    def role(self) -> str:
        return self.claims.role

    @property
    def subject(self) -> str:
        """The verified identity: the token's ``sub`` (under CURVE also the key's name)."""
        return self.claims.sub

    @property
    def name(self) -> str:
        """The peer's label (``Hello.name``): shown to operators, never used to decide anything."""
        return self.hello.name

    @property
    def loader(self) -> bool:
        """A data-plane loader (a reader or trainer token's ``RemoteLoader``, ``Hello.caps.loader``): it
        only reads data, so the ranks of one script, or several scripts, may hold one subject at once."""
        return self.claims.role in ("trainer", "reader") and self.hello.caps.get("loader") is True

    @property
    def kind(self) -> str:
        """What the session is for: its role, or ``"loader"`` for a loader's reader- or trainer-token session
        (a trainer *service* is what takes jobs, leases and commands; a loader is not)."""
        return "loader" if self.loader else self.claims.role

    @property
    def process(self) -> tuple[str, int]:
        """``(host_id, pid)`` the peer reported: tells a reconnecting process from another one."""
        return self.hello.host_id, self.hello.pid

    def describe(self) -> SessionInfo:
        """The session as ``ListPeers`` shows it to an admin."""
        return {
            "session": self.sid,
            "name": self.name,
            "subject": self.subject,
            "role": self.role,
            "kind": self.kind,
            "host_id": self.hello.host_id,
            "pid": self.hello.pid,
            "version": self.hello.version,
            "since": self.opened,
            "peer": self.peer,
            "key": self.user_id,
            "last_seen": time.time() - (time.monotonic() - self.last_seen),
        }


def is_local_peer(peer: str) -> bool:
    """True for a ``Peer-Address`` of an ``ipc://`` connection from this process's uid.

    Over TCP libzmq reports the peer's IP; over a Unix socket it reports ``host:uid:gid:pid`` from
    ``SO_PEERCRED``."""
    if not peer:
        return False
    try:
        ipaddress.ip_address(peer.split("%", 1)[0])
        return False
    except ValueError:
        pass
    parts = peer.rsplit(":", 3)
    return len(parts) == 4 and parts[1].isdigit() and int(parts[1]) == os.getuid()


def check_labels(hello: Hello) -> None:
    """Refuse (:class:`BadRequest`) a Hello whose labels are too long or not printable: they are
    stored with the session and echoed in every ``ListPeers``."""
    for field_name in ("name", "host_id", "version"):
        value = getattr(hello, field_name)
        if len(value) > MAX_LABEL or not value.isprintable():
            raise BadRequest(
                f"Hello.{field_name} must be at most {MAX_LABEL} printable characters, got {len(value)}: {value[:40]!r}"
            )


def frame_property(frame, name: str) -> str:
    """A ZeroMQ message property (``User-Id``, ``Peer-Address``), or "" when it is not set."""
    try:
        value = frame.get(name)
    except (zmq.ZMQError, AttributeError):
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value or "")


class SessionTable:
    """The open sessions of one server, indexed three ways, with the per-subject cap."""

    def __init__(self, per_subject: int = SESSIONS_PER_SUBJECT):
        self.per_subject = per_subject
        self.by_routing: dict[bytes, Session] = {}
        self.by_sid: dict[str, Session] = {}
        self._subjects: Counter = Counter()

    def __len__(self) -> int:
        return len(self.by_routing)

    def get(self, routing_id: bytes) -> Session | None:
        return self.by_routing.get(routing_id)

    def values(self) -> list[Session]:
        return list(self.by_routing.values())

    def check_room(self, claims: Claims, replacing: Session | None) -> None:
        """Refuse (:class:`RateLimited`) a new session of a subject that has ``per_subject`` open."""
        if self.per_subject <= 0:
            return
        held = self._subjects[claims.sub] - (replacing is not None and replacing.subject == claims.sub)
        if held >= self.per_subject:
            raise RateLimited(
                f"{claims.sub!r} already has {held} sessions open here; at most "
                f"{self.per_subject} (sessions_per_subject): close clients when done "
                "(Client.close() says Goodbye), or wait for idle ones to expire"
            )

    def add(self, session: Session) -> None:
        self.by_routing[session.routing_id] = session
        self.by_sid[session.sid] = session
        self._subjects[session.subject] += 1

    def sent(self, routing_id: bytes, now: float) -> None:
        """Something went to this connection at ``now`` (a heartbeat can wait an interval)."""
        session = self.by_routing.get(routing_id)
        if session is not None:
            session.last_sent = now

    def remove(self, session: Session) -> bool:
        """Forget ``session``; False when it was not open (closed twice)."""
        if self.by_routing.get(session.routing_id) is not session:
            return False
        del self.by_routing[session.routing_id]
        self.by_sid.pop(session.sid, None)
        self._subjects[session.subject] -= 1
        if self._subjects[session.subject] <= 0:
            del self._subjects[session.subject]
        return True

    def beat_due(self, now: float, interval: float) -> list[Session]:
        """Heartbeat sessions sent nothing for ``interval``: a peer takes any message as a sign of
        life (libbus/connect/link.py ``last_recv``), so one that had a reply or a push needs no beat."""
        return [s for s in self.by_routing.values() if s.heartbeat and now - s.last_sent >= interval]

    def silent(self, now: float, beat_limit: float, idle_limit: float) -> list[Session]:
        """Sessions silent past their limit: heartbeat sessions ``beat_limit``, others ``idle_limit``."""
        return [s for s in self.by_routing.values() if now - s.last_seen > (beat_limit if s.heartbeat else idle_limit)]

    def of_subject(self, sub: str) -> int:
        return self._subjects.get(sub, 0)

"""Messages of sessions and of the control around them: a session's handshake, heartbeats and goodbyes,
errors and plain acknowledgements, stats and peers, token revocation and a provider's entitlements. Each
is declared with :func:`~libbus.wire.frames.message` (which registers it) and, when it is a request, names
its reply as its base; import them from :mod:`libbus.wire.messages`.
"""

from __future__ import annotations

from dataclasses import field

from libbus.errors import BusError
from libbus.wire.frames import Message, Request, WrongVersion, message

__all__ = [
    "error_reply",
    "Hello",
    "Welcome",
    "Heartbeat",
    "Error",
    "Ok",
    "Stats",
    "StatsReply",
    "ListPeers",
    "PeerList",
    "RevokeToken",
    "ListRevoked",
    "RevokedList",
    "Entitlements",
    "Goodbye",
]


# -- session -------------------------------------------------------------------------------------


@message
class Hello(Request["Welcome"]):
    """First message on every connection: who I am, and the token that proves it."""

    role: str
    name: str
    token: str
    host_id: str = ""
    pid: int = 0
    version: str = ""
    caps: dict = field(default_factory=dict)
    #: The ``nonce`` of a Welcome this process was given before: proves that a second session of a
    #: trainer's or provider's subject is the process holding the first (host_id and pid only say so).
    nonce: str = ""


@message
class Welcome(Message):
    session: str
    heartbeat_ms: int
    #: A secret of the identity's live sessions: the process presents it in its next Hello.
    nonce: str = ""


@message
class Heartbeat(Message):
    """Both ways, every heartbeat interval. Services carry their queue metrics in ``stats``."""

    stats: dict = field(default_factory=dict)


@message
class Goodbye(Message):
    """Client → any service, no reply: the client is done; the service closes its session now
    instead of keeping it until it expires."""


@message
class Error(Message):
    code: str
    message: str


@message
class Ok(Message):
    """A plain acknowledgement."""

    detail: dict = field(default_factory=dict)


def error_reply(request_id: int, err: BusError) -> Error:
    """The Error for ``err``; refusing a peer of another wire version, sent under that peer's tag,
    so that it can read the refusal (an Error has the same form in every version)."""
    reply = Error(id=request_id, code=err.code, message=str(err))
    if isinstance(err, WrongVersion):
        reply.wire_tag = err.tag  # type: ignore[misc]  # this one reply goes out under the peer's tag
    return reply


# -- stats and peers -------------------------------------------------------------------------


@message
class Stats(Request["StatsReply"]):
    pass


@message
class StatsReply(Message):
    services: dict


@message
class ListPeers(Request["PeerList"]):
    pass


@message
class PeerList(Message):
    peers: list


# -- security ------------------------------------------------------------------------------


@message
class RevokeToken(Request[Ok]):
    """Admin → router: refuse the token ``jti`` on every service until ``exp`` (its own expiry,
    after which it is dead anyway). Answered with ``Ok``."""

    jti: str
    exp: float
    reason: str = ""


@message
class ListRevoked(Request["RevokedList"]):
    pass


@message
class RevokedList(Message):
    """``revoked``: ``[{jti, exp, at, reason}]``, newest first."""

    revoked: list


@message
class Entitlements(Message):
    """Router → provider, unsolicited, when the provider connects and whenever either part changes:
    the revoked ``jti``s still unexpired (``None``: unchanged since the last push on this session,
    so an assignment change does not resend the whole list), and per dataset the token subjects of
    the trainers assigned to a running job on it (``{dataset: [sub, ...]}``)."""

    revoked: list | None
    assigned: dict

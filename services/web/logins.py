"""Who is signed in to ``busctl web``: each browser that gave a token the router accepted holds a random
session id (in an HttpOnly cookie); the token and the router connection opened with it stay here.

The router checks the token on that connection (expiry and revocation included) and cuts every answer to
its scopes, so a tenant sees in the browser exactly what ``busctl`` with the same token shows. Nothing
here verifies a token: what a token claims (subject, expiry) is read only to label the page.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import jwt

from libbus.connect.client import Client
from libbus.errors import AuthExpired, AuthInvalid, AuthRequired

if TYPE_CHECKING:
    from services.views import Snapshot

__all__ = ["MAX_SESSIONS", "MAX_TOKEN_CHARS", "IDLE_S", "Login", "Logins", "NotSignedIn", "token_claims"]

#: Signed-in browsers kept at once; the longest idle is signed out first (each holds a router session).
MAX_SESSIONS = 32
#: A browser idle this long is signed out (its router connection closed).
IDLE_S = 8 * 3600.0
#: The longest token accepted from the form (a batchbus token is a few hundred characters).
MAX_TOKEN_CHARS = 8192

T = TypeVar("T")


class NotSignedIn(Exception):
    """The browser has no session here (none, unknown, idle too long, or its token no longer accepted);
    its text says which, for the sign-in page."""


def token_claims(token: str) -> dict[str, Any]:
    """What ``token`` says of itself (subject, role, expiry, scopes), unverified: the router verifies it.

    Raises:
        ValueError: not a JSON Web Token at all, said in words for the login page.
    """
    if not token or len(token) > MAX_TOKEN_CHARS or not token.isascii() or token.count(".") != 2:
        raise ValueError("that is not a batchbus token (three dot-separated parts, as 'busctl token issue' prints)")
    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError as err:
        raise ValueError(f"that is not a batchbus token: {err}") from None
    return claims if isinstance(claims, dict) else {}


@dataclass
class Login:
    """One signed-in browser: its router connection (one request at a time) and what it showed last."""

    client: Client
    claims: dict[str, Any]
    last_used: float = field(default_factory=time.monotonic)
    #: ``busctl top``'s previous snapshot, for the rates of the next one (samples/s).
    previous: Snapshot | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(client, *args)`` on this browser's connection; a refused token signs it out."""
        with self.lock:
            self.last_used = time.monotonic()
            try:
                return fn(self.client, *args)
            except (AuthInvalid, AuthExpired, AuthRequired):
                self.client.reset()
                raise

    def close(self) -> None:
        with self.lock:
            self.client.close()

    def summary(self) -> dict[str, Any]:
        """What the page says of who is signed in: subject, role, expiry, scopes."""
        c = self.claims
        return {k: c.get(k) for k in ("sub", "role", "exp", "datasets", "jobs") if c.get(k) is not None}


class Logins:
    """Session id → :class:`Login`, bounded (:data:`MAX_SESSIONS`, :data:`IDLE_S`).

    ``connect(token)`` makes the (unconnected) router client for a token."""

    def __init__(self, connect: Callable[[str], Client], max_sessions: int = MAX_SESSIONS, idle_s: float = IDLE_S):
        self._connect = connect
        self._max = max_sessions
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._by_id: OrderedDict[str, Login] = OrderedDict()
        #: Why recently ended sessions ended (the sign-in page says it), the newest MAX_SESSIONS.
        self._ended: OrderedDict[str, str] = OrderedDict()

    def sign_in(self, token: str) -> str:
        """Open a router session with ``token`` and return a new session id for the browser.

        Raises:
            ValueError: not a token at all.
            BusError: the router's refusal (``AuthInvalid``, ``AuthExpired``, ``Forbidden`` for a
                token of another role) or its silence (``PeerTimeout``).
        """
        claims = token_claims(token.strip())
        client = self._connect(token.strip())
        try:
            client.hello()
        except BaseException:
            client.close()
            raise
        login = Login(client, claims)
        sid = secrets.token_urlsafe(32)
        evicted = []
        with self._lock:
            self._by_id[sid] = login
            while len(self._by_id) > self._max:
                old_sid, old = self._by_id.popitem(last=False)
                self._ended_because(old_sid, f"signed out: more than {self._max} browsers signed in here")
                evicted.append(old)
        for old in evicted:
            old.close()
        return sid

    def get(self, sid: str | None) -> Login:
        """The browser's login. Raises :class:`NotSignedIn` saying why there is none."""
        with self._lock:
            login = self._by_id.get(sid or "")
            if login is None:
                raise NotSignedIn(self._ended.get(sid or "", "not signed in"))
            if time.monotonic() - login.last_used <= self._idle_s:
                self._by_id.move_to_end(sid or "")
                return login
            del self._by_id[sid or ""]
            self._ended_because(sid or "", f"signed out after {self._idle_s / 3600:g} h idle")
        login.close()
        raise NotSignedIn(self._ended[sid or ""])

    def sign_out(self, sid: str | None, reason: str = "signed out") -> None:
        """End the browser's session (its router session says Goodbye); ``reason`` is what its next page says."""
        with self._lock:
            login = self._by_id.pop(sid or "", None)
            if login is not None:
                self._ended_because(sid or "", reason)
        if login is not None:
            login.close()

    def _ended_because(self, sid: str, reason: str) -> None:
        self._ended[sid] = reason
        while len(self._ended) > self._max:
            self._ended.popitem(last=False)

    def close(self) -> None:
        """Sign everyone out (the server stops): each router session says Goodbye."""
        with self._lock:
            logins = list(self._by_id.values())
            self._by_id.clear()
        for login in logins:
            login.close()

    def __len__(self) -> int:
        return len(self._by_id)

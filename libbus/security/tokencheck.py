"""A server's token checks, with each token's signature verified once.

A connection presents its token twice: in the PLAIN handshake (the ZAP thread, membership only) and
in ``Hello`` (times too). Each PyJWT verification costs about 0.1 ms; at a thousand trainers starting
at once that doubled the router's work per connection. :class:`TokenCheck` keeps the claims of the
tokens it verified, keyed by the token's exact text, so the second check (and every reconnection
with the same token) is a look-up plus the checks that depend on the time (``exp``, ``nbf``) and on
revocation, which run at every call.

Expiry is checked at both: a token past its ``exp`` (plus :data:`~libbus.security.auth.LEEWAY_S` of
clock skew) proves nothing, so the handshake refuses it before libzmq reads a frame from that
connection. A revoked token leaves the revocation list once it expires (nothing else would bound the
list), so this is also what keeps a revoked token out after that. Only accepted tokens are kept: a forged or altered token is
verified (and refused) every time, as before, and cannot reach a kept entry without being that
exact text. At most :data:`KEEP` tokens are kept, the oldest forgotten first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from libbus.errors import AuthExpired, AuthInvalid
from libbus.security.auth import LEEWAY_S, Claims, VerifyKey, verify_token

__all__ = ["KEEP", "TokenCheck"]

#: Verified tokens kept (about 1 KiB each).
KEEP = 8192


class TokenCheck:
    """Checks tokens against one server's key, audience, issuer and revocations (thread-safe:
    the ZAP thread and the service loop both call it)."""

    def __init__(self, key: VerifyKey, *, audience: str, issuer: str | None, algorithm: str, keep: int = KEEP):
        self._key, self._audience, self._issuer, self._algorithm = key, audience, issuer, algorithm
        self._keep = keep
        self._verified: dict[str, Claims] = {}  # token → its claims
        self._lock = threading.Lock()
        #: ``jti``s refused from now on (replaced whole, so readers need no lock).
        self.revoked: frozenset[str] = frozenset()
        #: Tokens verified and kept: one verification per token, not one per check (a refused token
        #: is verified again at every try and not counted).
        self.verifications = 0

    @property
    def kept(self) -> int:
        """Tokens kept now."""
        return len(self._verified)

    def set_revoked(self, jtis: Iterable[str]) -> None:
        self.revoked = frozenset(jtis)

    def hello(self, token: str) -> Claims:
        """The claims of a token acceptable now (at ``Hello``): signed by this cluster, for it,
        within its times and not revoked; else :class:`AuthExpired` or :class:`AuthInvalid`."""
        claims = self._claims(token)
        now = time.time()
        _check_expiry(claims, now)
        if claims.nbf is not None and claims.nbf > now + LEEWAY_S:
            raise AuthInvalid(
                f"token is not valid yet (its nbf is {claims.nbf - now:.0f} s ahead of this node's clock); "
                "check the clocks of issuer and node"
            )
        self._check_revoked(claims)
        return claims

    def handshake(self, token: str) -> str:
        """The handshake's check: a token this cluster signed, not expired (the same
        :data:`LEEWAY_S` as ``Hello``) and not revoked. ``nbf`` is left to ``Hello`` (a token not
        yet valid still proves membership, and its Hello says which clock is off). A client
        renews its token on the ``AUTH_EXPIRED`` of a request or a ``Hello`` over its open
        connection, which this check never sees again. Returns the subject."""
        claims = self._claims(token)
        _check_expiry(claims, time.time())
        self._check_revoked(claims)
        return claims.sub

    def _check_revoked(self, claims: Claims) -> None:
        if claims.jti in self.revoked:
            raise AuthInvalid(f"token {claims.jti} has been revoked; ask for a new one")

    def _claims(self, token: str) -> Claims:
        kept = self._verified.get(token)
        if kept is not None:
            return kept
        claims = verify_token(
            token,
            self._key,
            audience=self._audience,
            issuer=self._issuer,
            algorithm=self._algorithm,
            check_times=False,
        )
        with self._lock:
            self.verifications += 1
            while len(self._verified) >= self._keep:
                del self._verified[next(iter(self._verified))]
            self._verified[token] = claims
        return claims


def _check_expiry(claims: Claims, now: float) -> None:
    """Refuse (:class:`AuthExpired`) a token past ``exp`` + :data:`LEEWAY_S` (verify_token's rule,
    PyJWT's, and its message)."""
    if claims.exp <= now - LEEWAY_S:
        raise AuthExpired("token expired; issue a new one with 'busctl token issue'")

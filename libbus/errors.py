"""One exception tree for batchbus, shared by both ends of the wire.

A service turns a :class:`BusError` into an ``Error{code, message}`` reply; the client turns that reply
back into the same class with :func:`error_from_code`. Local failures (timeouts, config, datasets,
shared memory) are :class:`BusError` subclasses too, so callers can catch one root.
"""

from __future__ import annotations

# The root and the shared-memory error live in shm, the lowest layer that raises them.
from shm.errors import BusError, ShmError

__all__ = [
    "BusError",
    "AuthRequired",
    "AuthInvalid",
    "AuthExpired",
    "Forbidden",
    "NotFound",
    "BadRequest",
    "OutOfRange",
    "SplitPrivate",
    "TooLarge",
    "RateLimited",
    "Unavailable",
    "Timeout",
    "Internal",
    "PeerTimeout",
    "ConfigError",
    "DatasetError",
    "ShmError",
    "ERROR_CODES",
    "error_from_code",
]


class AuthRequired(BusError):
    """No session: the peer must send ``Hello`` with a token first."""

    code = "AUTH_REQUIRED"


class AuthInvalid(BusError):
    """The token is malformed, badly signed, or for another cluster."""

    code = "AUTH_INVALID"


class AuthExpired(BusError):
    """The token's ``exp`` has passed; get a new token and say ``Hello`` again."""

    code = "AUTH_EXPIRED"


class Forbidden(BusError):
    """The token is valid but its role or scope does not allow this request."""

    code = "FORBIDDEN"


class NotFound(BusError):
    """A named thing (dataset, job, peer) does not exist."""

    code = "NOT_FOUND"


class BadRequest(BusError):
    """The message is malformed: bad frames, bad JSON, unknown type, missing or mistyped fields."""

    code = "BAD_REQUEST"


class OutOfRange(BusError):
    """A sample index lies outside the split."""

    code = "OUT_OF_RANGE"


class SplitPrivate(BusError):
    """The split (the test split) never leaves the provider."""

    code = "SPLIT_PRIVATE"


class TooLarge(BusError):
    """The request or message exceeds a configured limit."""

    code = "TOO_LARGE"


class RateLimited(BusError):
    """The session has too many requests in flight, or sends faster than its rate limit; slow down
    and resend."""

    code = "RATE_LIMITED"


class Unavailable(BusError):
    """Nobody can serve this right now (no provider for a dataset, service shutting down)."""

    code = "UNAVAILABLE"


class Timeout(BusError, TimeoutError):
    """A server-side wait ran out."""

    code = "TIMEOUT"


class Internal(BusError):
    """A bug on the serving side; its log has the traceback."""

    code = "INTERNAL"


class PeerTimeout(BusError, TimeoutError):
    """A peer did not answer within the timeout, after all retries (local, never on the wire)."""

    code = "TIMEOUT"


class ConfigError(BusError):
    """Settings are missing or invalid (file, environment, flags)."""

    code = "BAD_REQUEST"


class DatasetError(BusError):
    """A dataset URI or its data is wrong."""

    code = "BAD_REQUEST"


ERROR_CODES: dict[str, type[BusError]] = {
    cls.code: cls
    for cls in (
        AuthRequired,
        AuthInvalid,
        AuthExpired,
        Forbidden,
        NotFound,
        BadRequest,
        OutOfRange,
        SplitPrivate,
        TooLarge,
        RateLimited,
        Unavailable,
        Timeout,
        Internal,
    )
}


def error_from_code(code: str, message: str) -> BusError:
    """Rebuild the typed exception for a wire ``Error`` reply (unknown codes become :class:`BusError`)."""
    cls = ERROR_CODES.get(code)
    if cls is None:
        return BusError(message, code=code)
    return cls(message)

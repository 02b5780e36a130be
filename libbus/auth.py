"""JWT tokens (PyJWT, HS256 with a shared secret file) and the roles they grant.

Claims: ``sub`` (who), ``role`` (provider | trainer | admin), ``aud`` (the cluster), ``iat``, ``exp``,
``jti``; optional ``datasets``/``jobs`` scopes. The algorithm is pinned on verification, so a token
signed with ``none`` or another algorithm is refused.
"""

from __future__ import annotations

import os
import secrets
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import jwt

from .errors import AuthExpired, AuthInvalid, ConfigError

__all__ = ["ROLES", "Claims", "issue_token", "verify_token", "load_secret", "ensure_secret"]

ROLES = ("provider", "trainer", "admin")
ALGORITHM = "HS256"
#: Clock skew tolerated between nodes when checking ``exp``/``iat``.
LEEWAY_S = 5


@dataclass(frozen=True)
class Claims:
    sub: str
    role: str
    aud: str
    exp: float
    iat: float
    jti: str
    scopes: dict = field(default_factory=dict)

    def expired(self, now: float | None = None) -> bool:
        return (now if now is not None else time.time()) > self.exp + LEEWAY_S


def issue_token(secret: bytes, *, sub: str, role: str, audience: str, ttl_s: float = 3600.0,
                datasets: list[str] | None = None, jobs: list[str] | None = None) -> str:
    """Mint a signed token. Raises :class:`ConfigError` for an unknown role or a non-positive ttl."""
    if role not in ROLES:
        raise ConfigError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    if ttl_s <= 0:
        raise ConfigError(f"token ttl must be positive, got {ttl_s}")
    now = int(time.time())
    claims = {"sub": sub, "role": role, "aud": audience, "iat": now, "exp": now + int(ttl_s),
              "jti": uuid.uuid4().hex}
    if datasets is not None:
        claims["datasets"] = list(datasets)
    if jobs is not None:
        claims["jobs"] = list(jobs)
    return jwt.encode(claims, secret, algorithm=ALGORITHM)


def verify_token(token: str, secret: bytes, *, audience: str) -> Claims:
    """Check signature, audience and expiry. Raises :class:`AuthExpired` or :class:`AuthInvalid`."""
    try:
        raw = jwt.decode(token, secret, algorithms=[ALGORITHM], audience=audience, leeway=LEEWAY_S,
                         options={"require": ["sub", "role", "aud", "exp", "iat", "jti"]})
    except jwt.ExpiredSignatureError as err:
        raise AuthExpired("token expired; issue a new one with 'busctl token issue'") from err
    except jwt.InvalidAudienceError as err:
        raise AuthInvalid(f"token is for another cluster; this cluster is {audience!r}") from err
    except jwt.InvalidTokenError as err:
        raise AuthInvalid(f"invalid token: {err}") from err
    role = raw.get("role")
    if role not in ROLES:
        raise AuthInvalid(f"token role {role!r} is not one of {', '.join(ROLES)}")
    scopes = {k: raw[k] for k in ("datasets", "jobs") if isinstance(raw.get(k), list)}
    return Claims(sub=str(raw["sub"]), role=role, aud=audience, exp=float(raw["exp"]),
                  iat=float(raw["iat"]), jti=str(raw["jti"]), scopes=scopes)


def load_secret(path: str | os.PathLike) -> bytes:
    """Read the shared HS256 secret. Raises :class:`ConfigError` naming the file when it is unusable."""
    p = Path(path)
    try:
        data = p.read_bytes().strip()
    except FileNotFoundError as err:
        raise ConfigError(f"secret file {p} does not exist; create one with 'busctl token secret {p}' "
                          "or point --secret-file / BATCHBUS_SECRET_FILE at the cluster's") from err
    except OSError as err:
        raise ConfigError(f"cannot read secret file {p}: {err.strerror}") from err
    if len(data) < 32:
        raise ConfigError(f"secret file {p} holds {len(data)} bytes; at least 32 are needed")
    return data


def ensure_secret(path: str | os.PathLike) -> bytes:
    """Load the secret at ``path``, creating it (mode 0600, 64 random hex chars) if it is missing."""
    p = Path(path)
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another service created it first: use theirs
            return load_secret(p)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32) + "\n")
    return load_secret(p)

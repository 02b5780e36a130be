"""JWT tokens (PyJWT) and the roles and scopes they grant.

Two algorithms, one per cluster: ``EdDSA`` (Ed25519, the default set-up) where only the administrator
holds the signing key and nodes hold the public key and their own role-limited token, so no node can
mint a token beyond its role; or ``HS256`` with a shared secret file, with which every node holding it
mints tokens of any role (for a single trusted machine, chosen explicitly). Verification pins the cluster's one algorithm, so ``alg: none``, a token of the other
algorithm, and algorithm confusion (HS256 "signed" with the public key as secret) are refused.

Claims: ``sub`` (who), ``role`` (provider | trainer | reader | admin | attempt: :data:`ROLES`), ``aud`` (the cluster), ``iss`` (the
issuer, by default the cluster), ``iat``, ``nbf``, ``exp``, ``jti``; optional scopes ``datasets``
and ``jobs`` (lists of names/ids). No scope claim means unrestricted; ``[]`` means nothing.
"""

from __future__ import annotations

import os
import secrets
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from libbus.errors import AuthExpired, AuthInvalid, ConfigError, Forbidden

__all__ = [
    "ROLES",
    "ALGORITHMS",
    "SCOPES",
    "LEEWAY_S",
    "ATTEMPT_GRANT_S",
    "Claims",
    "issue_token",
    "verify_token",
    "inspect_token",
    "load_secret",
    "ensure_secret",
    "generate_signing_key",
    "load_signing_key",
    "load_token_public_key",
    "public_key_pem",
    "write_private",
    "private_dir",
]

#: provider: serves datasets; trainer: a trainer service (takes jobs, reports progress, pushes results,
#: and reads data for them); reader: a script's loader (reads the train/val data of its datasets and
#: nothing else: never a job, a report or a result); admin: submits, controls and inspects; attempt:
#: one attempt of one job, as the router grants it with the task (scoped to that job and its dataset:
#: its batches and its evaluations at providers; the router takes nothing from it, its reports go
#: through its trainer), never minted by hand.
ROLES = ("provider", "trainer", "reader", "admin", "attempt")
#: Lifetime of an attempt's grant (the router mints it with each task; the attempt renews it through
#: its trainer, which must still hold the job, when half of it is spent).
ATTEMPT_GRANT_S = 3600.0
#: The algorithms a cluster may choose (``token_alg``); verification accepts exactly one.
ALGORITHMS = ("HS256", "EdDSA")
ALGORITHM = "HS256"
#: The optional scope claims and what they restrict.
SCOPES = ("datasets", "jobs")
#: Clock skew tolerated between nodes when checking ``exp``/``nbf``/``iat``.
LEEWAY_S = 5
_REQUIRED = ["sub", "role", "aud", "iss", "exp", "iat", "jti"]

#: What mints tokens (the HS256 secret or the Ed25519 signing key) and what checks them (the
#: secret or the Ed25519 public key); ``Key`` is either.
SigningKey = bytes | Ed25519PrivateKey
VerifyKey = bytes | Ed25519PublicKey
Key = bytes | Ed25519PrivateKey | Ed25519PublicKey


@dataclass(frozen=True)
class Claims:
    sub: str
    role: str
    aud: str
    exp: float
    iat: float
    jti: str
    scopes: dict = field(default_factory=dict)
    iss: str = ""
    nbf: float | None = None  # not valid before (None: valid from ``iat``)

    def expired(self, now: float | None = None) -> bool:
        return (now if now is not None else time.time()) > self.exp + LEEWAY_S

    def allows_dataset(self, name: str) -> bool:
        """Whether the token's ``datasets`` scope (if any) covers dataset ``name``."""
        scope = self.scopes.get("datasets")
        return scope is None or name in scope

    def allows_job(self, job: str) -> bool:
        """Whether the token's ``jobs`` scope (if any) covers job ``job``."""
        scope = self.scopes.get("jobs")
        return scope is None or job in scope

    def check_dataset(self, name: str) -> None:
        """Raise :class:`Forbidden` naming the dataset and the scope unless the token covers it."""
        if not self.allows_dataset(name):
            raise Forbidden(
                f"dataset {name!r} is outside this token's datasets scope [{', '.join(self.scopes['datasets'])}]"
            )

    def check_job(self, job: str) -> None:
        """Raise :class:`Forbidden` naming the job and the scope unless the token covers it."""
        if not self.allows_job(job):
            raise Forbidden(f"job {job!r} is outside this token's jobs scope [{', '.join(self.scopes['jobs'])}]")


def _check_alg(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"token algorithm {algorithm!r} is not supported; use one of {', '.join(ALGORITHMS)}")


def issue_token(
    key: SigningKey,
    *,
    sub: str,
    role: str,
    audience: str,
    ttl_s: float = 3600.0,
    datasets: list[str] | None = None,
    jobs: list[str] | None = None,
    issuer: str | None = None,
    algorithm: str = ALGORITHM,
) -> str:
    """Mint a signed token: ``key`` is the HS256 secret or the Ed25519 private key.

    ``issuer`` defaults to ``audience`` (the cluster). Raises :class:`ConfigError` for an unknown
    role or algorithm, a non-positive ttl, or a key that does not fit the algorithm.
    """
    _check_alg(algorithm)
    if role not in ROLES:
        raise ConfigError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    if ttl_s <= 0:
        raise ConfigError(f"token ttl must be positive, got {ttl_s}")
    if algorithm == "EdDSA" and not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(
            f"EdDSA tokens are signed with the Ed25519 signing key (busctl token keygen), not a {type(key).__name__}"
        )
    if algorithm == "HS256" and not isinstance(key, bytes):
        raise ConfigError("HS256 tokens are signed with the cluster secret file")
    now = int(time.time())
    claims: dict[str, Any] = {
        "sub": sub,
        "role": role,
        "aud": audience,
        "iss": issuer or audience,
        "iat": now,
        "nbf": now,
        "exp": now + int(ttl_s),
        "jti": uuid.uuid4().hex,
    }
    if datasets is not None:
        claims["datasets"] = [str(d) for d in datasets]
    if jobs is not None:
        claims["jobs"] = [str(j) for j in jobs]
    return jwt.encode(claims, key, algorithm=algorithm)


def verify_token(
    token: str,
    key: VerifyKey,
    *,
    audience: str,
    issuer: str | None = None,
    algorithm: str = ALGORITHM,
    check_times: bool = True,
) -> Claims:
    """Check algorithm, signature, ``aud``, ``iss`` (default: ``audience``), ``exp`` and ``nbf``.

    ``key`` is the HS256 secret or the Ed25519 public key. Raises :class:`AuthExpired` for an
    expired token and :class:`AuthInvalid` for every other fault. ``check_times=False`` skips
    ``exp`` and ``nbf`` (the connection handshake: membership only; Hello checks the times).
    """
    _check_alg(algorithm)
    issuer = issuer or audience
    try:
        header = jwt.get_unverified_header(token)
    except jwt.InvalidTokenError as err:
        raise AuthInvalid(f"invalid token: {err}") from err
    if header.get("alg") != algorithm:
        raise AuthInvalid(f"token is signed with {header.get('alg')!r}; this cluster accepts only {algorithm} tokens")
    try:
        raw = jwt.decode(
            token,
            key,
            algorithms=[algorithm],
            audience=audience,
            issuer=issuer,
            leeway=LEEWAY_S,
            options={"require": _REQUIRED, "verify_exp": check_times, "verify_nbf": check_times},
        )
    except jwt.ExpiredSignatureError as err:
        raise AuthExpired("token expired; issue a new one with 'busctl token issue'") from err
    except jwt.InvalidAudienceError as err:
        raise AuthInvalid(f"token is for another cluster; this cluster is {audience!r}") from err
    except jwt.InvalidIssuerError as err:
        raise AuthInvalid(f"token was issued by someone else; this cluster accepts issuer {issuer!r}") from err
    except jwt.ImmatureSignatureError as err:
        raise AuthInvalid(f"token is not valid yet ({err}); check the clocks of issuer and node") from err
    except jwt.InvalidTokenError as err:
        raise AuthInvalid(f"invalid token: {err}") from err
    role = raw.get("role")
    if role not in ROLES:
        raise AuthInvalid(f"token role {role!r} is not one of {', '.join(ROLES)}")
    scopes = {}
    for name in SCOPES:
        if name in raw:
            value = raw[name]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise AuthInvalid(f"token claim {name!r} must be a list of strings, got {value!r}")
            scopes[name] = value
    try:
        nbf = None if raw.get("nbf") is None else float(raw["nbf"])
    except (TypeError, ValueError) as err:
        raise AuthInvalid("invalid token: Not Before claim (nbf) must be a number") from err
    return Claims(
        sub=str(raw["sub"]),
        role=role,
        aud=audience,
        exp=float(raw["exp"]),
        iat=float(raw["iat"]),
        jti=str(raw["jti"]),
        scopes=scopes,
        iss=str(raw["iss"]),
        nbf=nbf,
    )


def inspect_token(token: str) -> tuple[dict, dict]:
    """The header and claims of ``token`` WITHOUT checking anything. Raises :class:`AuthInvalid`
    when it is not a JWT at all."""
    try:
        header = jwt.get_unverified_header(token)
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.InvalidTokenError as err:
        raise AuthInvalid(f"not a token: {err}") from err
    return header, claims


# -- HS256 secret ------------------------------------------------------------------------------


def load_secret(path: str | os.PathLike) -> bytes:
    """Read the shared HS256 secret. Raises :class:`ConfigError` naming the file when it is unusable."""
    p = Path(path)
    try:
        data = p.read_bytes().strip()
    except FileNotFoundError as err:
        raise ConfigError(
            f"secret file {p} does not exist; create one with 'busctl token secret {p}' "
            "or point --secret-file / BATCHBUS_SECRET_FILE at the cluster's"
        ) from err
    except OSError as err:
        raise ConfigError(f"cannot read secret file {p}: {err.strerror}") from err
    mode = p.stat().st_mode & 0o777
    if mode & 0o077:
        # Anyone who reads it mints tokens of any role: refused like a readable CURVE secret key.
        raise ConfigError(f"secret file {p} is readable by others (mode {mode:o}); chmod 600 it")
    if len(data) < 32:
        raise ConfigError(f"secret file {p} holds {len(data)} bytes; at least 32 are needed")
    return data


def private_dir(path: str | Path) -> Path:
    """``path`` as a directory, made with its missing parents at mode 0700 whatever the umask (a state
    directory holds the secret, keys, tokens and the job database). An existing directory is left as it
    is: its operator chose its mode (systemd's ``StateDirectory=``, a shared checkpoint mount)."""
    path = Path(path)
    missing = []
    for p in [path, *path.parents]:
        if p.exists():
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:
            continue  # made meanwhile by another process: theirs to set
        os.chmod(p, 0o700)  # mkdir's mode is masked by the umask; chmod is not
    return path


def _create_private(path: Path, data: bytes) -> bool:
    """Write ``data`` to a new file of mode 0600 (whatever the umask). False if it already exists."""
    private_dir(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as fh:
        os.fchmod(fh.fileno(), 0o600)  # O_CREAT's mode is masked by the umask; this is not
        fh.write(data)
    return True


def ensure_secret(path: str | os.PathLike) -> bytes:
    """Load the secret at ``path``, creating it (mode 0600, 64 random hex chars) if it is missing."""
    p = Path(path)
    if not p.exists():
        _create_private(p, (secrets.token_hex(32) + "\n").encode())  # if another made it first: use theirs
    return load_secret(p)


# -- EdDSA keys --------------------------------------------------------------------------------


def generate_signing_key(path: str | os.PathLike, public_path: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Write a new Ed25519 signing key (PEM, mode 0600) to ``path`` and its public key to
    ``public_path`` (default ``path.pub``).

    Returns both paths. Raises :class:`ConfigError` if ``path`` exists (a key is never overwritten).
    """
    p = Path(path)
    pub = Path(public_path) if public_path is not None else p.with_name(p.name + ".pub")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    if not _create_private(p, pem):
        raise ConfigError(
            f"signing key {p} already exists; remove it first to replace it (every token it signed stops working)"
        )
    private_dir(pub.parent)
    pub.write_bytes(public_key_pem(key))
    return p, pub


def public_key_pem(key: Ed25519PrivateKey) -> bytes:
    """The PEM of ``key``'s public half: what every node verifies tokens with (``public_key_file``)."""
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def write_private(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` (mode 0600 whatever the umask, its directory made 0700 if missing),
    replacing what was there whole: a token given to a node, renewed in place."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.unlink(missing_ok=True)
    if not _create_private(tmp, data):
        raise ConfigError(f"{tmp} appeared while writing it; is another busctl writing {p}?")
    os.replace(tmp, p)
    return p


def _read_pem(path: str | os.PathLike, what: str, hint: str) -> bytes:
    p = Path(path)
    try:
        return p.read_bytes()
    except FileNotFoundError as err:
        raise ConfigError(f"{what} {p} does not exist; {hint}") from err
    except OSError as err:
        raise ConfigError(f"cannot read {what} {p}: {err.strerror}") from err


def load_signing_key(path: str | os.PathLike) -> Ed25519PrivateKey:
    """The Ed25519 signing key at ``path``. Raises :class:`ConfigError` naming the file."""
    data = _read_pem(
        path,
        "signing key",
        f"create one with 'busctl token keygen {path}' on the "
        "administrator's machine, or use a token it issued (--token / BATCHBUS_TOKEN)",
    )
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"signing key {path} is not an unencrypted PEM private key: {err}") from err
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"signing key {path} is a {type(key).__name__}; an Ed25519 key is needed")
    return key


def load_token_public_key(path: str | os.PathLike) -> Ed25519PublicKey:
    """The Ed25519 public key at ``path`` (a ``.pub`` from ``busctl token keygen``)."""
    data = _read_pem(
        path,
        "public key",
        "copy the .pub file written by 'busctl token keygen' there, "
        "or point public_key_file / BATCHBUS_PUBLIC_KEY_FILE at it",
    )
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"public key {path} is not a PEM public key: {err}") from err
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"public key {path} is a {type(key).__name__}; an Ed25519 key is needed")
    return key

"""CurveZMQ: encrypted, mutually authenticated connections, with pyzmq's ZAP authenticator.

With ``curve = true`` every batchbus socket runs the CURVE handshake. Keys are long-term pairs in
ZeroMQ's certificate format (``zmq.auth``): ``NAME.key`` holds the public key and may be copied
anywhere; ``NAME.key_secret`` holds both halves, is created 0600 and never leaves its node.

- A **server** (router, provider) binds with its secret key, runs a ZAP handler that admits only
  the public keys found in its authorized directory (``*.key`` files), and stamps each connection
  with the key's *name* (the file's stem) as the ZeroMQ ``User-Id``. The server then requires the
  session token's subject to equal that name: a token is only good over its owner's key.
- A **client** connects with its own key pair and the server's public key: the router's comes from
  configuration, a provider's from the router's ``Resolved`` reply (over the already-encrypted
  router connection).

Defence in depth against a missing handler: server sockets set a ZAP domain *and*
``ZAP_ENFORCE_DOMAIN``, so libzmq refuses every CURVE client when no handler answers, and the server
refuses a ``Hello`` that arrives without a ``User-Id``.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from libbus.errors import ConfigError
from libbus.security.auth import private_dir
from libbus.security.zap import ZapThreadAuthenticator

__all__ = [
    "ZAP_DOMAIN",
    "CurveKeys",
    "generate_keys",
    "load_keys",
    "load_public_key",
    "authorized_keys",
    "KeyAuthenticator",
    "curve_key_of",
    "secure_server",
    "secure_client",
]

log = logging.getLogger(__name__)

#: The ZAP domain of every batchbus server socket.
ZAP_DOMAIN = "batchbus"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


@dataclass(frozen=True)
class CurveKeys:
    """A long-term key pair, z85-encoded (40 ASCII bytes each), and the name it was made under."""

    name: str
    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never print the secret half
        return f"CurveKeys(name={self.name!r}, public={self.public.decode()!r})"


def _write_private(path: Path, data: bytes) -> None:
    """Create ``path`` 0600 whatever the umask; refuse to overwrite an existing key."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError as err:
        raise ConfigError(f"{path} already exists; remove it first to make a new key") from err
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def generate_keys(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (0600) into ``directory``.

    The files are made by ``zmq.auth.create_certificates`` inside a private (0700) temporary
    directory and then written to their places, so the secret is never readable by others, even
    for a moment. Returns ``(public_path, secret_path)``.
    """
    if not name or "/" in name or name.startswith(".") or not name.isprintable():
        raise ConfigError(f"key name {name!r}: use letters, digits, '-', '_' (it becomes a file name)")
    out = Path(directory)
    private_dir(out)
    public_path, secret_path = out / f"{name}{PUBLIC_SUFFIX}", out / f"{name}{SECRET_SUFFIX}"
    for path in (public_path, secret_path):
        if path.exists():
            raise ConfigError(f"{path} already exists; remove it first to make a new key")
    with tempfile.TemporaryDirectory(prefix="batchbus-keys-") as tmp:
        made_public, made_secret = zmq.auth.create_certificates(tmp, name)
        secret_text = Path(made_secret).read_bytes()
        public_text = Path(made_public).read_bytes()
    _write_private(secret_path, secret_text)
    public_path.write_bytes(public_text)
    return public_path, secret_path


def _name_of(path: Path) -> str:
    name = path.name
    for suffix in (SECRET_SUFFIX, PUBLIC_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def load_keys(path: str | os.PathLike) -> CurveKeys:
    """A key pair from a ``NAME.key_secret`` file; :class:`ConfigError` naming the file otherwise."""
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o777
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"CURVE key {path}: {err} (make one with 'busctl keys gen NAME')") from err
    if secret is None:
        raise ConfigError(f"CURVE key {path} holds only a public key; give the NAME.key_secret file")
    if mode & 0o077:
        raise ConfigError(f"CURVE secret key {path} is readable by others (mode {mode:o}); chmod 600 it")
    _check_z85(path, public, secret)
    return CurveKeys(_name_of(path), public, secret)


def load_public_key(path: str | os.PathLike) -> bytes:
    """The z85 public key of a ``NAME.key`` (or ``NAME.key_secret``) file."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"CURVE public key {path}: {err}") from err
    _check_z85(path, public)
    return public


def _check_z85(path, *keys: bytes) -> None:
    for key in keys:
        try:
            ok = len(z85.decode(key)) == 32
        except (ValueError, KeyError, IndexError):
            ok = False
        if not ok:
            raise ConfigError(f"CURVE key file {path} does not hold a 40-character z85 key")


def authorized_keys(directory: str | os.PathLike) -> dict[bytes, str]:
    """``{z85 public key: name}`` for every ``*.key`` file in ``directory``; unreadable files are
    skipped with a log line (one bad file must not lock everyone out)."""
    keys: dict[bytes, str] = {}
    for path in sorted(Path(directory).glob(f"*{PUBLIC_SUFFIX}")):
        try:
            keys[load_public_key(path)] = _name_of(path)
        except ConfigError as err:
            log.warning("skipping authorized key: %s", err)
    return keys


class KeyAuthenticator(ZapThreadAuthenticator):
    """pyzmq's ZAP handler thread, admitting the keys of one directory and naming each connection
    (its ``User-Id``) after the key file. The directory is read again when it changes, so an
    operator adds or removes a node's key without restarting the service."""

    def __init__(self, ctx: zmq.Context, directory: str | os.PathLike):
        super().__init__(ctx, log=log.getChild("zap"))
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ConfigError(
                f"CURVE authorized-keys directory {self.directory} does not exist "
                "(put the NAME.key files of the clients to admit there)"
            )
        self._lock = threading.Lock()
        self._stamp: float | None = None
        self._names: dict[bytes, str] = {}
        self.configure_curve_callback(ZAP_DOMAIN, self)
        self._reload()

    def _reload(self) -> None:
        stamp = self.directory.stat().st_mtime
        with self._lock:
            if stamp != self._stamp:
                self._names, self._stamp = authorized_keys(self.directory), stamp

    # ``configure_curve_callback``'s credentials provider protocol.
    def callback(self, domain: str, z85_key: bytes) -> bool:
        try:
            self._reload()
        except OSError as err:
            log.error("cannot read authorized keys in %s: %s", self.directory, err)
        admitted = z85_key in self._names
        if not admitted:
            log.info("ZAP: refused CURVE key %s (not in %s)", z85_key.decode(), self.directory)
        return admitted

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._names.get(z85.encode(client_public_key), "")


def curve_key_of(provider: Mapping[str, object]) -> bytes | None:
    """A ``Resolved`` provider entry's CURVE public key (None when the cluster runs without CURVE)."""
    key = provider.get("curve_key")
    return key.encode() if isinstance(key, str) and key else None


def secure_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` a CURVE server in the batchbus ZAP domain, refusing all when no handler runs."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def secure_client(sock: zmq.Socket, keys: CurveKeys, server_key: bytes) -> None:
    """Make ``sock`` a CURVE client of the server whose public key is ``server_key``."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_key

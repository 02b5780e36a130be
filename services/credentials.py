"""Who a service is and how it proves it: its name, its CURVE keys and the router's, the token
secret or signing keys, the tokens it mints and uses, its identity, and its server's security and
socket settings. (What a service process does with its host: :mod:`services.process`.)"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable

from libbus.config import Settings
from libbus.connect.client import Identity
from libbus.errors import ConfigError
from libbus.security.auth import (
    SigningKey,
    VerifyKey,
    ensure_secret,
    generate_signing_key,
    issue_token,
    load_secret,
    load_signing_key,
    load_token_public_key,
)
from libbus.security.curve import CurveKeys, load_keys
from libbus.security.curve import load_public_key as load_curve_public_key
from libbus.serve.server import ServerConfig
from libbus.wire.sockets import SocketLimits

__all__ = [
    "curve_key_file",
    "curve_keys",
    "identity",
    "limits",
    "mint_token",
    "router_key",
    "secret",
    "server_config",
    "service_name",
    "signing_key",
    "token_source",
    "verify_key",
]

log = logging.getLogger(__name__)


def service_name(settings: Settings, role: str) -> str:
    """``settings.name``; with CURVE on, the name of the service's key (tokens minted for the
    service carry it as subject, and servers require subject == key name)."""
    if settings.name:
        return settings.name
    keys = curve_keys(settings, role)
    return keys.name if keys is not None else f"{role}-{socket.gethostname()}-{os.getpid()}"


def curve_key_file(settings: Settings, role: str) -> str:
    return settings.curve_key_file or os.path.join(settings.state_dir, "curve", f"{role}.key_secret")


def curve_keys(settings: Settings, role: str) -> CurveKeys | None:
    """This service's CURVE key pair when ``curve`` is on, else None. Raises :class:`ConfigError`
    naming the missing or unsafe file."""
    return load_keys(curve_key_file(settings, role)) if settings.curve else None


def router_key(settings: Settings) -> bytes | None:
    """The router's CURVE public key when ``curve`` is on."""
    return load_curve_public_key(settings.curve_router_key) if settings.curve else None


def secret(settings: Settings, create: bool = False) -> bytes:
    """The cluster secret; the router creates it on first start, everyone else must find it."""
    return ensure_secret(settings.secret_file) if create else load_secret(settings.secret_file)


def verify_key(settings: Settings, create: bool = False) -> VerifyKey:
    """What this node checks tokens with: in EdDSA mode (the default set-up) the public key (derived
    from the signing key where only that is present; with ``create``, the router's first start, a new
    key pair when neither exists: the signing key stays on this machine, the public key goes to every
    node), or the HS256 secret (made with ``create`` if missing). Raises :class:`ConfigError` naming
    the missing file."""
    if settings.token_alg == "HS256":
        return secret(settings, create)
    if create and not os.path.exists(settings.public_key_file) and not os.path.exists(settings.signing_key_file):
        key_path, pub_path = generate_signing_key(settings.signing_key_file, settings.public_key_file)
        log.warning(
            "made the cluster's token signing key %s (keep it on this machine: it mints every role) and its "
            "public key %s (copy it to every node; 'busctl token node' gives a node its key and token)",
            key_path,
            pub_path,
        )
    if not os.path.exists(settings.public_key_file) and os.path.exists(settings.signing_key_file):
        return load_signing_key(settings.signing_key_file).public_key()
    return load_token_public_key(settings.public_key_file)


def signing_key(settings: Settings) -> SigningKey:
    """What this node mints tokens with: the HS256 secret or the EdDSA signing key."""
    if settings.token_alg == "HS256":
        return secret(settings)
    if not os.path.exists(settings.signing_key_file):
        raise ConfigError(
            f"token_alg is EdDSA and this node has no signing key ({settings.signing_key_file} "
            "does not exist): give it a token minted on the administrator's machine ('busctl token node' "
            "or 'busctl token issue') with BATCHBUS_TOKEN_FILE, token_file or --token; only the "
            "administrator's machine holds the signing key (the router makes it on its first start)"
        )
    return load_signing_key(settings.signing_key_file)


def mint_token(
    settings: Settings,
    key: SigningKey,
    *,
    role: str,
    sub: str,
    ttl_s: float | None = None,
    datasets: list[str] | None = None,
    jobs: list[str] | None = None,
) -> str:
    """A token of this cluster (algorithm, audience, issuer from ``settings``) signed with ``key``."""
    return issue_token(
        key,
        sub=sub,
        role=role,
        audience=settings.cluster,
        issuer=settings.token_issuer,
        ttl_s=settings.token_ttl_s if ttl_s is None else ttl_s,
        datasets=datasets,
        jobs=jobs,
        algorithm=settings.token_alg,
    )


def token_source(settings: Settings, role: str, name: str) -> Callable[[], str] | str:
    """``settings.token`` when given, else a callable minting fresh ``role`` tokens with the
    secret (HS256) or the signing key (EdDSA). Raises :class:`ConfigError` when neither is here."""
    if settings.token:
        return settings.token
    key = signing_key(settings)
    return lambda: mint_token(settings, key, role=role, sub=name)


def identity(settings: Settings, role: str, name: str, caps: dict | None = None) -> Identity:
    return Identity(
        role=role,
        name=name,
        token=token_source(settings, role, name),
        host_id=settings.host_id,
        caps=caps or {},
        curve=curve_keys(settings, role),
        router_key=router_key(settings),
        handshake=settings.handshake_auth,
    )


def limits(settings: Settings) -> SocketLimits:
    return SocketLimits(max_msg_bytes=settings.max_msg_bytes, hwm=settings.hwm)


def server_config(settings: Settings, bind: str, key: VerifyKey, name: str, role: str) -> ServerConfig:
    return ServerConfig(
        bind=bind,
        secret=key,
        audience=settings.cluster,
        name=name,
        heartbeat_ms=settings.heartbeat_ms,
        heartbeat_liveness=settings.heartbeat_liveness,
        limits=limits(settings),
        algorithm=settings.token_alg,
        issuer=settings.token_issuer,
        curve=curve_keys(settings, role),
        authorized_dir=settings.curve_authorized_dir,
        session_inflight=settings.session_inflight,
        session_rate=settings.session_rate,
        session_burst=settings.session_burst,
        sessions_per_subject=settings.sessions_per_subject,
        session_unsent_bytes=settings.session_unsent_bytes,
        unsent_wait_s=settings.unsent_wait_s,
        handshake_auth=settings.handshake_auth,
    )

"""What every service process shares: signals, readiness notification, identities and tokens."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from typing import Callable

from libbus.auth import ensure_secret, issue_token, load_secret
from libbus.client import Identity
from libbus.config import Settings
from libbus.server import ServerConfig
from libbus.sockets import SocketLimits

__all__ = ["clean_shm", "install_signal_handlers", "sd_notify", "service_name", "token_source", "identity",
           "server_config", "limits", "secret"]

log = logging.getLogger(__name__)


def install_signal_handlers(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop``: the service drains and exits 0 (what systemd expects)."""
    def _handler(signum, _frame):
        log.info("received %s; stopping", signal.Signals(signum).name)
        stop.set()
    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)


def sd_notify(state: str) -> bool:
    """Tell systemd ``state`` (``READY=1``, ``STOPPING=1``, ``WATCHDOG=1``) if it is listening."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
        return True
    except OSError as err:
        log.warning("sd_notify(%s) failed: %s", state, err)
        return False


def clean_shm() -> None:
    """Remove rings left by processes that died (SIGKILL, OOM) before they could unlink them."""
    from shm import collect_garbage  # noqa: PLC0415
    for seg in collect_garbage():
        log.info("removed shared memory %s of dead process %d (%.1f MiB)", seg.name, seg.pid,
                 seg.size / 2**20)


def service_name(settings: Settings, role: str) -> str:
    return settings.name or f"{role}-{socket.gethostname()}-{os.getpid()}"


def secret(settings: Settings, create: bool = False) -> bytes:
    """The cluster secret; the router creates it on first start, everyone else must find it."""
    return ensure_secret(settings.secret_file) if create else load_secret(settings.secret_file)


def token_source(settings: Settings, role: str, name: str) -> Callable[[], str] | str:
    """``settings.token`` when given, else a callable minting fresh ``role`` tokens from the secret."""
    if settings.token:
        return settings.token
    key = secret(settings)
    return lambda: issue_token(key, sub=name, role=role, audience=settings.cluster,
                               ttl_s=settings.token_ttl_s)


def identity(settings: Settings, role: str, name: str, caps: dict | None = None) -> Identity:
    return Identity(role=role, name=name, token=token_source(settings, role, name), host_id=settings.host_id,
                    caps=caps or {})


def limits(settings: Settings) -> SocketLimits:
    return SocketLimits(max_msg_bytes=settings.max_msg_bytes, hwm=settings.hwm)


def server_config(settings: Settings, bind: str, key: bytes, name: str) -> ServerConfig:
    return ServerConfig(bind=bind, secret=key, audience=settings.cluster, name=name,
                        heartbeat_ms=settings.heartbeat_ms, heartbeat_liveness=settings.heartbeat_liveness,
                        limits=limits(settings))

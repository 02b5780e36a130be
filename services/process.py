"""What a service process does with its host: systemd readiness and signals, its heap once started, the
orderly end, and the rings and same-host sockets that dead processes left. (Who the service is, and how it proves it:
:mod:`services.credentials`.)"""

from __future__ import annotations

import gc
import logging
import os
import secrets
import signal
import stat
import threading
from pathlib import Path

import zmq

from libbus.constants import DRAIN_LINGER_S
from libbus.errors import ConfigError
from shm import SHM_DIR
from shm.names import pid_alive

from .sdnotify import Notifier

__all__ = [
    "clean_shm",
    "finish",
    "freeze_startup_heap",
    "install_signal_handlers",
    "local_endpoint",
    "notifier",
    "remove_local_endpoint",
]

log = logging.getLogger(__name__)


def notifier() -> Notifier:
    """The systemd notifier of this process (a no-op outside a ``Type=notify`` unit). The variables
    are removed from the environment, as ``sd_notify(unset_environment=1)`` does: a child process
    must not speak to systemd in the service's name."""
    notify = Notifier.from_env(os.environ)
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        os.environ.pop(name, None)
    return notify


def install_signal_handlers(stop: threading.Event, notify: Notifier | None = None) -> None:
    """SIGTERM and SIGINT set ``stop``: the service drains and exits 0 (what systemd expects).
    ``notify`` tells systemd at once (``STOPPING=1``) that the shutdown has begun."""

    def _handler(signum, _frame):
        name = signal.Signals(signum).name
        log.info("received %s; stopping", name)
        stop.set()
        if notify is not None:
            notify.stopping(f"{name}: finishing work in flight, then exiting")

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)


def freeze_startup_heap() -> int:
    """Keep what the service built to start (modules, numpy and torch, its sources and settings) out of
    every later garbage collection; returns how many objects that is.

    CPython's full collection walks every object the collector tracks, holding the GIL: no Python code
    of the process runs meanwhile, not the serving loop, not a reply. A provider holds about 70,000 such objects once started, and serving
    batches at full speed makes enough longer-lived containers to set off a full collection every 0.5-2 s:
    20-70 ms each on a 2-core machine, in which no ``Hello`` is answered and no batch is filled. Collected
    once and then frozen (:func:`gc.freeze`), start-up's objects are never walked again, and a full
    collection walks only what serving made since: 0.1-0.2 ms (docs/performance.md, "Garbage
    collection in a provider"). The cost: a reference cycle among start-up's objects, dropped later, is never freed;
    a service keeps what it built to start (its datasets, its sockets) until it ends."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze %d objects from start-up out of the garbage collector's walks", frozen)
    return frozen


def finish(notify: Notifier, linger_s: float = DRAIN_LINGER_S) -> None:
    """End a service process: ``STOPPING=1`` (if no signal said it), then give the replies still
    queued in ZeroMQ up to ``linger_s`` to leave (at interpreter exit pyzmq would drop them)."""
    notify.stopping()
    notify.close()
    # term() returns once every socket is closed and its queue sent or its linger over. A socket a
    # stray thread still holds would block it for ever: wait in a daemon thread, bounded.
    waiter = threading.Thread(target=zmq.Context.instance().term, name="zmq-term", daemon=True)
    waiter.start()
    waiter.join(linger_s + 0.5)


def clean_shm() -> None:
    """Remove rings and same-host sockets left by processes that died (SIGKILL, OOM) before they
    could remove them themselves."""
    from shm import collect_garbage  # noqa: PLC0415

    for seg in collect_garbage():
        log.info("removed shared memory %s of dead process %d (%.1f MiB)", seg.name, seg.pid, seg.size / 2**20)
    try:
        base = _ipc_dir(create=False)
    except (ConfigError, OSError):
        return  # none yet, or not ours: leave it alone
    for sock in base.glob("*-*-*.sock"):
        pid = sock.name.split("-")[1]
        if pid.isdigit() and not pid_alive(int(pid)):
            sock.unlink(missing_ok=True)


def _ipc_dir(create: bool) -> Path:
    """This user's directory for same-host sockets, checked to be private (a real directory of
    this uid, mode 0700: /dev/shm is writable by everyone, so a planted link must not pass)."""
    base = SHM_DIR / f"batchbus-ipc-{os.geteuid()}"
    if create:
        base.mkdir(mode=0o700, exist_ok=True)
    st = base.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ConfigError(f"{base} must be a directory of uid {os.geteuid()} with mode 0700")
    return base


def remove_local_endpoint(endpoint: str) -> None:
    """Remove a socket file :func:`local_endpoint` made (libzmq does not always unlink it)."""
    if endpoint.startswith("ipc://"):
        Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


def local_endpoint(role: str) -> str:
    """A fresh ``ipc://`` endpoint for same-host peers, in a directory only this user can enter.

    Same-host requests over a Unix socket cost a fraction of loopback TCP's (no TCP stack, fewer
    wake-ups), which is most of what is left per batch once the bytes go through shared memory.
    It lives under /dev/shm, which same-host services share anyway for their rings (a /tmp socket
    would be hidden by systemd's PrivateTmp=). Raises :class:`ConfigError` when the directory is
    not private to this user.
    """
    base = _ipc_dir(create=True)
    path = base / f"{role}-{os.getpid()}-{secrets.token_hex(4)}.sock"
    if len(str(path)) > 100:  # sun_path holds 108 bytes
        raise ConfigError(f"ipc path {path} is too long for a Unix socket")
    return f"ipc://{path}"

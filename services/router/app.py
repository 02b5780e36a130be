"""``busctl start router``: the control plane's ROUTER socket and the job database."""

from __future__ import annotations

import logging
import resource
import threading
from collections.abc import Callable

import zmq

from libbus.config import Settings
from libbus.errors import ConfigError
from libbus.security.auth import ATTEMPT_GRANT_S
from libbus.serve.metrics import MetricsExporter, start_exporter
from libbus.serve.server import Server

from .. import credentials
from .artifacts import Artifacts
from .handler import RouterHandler
from .metrics import router_metrics
from .store import JobStore

__all__ = ["RouterService", "grant_minter", "raise_open_files"]

log = logging.getLogger(__name__)

#: Open files a router wants: one per connected peer (a thousand trainers and a hundred providers
#: are 1,100), plus its database, logs and ZeroMQ's own. Soft limits are often 1,024.
WANT_OPEN_FILES = 65536


def raise_open_files(want: int = WANT_OPEN_FILES) -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` towards ``want`` (never past the hard limit, which
    only the operator can raise: ``LimitNOFILE=`` in the unit, ``ulimit -Hn``). Returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft != resource.RLIM_INFINITY and soft < 4096:
        log.warning("open files limited to %d: the router holds one per connected peer; raise LimitNOFILE", soft)
    return soft


def grant_minter(settings: Settings) -> Callable[[str, str, str], str] | None:
    """What mints each attempt's grant (services/router/handler.py): an ``attempt`` token of the
    trainer's subject, scoped to one job and its dataset, for :data:`ATTEMPT_GRANT_S`. None (with a
    warning) where this router holds no signing key: its tasks then carry no grant."""
    try:
        key = credentials.signing_key(settings)
    except ConfigError as err:
        log.warning(
            "this router cannot mint attempts' grants (%s); attempts of its jobs will read nothing: keep the "
            "cluster's signing key on the router's machine",
            err,
        )
        return None

    def mint(trainer: str, job: str, dataset: str) -> str:
        return credentials.mint_token(
            settings, key, role="attempt", sub=trainer, ttl_s=ATTEMPT_GRANT_S, datasets=[dataset], jobs=[job]
        )

    return mint


class RouterService:
    def __init__(self, settings: Settings, ctx: zmq.Context | None = None):
        self.settings = settings
        self.name = credentials.service_name(settings, "router")
        key = credentials.verify_key(settings, create=True)
        self.store = JobStore(settings.db)
        self.handler = RouterHandler(
            self.store,
            lease_s=settings.lease_s,
            artifacts=Artifacts(settings.artifact_dir),
            mint_grant=grant_minter(settings),
        )
        # group commit: the server calls the handler's flush (one fsync) before a turn's replies go out
        self.store.durability.group()
        bind = settings.bind or settings.router
        self.server = Server(self.handler, credentials.server_config(settings, bind, key, self.name, "router"), ctx)
        self.handler.server_stats = self.server.stats
        self.handler.apply_revoked = self.server.set_revoked
        self.server.set_revoked(self.handler.revocations.jtis())
        #: The Prometheus endpoint while serving (``metrics_bind`` set), else ``None``.
        self.metrics: MetricsExporter | None = None

    def start(self) -> str:
        raise_open_files()
        self.metrics = start_exporter(self.settings.metrics_bind, "router", self.name, self.handler.row, router_metrics)
        try:
            endpoint = self.server.bind()
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            raise
        log.info("router %s listening on %s (jobs in %s)", self.name, endpoint, self.settings.db)
        return endpoint

    def run(self, stop: threading.Event, on_loop: Callable[[], None] | None = None) -> None:
        """Serve until ``stop``; ``on_loop`` runs every turn of the serving loop (the watchdog)."""
        try:
            self.server.run(stop, on_loop)
        finally:
            if self.metrics is not None:
                self.metrics.close()
            self.store.close()

"""``busctl start router``: the control plane's ROUTER socket and the job database."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from libbus.config import Settings
from libbus.metrics import MetricsExporter, start_exporter
from libbus.server import Server

from .. import runtime
from .artifacts import Artifacts
from .handler import RouterHandler
from .store import JobStore

__all__ = ["RouterService"]

log = logging.getLogger(__name__)


class RouterService:
    def __init__(self, settings: Settings, ctx: zmq.Context | None = None):
        self.settings = settings
        self.name = runtime.service_name(settings, "router")
        key = runtime.verify_key(settings, create=True)
        self.store = JobStore(settings.db)
        self.handler = RouterHandler(self.store, lease_s=settings.lease_s, artifacts=Artifacts(settings.artifact_dir))
        bind = settings.bind or settings.router
        self.server = Server(self.handler, runtime.server_config(settings, bind, key, self.name, "router"), ctx)
        self.handler.server_stats = self.server.stats
        self.handler.apply_revoked = self.server.set_revoked
        self.server.set_revoked(self.handler.revocations.jtis())
        #: The Prometheus endpoint while serving (``metrics_bind`` set), else ``None``.
        self.metrics: MetricsExporter | None = None

    def start(self) -> str:
        self.metrics = start_exporter(self.settings.metrics_bind, "router", self.name, self.server.stats)
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

"""``busctl start router``: the control plane's ROUTER socket and the job database."""

from __future__ import annotations

import logging
import threading

import zmq

from libbus.config import Settings
from libbus.server import Server

from .. import runtime
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
        grace = settings.heartbeat_ms / 1000 * settings.heartbeat_liveness * 2
        self.handler = RouterHandler(self.store, lease_grace_s=grace)
        bind = settings.bind or settings.router
        self.server = Server(self.handler, runtime.server_config(settings, bind, key, self.name), ctx)
        self.handler.server_stats = self.server.stats

    def start(self) -> str:
        endpoint = self.server.bind()
        log.info("router %s listening on %s (jobs in %s)", self.name, endpoint, self.settings.db)
        return endpoint

    def run(self, stop: threading.Event) -> None:
        try:
            self.server.run(stop)
        finally:
            self.store.close()


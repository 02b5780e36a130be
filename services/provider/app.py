"""``busctl start provider``: bind the data socket, register with the router, serve until SIGTERM."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable

import zmq

from libbus.config import Settings
from libbus.connect.link import Link
from libbus.errors import BusError, ConfigError, Unavailable
from libbus.serve.metrics import MetricsExporter, start_exporter
from libbus.serve.server import Server
from libbus.wire.dataset_info import SourceInfo
from libbus.wire.messages import ChargeEvaluation, Entitlements, EvaluationCharged, EvaluationReport, Message

from .. import credentials, process
from .evalgate import EvalGate
from .handler import ProviderHandler
from .metrics import ProviderBeat, ProviderRow, provider_metrics
from .read_helper import ReadHelper, helped
from .score_release import Release
from .sources import Source, open_source, parse_dataset_arg
from .sources.objstore import configure_cache
from .sources.pipeline import Pipeline
from .sources.pipeline.decode_cache import DecodeCache

__all__ = ["ProviderService", "DEFAULT_BIND", "private_test_option", "split_notice"]

log = logging.getLogger(__name__)

DEFAULT_BIND = "tcp://127.0.0.1:0"
#: The provider process's GIL switch interval (CPython's default: 5 ms); see ProviderService.start.
SWITCH_INTERVAL_S = 0.0005

_FALSE, _TRUE = ("false", "0", "no", "off"), ("true", "1", "yes", "on")


def private_test_option(uri: str) -> tuple[str, bool]:
    """``private_test=false`` on a dataset's URI (``ids=file:///data/ids?private_test=false``): the
    operator marks its test split readable by trainers, where nothing needs hiding. Returns the URI
    without the option (the source never sees it) and whether the test split stays private (the
    default). Raises :class:`ConfigError` for a value that is not a boolean."""
    base, sep, query = uri.partition("?")
    if not sep:
        return uri, True
    kept, private = [], True
    for pair in query.split("&"):
        key, _, value = pair.partition("=")
        if key != "private_test":
            kept.append(pair)
        elif value.lower() in _FALSE:
            private = False
        elif value.lower() not in _TRUE:
            raise ConfigError(f"{uri}: private_test must be true or false, got {value!r}")
    return (f"{base}?{'&'.join(kept)}" if kept else base), private


def split_notice(name: str, info: SourceInfo) -> str:
    """One line on where a dataset's splits come from: how many samples each holds, whether val was
    carved out of train (``val_fraction`` in its DatasetInfo: the files hold no val split) and
    whether its test split is readable."""
    splits = info["splits"]
    val = splits["val"]["num_samples"]
    where = (
        f"val {val} carved from train ({info.get('val_carved', 'the tail of train')}, val_fraction "
        f"{info['val_fraction']}: the files hold no val split; train keeps the rest)"
        if info.get("val_fraction") is not None
        else f"val {val}"
    )
    test = splits["test"]
    readable = "readable (private_test=false)" if test.get("available") else "private: provider-side evaluation only"
    return f"dataset {name}: train {splits['train']['num_samples']}, {where}, test {test['num_samples']} {readable}"


class ProviderService:
    """A provider: its data server plus its link to the router. ``start`` binds; ``run`` serves."""

    def __init__(self, settings: Settings, ctx: zmq.Context | None = None):
        if not settings.datasets:
            raise ConfigError("a provider needs at least one --dataset NAME=URI (e.g. mnist=mock://mnist)")
        self.settings = settings
        self.name = credentials.service_name(settings, "provider")
        self.ctx = ctx or zmq.Context.instance()
        datasets: dict[str, Source] = {}
        readable_test = set()
        uris: dict[str, str] = {}
        configure_cache(settings.cache_dir, settings.cache_limit)
        for arg in settings.datasets:
            name, uri = parse_dataset_arg(arg)
            if name in datasets:
                raise ConfigError(f"dataset name {name!r} is given twice")
            uri, private_test = private_test_option(uri)
            datasets[name] = open_source(uri, datasets, user_modules=settings.user_modules)
            uris[name] = uri
            if not private_test:
                readable_test.add(name)
        self.decode_cache = decode_cache(settings, self.name, datasets)
        gate = EvalGate(
            settings.eval_queue, settings.eval_max_model_bytes, settings.eval_per_minute, settings.eval_per_dataset_day
        )
        self.handler = ProviderHandler(
            datasets,
            host_id=settings.host_id,
            shm=settings.shm,
            assigned_only=settings.assigned_only,
            evalgate=gate,
            readable_test=frozenset(readable_test),
            evaluator_modules=frozenset(settings.evaluator_modules),
            eval_timeout_s=settings.eval_timeout_s,
            release=Release(settings.eval_epsilon),
            fill_threads=settings.fill_threads,
            remote_reads=settings.remote_reads,
            helpers=read_helpers(settings, datasets, uris),
            report=self._report,
            charge=self._charge,
        )
        for name in datasets:
            log.info("%s", split_notice(name, self.handler.infos[name]))
        key = credentials.verify_key(settings)
        bind = settings.bind or DEFAULT_BIND
        self.server = Server(
            self.handler, credentials.server_config(settings, bind, key, self.name, "provider"), self.ctx
        )
        self.link: Link | None = None
        self.endpoint = ""
        #: The Prometheus endpoint while serving (``metrics_bind`` set), else ``None``.
        self.metrics: MetricsExporter | None = None

    def start(self) -> str:
        """Bind the data socket and start registering with the router. Returns the data endpoint."""
        process.clean_shm()
        # The serving loop shares the GIL with the threads reading remote stores (a hundred, parsing
        # replies): at CPython's 5 ms switch interval each of its turns could wait that long per thread
        # ahead of it. 0.5 ms bounds another dataset's batches beside a busy remote one (with the readers'
        # lower priority, sources/storage/inflight.py), at a cost to that remote dataset's full shuffle
        # without a cache (more switches): paid only where there is another dataset to be fair to
        # (docs/performance.md, "Data behind a network").
        # A remote dataset read in a helper process (read_helper.py) has no reader threads here: the
        # switch interval stays CPython's when every remote dataset is read in one.
        self._start_helpers()
        sources = self.handler.datasets.values()
        if len(sources) > 1 and any(
            s.remote and n not in self.handler.helped for n, s in self.handler.datasets.items()
        ):
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.metrics = start_exporter(
            self.settings.metrics_bind,
            "provider",
            self.name,
            self.stats,
            provider_metrics(lambda: self.handler.latency),
        )
        try:
            return self._start()
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            for reader in self.handler.helped.values():
                reader.helper.close()
            raise

    def _start_helpers(self) -> None:
        """Start each remote dataset's read helper; one that cannot open its dataset leaves it to the
        provider's own threads."""
        for name, reader in list(self.handler.helped.items()):
            try:
                reader.helper.start()
            except BusError as err:
                log.warning("dataset %s is read on the provider's threads: %s", name, err)
                del self.handler.helped[name]

    def _start(self) -> str:
        bound = self.server.bind()
        self.endpoint = self.settings.advertise or bound
        if self.settings.shm:
            try:
                self.handler.local_endpoint = self.server.bind_also(process.local_endpoint("provider"))
            except (BusError, OSError) as err:
                log.warning("no same-host ipc endpoint (same-host trainers use %s): %s", self.endpoint, err)
        if "0.0.0.0" in self.endpoint or "*" in self.endpoint:
            raise ConfigError(f"provider bound {bound}; set --advertise to the address trainers should connect to")
        # eval_per_dataset_day: what this provider charges a private test split's daily budget against
        # (the router keeps the budget, and shows what is left of it: ListPeers, busctl datasets, busctl web)
        caps = {
            "endpoint": self.endpoint,
            "datasets": self.handler.infos,
            "eval_per_dataset_day": self.handler.evalgate.per_dataset_day,
        }
        if self.server.config.curve is not None:
            caps["curve_key"] = self.server.config.curve.public.decode()
        self.link = Link(
            self.settings.router,
            credentials.identity(self.settings, "provider", self.name, caps),
            heartbeat_ms=self.settings.heartbeat_ms,
            liveness=self.settings.heartbeat_liveness,
            stats=self.beat_stats,
            ctx=self.ctx,
            limits=credentials.limits(self.settings),
            on_push=self._on_push,
        )
        self.link.start()
        log.info("provider %s serving %s on %s", self.name, ", ".join(self.handler.datasets), self.endpoint)
        return self.endpoint

    def _report(self, report: EvaluationReport) -> None:
        """A job's evaluation, told to the router (which records test scores only from providers)."""
        if self.link is None:
            raise Unavailable("not linked to the router yet")
        self.link.request(report, timeout_s=self.settings.request_timeout_s)

    def _charge(self, msg: ChargeEvaluation) -> EvaluationCharged:
        """One evaluation of a dataset's private test split, charged at the router (its budget and
        noise key are kept there for every replica and restart: services/router/eval_budget.py)."""
        if self.link is None:
            raise Unavailable("not linked to the router yet")
        return self.link.request(msg, timeout_s=self.settings.request_timeout_s)

    def _on_push(self, msg: Message) -> None:
        """The router's word on who may read (link thread): revoked tokens, assigned trainers."""
        if isinstance(msg, Entitlements):
            if msg.revoked is not None:  # None: the list is the one the last push on this session carried
                self.server.set_revoked(msg.revoked)
            self.handler.set_assigned(msg.assigned)

    def beat_stats(self) -> ProviderBeat:
        """What its heartbeats carry: the data server's figures, then the handler's."""
        return {**self.server.stats(), **self.handler.stats()}

    def stats(self) -> ProviderRow:
        """Its heartbeat stats, plus whether the router link is up (the metrics)."""
        return {**self.beat_stats(), "connected": self.link is not None and self.link.connected.is_set()}

    def run(self, stop: threading.Event, on_loop: Callable[[], None] | None = None) -> None:
        """Serve until ``stop``; ``on_loop`` runs every turn of the serving loop (the watchdog)."""
        watcher = threading.Thread(target=self._watch_link, args=(stop,), daemon=True)
        watcher.start()
        try:
            self.server.run(stop, on_loop)
        finally:
            if self.metrics is not None:
                self.metrics.close()
            process.remove_local_endpoint(self.handler.local_endpoint)
            self.handler.close()
            if self.decode_cache is not None:
                self.decode_cache.close()
            if self.link is not None:
                self.link.close()

    def _watch_link(self, stop: threading.Event) -> None:
        """A router that refuses us for good (bad token) stops the provider with the reason."""
        while not stop.wait(0.2):
            if self.link is not None and self.link.fatal is not None:
                log.error("router refused provider %s: %s", self.name, self.link.fatal)
                stop.set()


def read_helpers(settings: Settings, datasets: dict[str, Source], uris: dict[str, str]) -> dict[str, ReadHelper]:
    """A read helper (a process of its own: read_helper.py) per remote dataset that shares the provider with
    another dataset (``remote_helper``), started by :meth:`ProviderService.start`."""
    if not settings.remote_helper or len(datasets) < 2:
        return {}
    return {
        name: ReadHelper(
            name,
            uris[name],
            threads=max(1, settings.remote_reads),
            cache_dir=settings.cache_dir,
            cache_limit=settings.cache_limit,
            user_modules=settings.user_modules,
            gc_freeze=settings.gc_freeze,
        )
        for name, source in datasets.items()
        if helped(source)
    }


def decode_cache(settings: Settings, name: str, datasets: dict[str, Source]) -> DecodeCache | None:
    """The decode cache the provider's pipelines share (``decode_cache_bytes``, ``decode_cache_disk_bytes``;
    its disk tier under ``<state_dir>/decode-cache/<name>``), bound to each pipeline; None when off."""
    if not settings.decode_cache_bytes and not settings.decode_cache_disk_bytes:
        return None
    disk = os.path.join(settings.state_dir, "decode-cache", name) if settings.decode_cache_disk_bytes else ""
    cache = DecodeCache(settings.decode_cache_bytes, settings.decode_cache_disk_bytes, disk)
    used = [n for n, s in datasets.items() if isinstance(s, Pipeline) and s.use_cache(cache, n)]
    log.info("decode cache: %s", ", ".join(used) if used else "no pipeline here has a deterministic stage to cache")
    return cache

"""Prometheus metrics: a router and a provider export their live counters on /metrics, the numbers
follow what was served and refused, and the endpoint goes away with the service."""

import gc
import re
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from libbus.errors import ConfigError, OutOfRange, SplitPrivate
from libbus.serve.metrics import LatencyHistogram, gc_pauses, parse_bind
from libbus.wire.messages import BatchRequest
from tests.support import busctl, run_service, scrape, value
from tests.support.cluster import Cluster


@pytest.fixture
def metered_router(make_settings):
    from services.router.app import RouterService

    settings = make_settings(bind="tcp://127.0.0.1:0", metrics_bind="127.0.0.1:0", name="router-m")
    running = run_service(RouterService(settings), settings)
    yield running
    running.shutdown()


def test_provider_counters_follow_what_was_served_and_refused(start_provider, client_for):
    running = start_provider("mnist=mock://mnist?n=600", metrics_bind="127.0.0.1:0", name="prov-m")
    metrics = running.service.metrics
    assert metrics is not None and metrics.port > 0
    client = client_for(running.endpoint)
    sizes = [8, 32, 5]
    for start, n in zip((0, 100, 300), sizes):
        client.request(BatchRequest(dataset="mnist", split="train", range=[start, start + n]))
    idx = np.array([3, 1, 4], dtype="<i8").tobytes()
    client.request(BatchRequest(dataset="mnist", split="val", frames=[idx]))
    with pytest.raises(OutOfRange):
        client.request(BatchRequest(dataset="mnist", split="train", range=[0, 601]))
    with pytest.raises(SplitPrivate):
        client.request(BatchRequest(dataset="mnist", split="test", range=[0, 1]))

    me = dict(service="provider", name="prov-m")
    # the server counts a reply once it has handed it to ZeroMQ: the client may hold it (and scrape)
    # a moment before the server thread gets to count it
    deadline = time.monotonic() + 5
    while value(s := scrape(metrics.url), "batchbus_messages_sent_total", **me) < 7:
        assert time.monotonic() < deadline, "the replies were never counted as sent"
        time.sleep(0.05)
    assert value(s, "batchbus_samples_served_total", dataset="mnist", **me) == sum(sizes) + 3
    assert value(s, "batchbus_batches_served_total", dataset="mnist", **me) == 4
    assert value(s, "batchbus_bytes_served_total", dataset="mnist", **me) == (sum(sizes) + 3) * (28 * 28 * 4 + 8)
    assert value(s, "batchbus_shm_batches_served_total", dataset="mnist", **me) == 0
    assert value(s, "batchbus_errors_total", code="OUT_OF_RANGE", **me) == 1
    assert value(s, "batchbus_errors_total", code="SPLIT_PRIVATE", **me) == 1
    assert value(s, "batchbus_refused_total", reason="split_private", **me) == 1
    assert value(s, "batchbus_batch_seconds_count", dataset="mnist", **me) == 4
    assert value(s, "batchbus_batch_seconds_bucket", dataset="mnist", le="+Inf", **me) == 4
    assert 0 < value(s, "batchbus_batch_seconds_sum", dataset="mnist", **me) < 5
    assert value(s, "batchbus_sessions_opened_total", **me) == 1 and value(s, "batchbus_sessions", **me) == 1
    # Hello + 6 batch requests, each answered.
    assert value(s, "batchbus_messages_received_total", **me) >= 7
    assert value(s, "batchbus_messages_sent_total", **me) >= 7
    assert value(s, "batchbus_router_connected", **me) == 1
    assert value(s, "batchbus_process_resident_memory_bytes") > 0

    # Counted live: one more batch shows up on the next scrape.
    client.request(BatchRequest(dataset="mnist", split="train", range=[0, 2]))
    s = scrape(metrics.url)
    assert value(s, "batchbus_samples_served_total", dataset="mnist", **me) == sum(sizes) + 5

    running.shutdown()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(metrics.url, timeout=2)


def test_router_exports_sessions_peers_and_jobs(metered_router, make_settings, client_for):
    from services.provider.app import ProviderService

    settings = make_settings(router=metered_router.endpoint, datasets=["mnist=mock://mnist?n=60"])
    provider = run_service(ProviderService(settings), settings)
    try:
        assert provider.service.link.wait_connected(10)
        assert provider.service.metrics is None  # off unless metrics_bind is set
        s = scrape(metered_router.service.metrics.url)
    finally:
        provider.shutdown()
    me = dict(service="router", name="router-m")
    assert value(s, "batchbus_peers", role="provider", **me) == 1
    assert value(s, "batchbus_sessions", **me) == 1
    assert value(s, "batchbus_messages_received_total", **me) >= 1
    assert not [k for k in s if k[0] == "batchbus_jobs"]  # no jobs yet: no job states to report


def test_metrics_bind_is_host_and_port():
    assert parse_bind("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_bind("[::1]:0") == ("::1", 0)
    for bad in ("9464", "localhost", ":9464", "host:port", "h:70000"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            parse_bind(bad)


def test_latency_histogram_buckets_are_cumulative():
    h = LatencyHistogram((0.001, 0.01))
    for seconds in (0.0005, 0.001, 0.005, 3.0):
        h.observe(seconds)
    buckets, total = h.snapshot()
    assert buckets == [("0.001", 2), ("0.01", 3), ("+Inf", 4)] and total == pytest.approx(3.0065)


def test_busctl_start_takes_metrics_bind(tmp_path):
    out = busctl(
        "start",
        "router",
        "--bind",
        "tcp://127.0.0.1:0",
        "--metrics-bind",
        "nowhere",
        env={"BATCHBUS_STATE_DIR": str(tmp_path)},
        timeout=30,
    )
    assert out.returncode != 0 and "metrics_bind must be HOST:PORT" in out.stderr + out.stdout


def test_trainer_exports_its_link_and_jobs(router, make_settings):
    from services.trainer.service.app import TrainerService

    service = TrainerService(make_settings(router=router.endpoint, name="trainer-m", metrics_bind="127.0.0.1:0"))
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    try:
        assert service.link.wait_connected(10)
        deadline = time.monotonic() + 5
        while service.metrics is None and time.monotonic() < deadline:
            time.sleep(0.01)
        url = service.metrics.url
        s = scrape(url)
    finally:
        stop.set()
        thread.join(15)
    me = dict(service="trainer", name="trainer-m")
    assert value(s, "batchbus_router_connected", **me) == 1
    assert value(s, "batchbus_trainer_job_running", **me) == 0
    assert value(s, "batchbus_trainer_data_wait_seconds_total", **me) == 0  # the data stall, none yet
    assert not thread.is_alive()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)


def test_each_garbage_collection_is_timed_by_its_generation():
    pauses = gc_pauses()
    assert gc_pauses() is pauses and gc.callbacks.count(pauses) == 1  # one per process, however many ask
    counts = [h.snapshot()[0][-1][1] for h in pauses.by_generation]
    gc.collect(0)
    gc.collect()
    after = [h.snapshot()[0][-1][1] for h in pauses.by_generation]
    assert after[0] >= counts[0] + 1 and after[2] >= counts[2] + 1
    assert pauses.by_generation[2].sum > 0


def _metrics_url(cluster: Cluster, name: str) -> str:
    """Where service ``name`` (started with ``--metrics-bind 127.0.0.1:0 --log-level INFO``) serves /metrics."""
    deadline = time.monotonic() + 30
    while not (found := re.search(r"metrics on (http://\S+/metrics)", (cluster.state / f"{name}.log").read_text())):
        assert time.monotonic() < deadline and cluster.procs[name].poll() is None, cluster.logs()
        time.sleep(0.05)
    return found.group(1)


@pytest.mark.parametrize("freeze", [True, False])
def test_started_services_keep_their_start_up_out_of_every_collection(tmp_path, freeze):
    """``busctl start`` freezes what start-up built: a full collection, which stops every thread,
    walks only what serving made since. Its /metrics say how many objects that is, and time each
    collection. ``gc_freeze = false`` (for a before-and-after) leaves them in. A provider and a trainer
    (which starts otherwise) both."""
    cluster = Cluster(tmp_path / "state", env={} if freeze else {"BATCHBUS_GC_FREEZE": "false"})
    metered = ("--metrics-bind", "127.0.0.1:0", "--log-level", "INFO")
    try:
        cluster.start_router()
        cluster.start("prov", "provider", "--dataset", "mnist=mock://mnist?n=60", *metered, ready=True)
        cluster.endpoint_of("prov")
        cluster.start("trn", "trainer", *metered)
        provider, trainer = scrape(_metrics_url(cluster, "prov")), scrape(_metrics_url(cluster, "trn"))
    finally:
        cluster.close()
    s, me = provider, dict(service="provider", name="prov")
    if not freeze:
        assert value(s, "batchbus_gc_frozen_objects", **me) == 0
        assert value(trainer, "batchbus_gc_frozen_objects", service="trainer", name="trn") == 0
        return
    # numpy, zmq, the CLI, the sources: tens of thousands of objects (about 70,000 measured)
    assert value(s, "batchbus_gc_frozen_objects", **me) > 10_000
    assert value(trainer, "batchbus_gc_frozen_objects", service="trainer", name="trn") > 10_000
    # the collection before the freeze, timed
    assert value(s, "batchbus_gc_pause_seconds_count", generation="2", **me) >= 1
    assert value(s, "batchbus_gc_pause_seconds_sum", generation="2", **me) > 0

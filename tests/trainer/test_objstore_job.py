"""An mlp trains through router, provider and trainer on IDX files in a
bucket of a loopback S3 server, the provider's credentials and endpoint taken from ``AWS_*`` variables,
its reads going through its disk cache; the cache and request counters show in its stats and metrics."""

import time

import numpy as np
import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from libbus.errors import Unavailable
from libbus.serve.metrics import StatsCollector
from libbus.wire.messages import BatchRequest, DatasetInfoRequest, Stats, SubmitJob
from services.provider.metrics import provider_metrics
from services.provider.sources.objstore import configure_cache
from services.provider.sources.storage.objects import STATS
from tests.support import wait_job
from tests.support.formats import write_mnist_idx
from tests.support.s3server import s3_in_env


@pytest.fixture(scope="module")
def s3():
    with s3_in_env() as server:
        yield server
    configure_cache("", 0)  # the providers here set the process's default cache: unset it for later tests


def test_a_job_trains_on_a_dataset_read_from_s3(s3, tmp_path, router, start_provider, trainer, client_for):
    data = write_mnist_idx(tmp_path / "mnist")
    s3.put_dir("datasets", "mnist", data)

    cache = tmp_path / "cache"
    failures = STATS["failures"]  # process-wide counters: other tests in this process count too
    provider = start_provider("digits=s3://datasets/mnist/", cache_dir=str(cache), cache_limit=64 << 20)
    info = client_for(provider.endpoint).request(DatasetInfoRequest(dataset="digits")).info
    assert (info["format"], info["store"], info["sample_shape"]) == ("idx", "s3", [1, 28, 28])
    assert s3.secret_key not in str(info) and s3.access_key not in str(info)

    admin = client_for(router.endpoint, role="admin")
    spec = {"dataset": "digits", "model": "mlp", "epochs": 2, "batch_size": 32, "lr": 3e-3, "seed": 0}
    job = admin.request(SubmitJob(spec=spec)).job
    done = wait_job(admin, job, timeout=90)
    assert done["state"] == "succeeded", done.get("error")
    assert done["result"]["val_accuracy"] > 0.5  # chance is 0.1: it learned from what it read

    stats = provider.service.handler.stats()["object_store"]
    cached = stats["caches"][str(cache.resolve())]
    assert stats["requests"] >= 1 and stats["failures"] == failures
    assert cached["hits"] > cached["misses"] > 0 and 0 < cached["bytes"] <= 64 << 20
    # what `busctl queues` prints: the provider's stats as its heartbeats carry them to the router
    deadline = time.monotonic() + 10
    while not any("object_store" in v for v in admin.request(Stats()).services.values()):
        assert time.monotonic() < deadline, "no object_store stats reached the router"
        time.sleep(0.1)
    registry = CollectorRegistry()
    registry.register(StatsCollector("provider", "p", provider.service.handler.stats, provider_metrics()))
    text = generate_latest(registry).decode()
    assert "batchbus_object_cache_hits_total" in text and "batchbus_object_requests_total" in text
    assert s3.secret_key not in text and s3.access_key not in text


def test_a_store_that_keeps_failing_fails_the_batch_unavailable_naming_the_object(
    s3, tmp_path, start_provider, client_for
):
    tokens = np.arange(32 * 16, dtype=np.uint16)
    s3.s3.create_bucket(Bucket="flaky")
    s3.s3.put_object(Bucket="flaky", Key="tok/shard-00.bin", Body=tokens.tobytes())
    provider = start_provider("web=s3://flaky/tok/?seq_len=15&token_bytes=2&retries=2&backoff=0.01&val_fraction=0")
    client = client_for(provider.endpoint)
    idx = np.array([2, 1], "<i8")  # adjacent: one request, failed 3 times (retries=2)
    s3.faults = [(503, "SlowDown")] * 3
    with pytest.raises(
        Unavailable, match=r"GET s3://flaky/tok/shard-00.bin \(bytes 32-95\): HTTP 503 SlowDown \(gave up after 3"
    ):
        client.request(BatchRequest(dataset="web", split="train", frames=[idx.tobytes()]))
    # the store recovers: the provider serves again, the right bytes
    reply = client.request(BatchRequest(dataset="web", split="train", frames=[idx.tobytes()]))
    x = np.frombuffer(reply.frames[0].buffer, reply.dtypes[0]).reshape(reply.shapes[0])
    assert np.array_equal(x, tokens.reshape(32, 16)[idx])

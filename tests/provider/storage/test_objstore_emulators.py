"""``gs://`` and ``az://`` against real servers (tests/support/emulators.py): fake-gcs-server and Azurite on
loopback, the provider's endpoint and credentials taken from each cloud's standard variables
(``STORAGE_EMULATOR_HOST``; ``AZURE_STORAGE_CONNECTION_STRING``). The source contract over each, layouts
read by range there as from local files, a refused key named without the key, a missing bucket named, and
a job trained on a bucket of each."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from libbus.errors import DatasetError
from libbus.wire.messages import DatasetInfoRequest, SubmitJob
from services.provider.sources import open_source
from services.provider.sources.objstore import configure_cache
from tests.support import wait_job
from tests.support.contract import check_source_contract
from tests.support.emulators import Azurite, GcsEmulator, in_env
from tests.support.formats import build_idx, build_npy, build_tokens_bin, expected_splits, write_mnist_idx
from tests.support.images import write_shards

STORES = ["gs", "az"]


@pytest.fixture(scope="module")
def gs():
    server = GcsEmulator()
    with in_env(server):
        yield server
    server.close()


@pytest.fixture(scope="module")
def az():
    server = Azurite()
    with in_env(server):
        yield server
    server.close()


def put(request, scheme: str, bucket: str, prefix: str, folder: Path) -> str:
    """Upload ``folder`` to the ``scheme`` server; the URI of that prefix."""
    request.getfixturevalue(scheme).put_dir(bucket, prefix, folder)
    return f"{scheme}://{bucket}/{prefix}/?retries=2&backoff=0.01"


def write_parquet(d: Path, rng) -> dict:
    """A hub's export: data/train-*.parquet and data/validation-*.parquet in small row groups."""
    (d / "data").mkdir(parents=True)
    ref = {}
    for split, n, name in (("train", 30, "train-00000-of-00001"), ("val", 8, "validation-00000-of-00001")):
        ids = rng.integers(0, 1000, (n, 6)).astype(np.int32)
        labels = rng.integers(0, 3, n).astype(np.int64)
        labels[0] = 2
        table = pa.table({"input_ids": pa.array([r.tolist() for r in ids], pa.list_(pa.int32())), "label": labels})
        pq.write_table(table, d / "data" / f"{name}.parquet", row_group_size=7)
        ref[split] = (ids, labels)
    return ref


@pytest.mark.parametrize("scheme", STORES)
@pytest.mark.parametrize("layout", ["npy", "idx", "tokens", "parquet"])
def test_a_bucket_keeps_the_source_contract(scheme, layout, tmp_path, request):
    """The same samples from the emulator's bucket as from the files written here, read by range."""
    d, rng = tmp_path / layout, np.random.default_rng(7)
    d.mkdir()
    if layout == "parquet":
        query, reference = "val_fraction=0", write_parquet(d, rng)
    else:
        built = {"npy": build_npy, "idx": build_idx, "tokens": build_tokens_bin}[layout](d, rng)
        query, reference = built.query.lstrip("&"), expected_splits(built)
    uri = put(request, scheme, "contract", f"{tmp_path.name}-{layout}", d) + f"&{query}"
    source = open_source(uri)
    try:
        assert source.info()["store"] == scheme
        check_source_contract(source, reference)
    finally:
        source.close()


@pytest.mark.parametrize("scheme", STORES)
def test_webdataset_shards_are_indexed_and_read_by_range(scheme, tmp_path, request, monkeypatch):
    """Image shards: each shard's index kept under its ETag, the images decoded on the provider."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    write_shards(tmp_path / "wds", "train", shards=2, per_shard=5)
    source = open_source(put(request, scheme, "images", tmp_path.name, tmp_path / "wds") + "&size=8&workers=2")
    try:
        assert source.info()["format"] == "webdataset"
        check_source_contract(source)  # decoded images: (x, y), the local files their reference
    finally:
        source.close()
    assert list((tmp_path / "xdg").rglob("*")), "no shard index was kept"


def test_a_wrong_azure_key_is_refused_naming_the_variable_not_the_key(az, tmp_path, monkeypatch):
    d = tmp_path / "npy"
    d.mkdir()
    build_npy(d, np.random.default_rng(1))
    az.put_dir("private", "npy", d)
    wrong = "A" * 86 + "=="  # a well-formed key the server does not hold
    for k, v in az.env(key=wrong).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(DatasetError) as err:
        open_source("az://private/npy/?retries=0").close()
    text = str(err.value)
    assert "LIST az://private/npy/: refused (403" in text and "AZURE_STORAGE_CONNECTION_STRING" in text
    assert wrong not in text and az.key not in text


def test_a_connection_string_without_an_account_is_named(az, monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountKey=abc;BlobEndpoint=http://127.0.0.1:1/x")
    with pytest.raises(DatasetError, match="AZURE_STORAGE_CONNECTION_STRING names no AccountName"):
        open_source("az://any/thing/")


@pytest.mark.parametrize("scheme", STORES)
def test_a_missing_bucket_is_named(scheme, request):
    request.getfixturevalue(scheme)
    with pytest.raises(DatasetError, match=rf"{scheme}://no-such-bucket"):
        open_source(f"{scheme}://no-such-bucket/data/?retries=0").close()


@pytest.fixture
def forget_cache():
    yield
    configure_cache("", 0)  # the providers here set the process's default cache: unset it for later tests


@pytest.mark.parametrize("scheme", STORES)
def test_a_job_trains_on_a_dataset_read_from_the_emulator(
    scheme, tmp_path, request, router, start_provider, trainer, client_for, forget_cache
):
    server = request.getfixturevalue(scheme)
    data = write_mnist_idx(tmp_path / "mnist")
    server.put_dir("datasets", "mnist", data)

    cache = tmp_path / "cache"
    provider = start_provider(f"digits={scheme}://datasets/mnist/", cache_dir=str(cache), cache_limit=64 << 20)
    info = client_for(provider.endpoint).request(DatasetInfoRequest(dataset="digits")).info
    assert (info["format"], info["store"], info["sample_shape"]) == ("idx", scheme, [1, 28, 28])
    if scheme == "az":
        assert server.key not in str(info)

    admin = client_for(router.endpoint, role="admin")
    spec = {"dataset": "digits", "model": "mlp", "epochs": 2, "batch_size": 32, "lr": 3e-3, "seed": 0}
    done = wait_job(admin, admin.request(SubmitJob(spec=spec)).job, timeout=90)
    assert done["state"] == "succeeded", done.get("error")
    assert done["result"]["val_accuracy"] > 0.5  # chance is 0.1: it learned from what it read
    cached = provider.service.handler.stats()["object_store"]["caches"][str(cache.resolve())]
    assert cached["hits"] > cached["misses"] > 0


@pytest.mark.parametrize(
    "scheme, env, host",
    [
        ("az", {"AZURE_STORAGE_CONNECTION_STRING": "UseDevelopmentStorage=true"}, "127.0.0.1:10000"),
        (
            "az",
            {
                "AZURE_STORAGE_CONNECTION_STRING": "DefaultEndpointsProtocol=https;AccountName=acct;"
                "AccountKey=" + "A" * 86 + "==;EndpointSuffix=core.chinacloudapi.cn"
            },
            "acct.blob.core.chinacloudapi.cn",
        ),
        ("gs", {"STORAGE_EMULATOR_HOST": "localhost:4443"}, "localhost:4443"),  # no scheme: http, as Google's libraries
    ],
)
def test_each_clouds_variables_name_the_endpoint(scheme, env, host, monkeypatch):
    """Where requests go, from the variables alone (no request is sent: the client is only configured)."""
    from services.provider.sources.storage.obstore_backend import ObstoreBackend

    for k in ("AZURE_STORAGE_CONNECTION_STRING", "STORAGE_EMULATOR_HOST"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert ObstoreBackend(scheme, "bucket", 5.0).host == host

"""An ``http://`` dataset's range reads go through obstore (off the GIL) against a real range server on
127.0.0.1 (tests/support/httpd.py) that answers after a delay: the bytes are the files', every run is one
ranged GET, and a server that refuses ranges, loses a file or redirects elsewhere fails the batch with a
message naming the URL, while the provider keeps answering. Hosts outside the dataset's origins are never
reached, redirects or not; URLs obstore would not request as written still read through ``http.client``."""

from __future__ import annotations

import numpy as np
import pytest

from libbus.errors import DatasetError, Unavailable
from libbus.wire.messages import BatchRequest, DatasetInfo, DatasetInfoRequest
from services.provider.sources import open_source
from services.provider.sources.storage.inflight import InflightLimit, Slots
from tests.support.held_store import batch, npy_pair, server_fixture  # noqa: F401 - the `server` fixture
from tests.support.httpd import RangeServer

FAST = "retries=1&backoff=0.01&timeout=10&val_fraction=0"


def test_a_delayed_server_is_read_through_obstore_one_get_per_run(tmp_path, server):
    x, y = npy_pair(tmp_path / "d", 64, 1)
    src = open_source(f"{server.url}/d/?coalesce=0&concurrency=8&{FAST}")
    assert src.location.client.ranges is not None, "obstore is installed: range reads must go through it"
    server.delay_s = 0.05  # a store's first byte, late
    before = len(server.gets())
    idx = np.array([60, 2, 40, 12, 30, 50, 9, 55, 21, 0, 33, 47, 17, 5])
    bx, by = src.read("train", idx)
    assert np.array_equal(bx, x[idx]) and np.array_equal(by, y[idx])
    gets = server.gets()[before:]
    assert len(gets) == 2 * len(idx), gets  # one ranged GET per sample and file, none coalesced
    assert server.max_inflight > 1, "the runs of one batch were fetched one after another"
    src.close()


def test_a_server_that_refuses_ranges_or_loses_a_file_fails_the_read_naming_the_url(tmp_path, server):
    npy_pair(tmp_path / "d", 32, 2)
    src = open_source(f"{server.url}/d/?{FAST}")
    server.no_ranges = True
    with pytest.raises(
        DatasetError, match=rf"GET {server.url}/d/train_\w\.npy \(bytes=\d+-\d+\): HTTP 200 instead of 206"
    ):
        src.read("train", np.array([3]))
    server.no_ranges = False
    (tmp_path / "d" / "train_y.npy").rename(tmp_path / "d" / "moved.npy")
    with pytest.raises(DatasetError, match=rf"GET {server.url}/d/train_y\.npy \(bytes=\d+-\d+\): HTTP 404$") as err:
        src.read("train", np.array([3]))  # a missing file is not retried: "after 2 attempts" would follow
    assert err.value.code == "UNAVAILABLE"
    src.close()


def test_a_redirect_leads_nowhere_outside_the_datasets_origins(tmp_path, server):
    """Redirects that appear after the dataset opened: to another host, not sent at all (the batch fails
    naming the URL); to an origin the operator allowed, followed."""
    x, _ = npy_pair(tmp_path / "d", 32, 3)
    elsewhere = RangeServer(tmp_path)  # the same files, reached as "localhost": another host to the dataset
    try:
        away = elsewhere.url.replace("127.0.0.1", "localhost")
        src = open_source(f"{server.url}/d/?{FAST}")
        allowed = open_source(f"{server.url}/d/?{FAST}&allow_origins={away}")
        server.redirects = {"/d/": f"{away}/d/"}
        with pytest.raises(DatasetError, match=rf"GET {server.url}/d/train_x\.npy .*outside the dataset's origins"):
            src.read("train", np.array([5]))
        assert elsewhere.requests == [], "a request reached a host outside the dataset's origins"
        assert np.array_equal(allowed.read("train", np.array([5]))[0], x[[5]])
        assert elsewhere.gets(), "the allowed origin was not asked"

        src.close(), allowed.close()
    finally:
        elsewhere.close()


def test_percent_encoded_urls_are_read_through_http_client(tmp_path, server):
    """Files whose URLs are percent-encoded (``a%20b.bin``: obstore would encode the ``%`` again and ask
    for another file) are read through ``http.client``, as written, with the same bytes."""
    (tmp_path / "tok").mkdir()
    tokens = np.random.default_rng(4).integers(0, 60000, 400).astype("<u2")
    (tmp_path / "tok" / "s%2000.bin").write_bytes(tokens[:200].tobytes())  # the server does not decode paths
    (tmp_path / "tok" / "s%2001.bin").write_bytes(tokens[200:].tobytes())
    (tmp_path / "tok" / "list.txt").write_text("s%2000.bin\ns%2001.bin\n")
    src = open_source(f"{server.url}/tok/?manifest=list.txt&seq_len=9&token_bytes=2&coalesce=0&{FAST}")
    before = len(server.gets())
    idx = np.array([30, 1, 25])
    assert np.array_equal(src.read("train", idx)[0], tokens.reshape(40, 10)[idx])
    assert {p for p, _ in server.gets()[before:]} == {"/tok/s%2000.bin", "/tok/s%2001.bin"}
    src.close()


def test_the_provider_keeps_answering_while_its_http_dataset_fails(tmp_path, server, start_provider, client_for):
    remote_x, remote_y = npy_pair(tmp_path / "web", 32, 5)
    local_x, _ = npy_pair(tmp_path / "disk", 16, 6)
    provider = start_provider(f"web={server.url}/web/?{FAST}", f"disk=file://{tmp_path / 'disk'}?val_fraction=0")
    client = client_for(provider.endpoint, timeout_s=30.0)
    idx = np.array([31, 4, 17], "<i8")
    server.no_ranges = True
    with pytest.raises(Unavailable, match=rf"{server.url}/web/train_\w\.npy .*does not serve byte ranges"):
        client.request(BatchRequest(dataset="web", split="train", frames=[idx.tobytes()]))
    info = client.request(DatasetInfoRequest(dataset="web"))
    assert isinstance(info, DatasetInfo) and info.info["splits"]["train"]["num_samples"] == 32
    x, _ = batch(client.request(BatchRequest(dataset="disk", split="train", frames=[idx[1:2].tobytes()])), 1)
    assert np.array_equal(x, local_x[idx[1:2]])
    server.no_ranges = False
    x, y = batch(client.request(BatchRequest(dataset="web", split="train", frames=[idx.tobytes()])), 3)
    assert np.array_equal(x, remote_x[idx]) and np.array_equal(y, remote_y[idx])


def test_a_bundle_takes_its_places_together_and_one_larger_than_the_limit_runs_alone():
    """A bundle of ranges sent by one call holds as many places as it has ranges, all or none: it never
    holds some while waiting for the rest (two half-placed bundles would wait on each other for ever);
    one larger than the whole limit runs when nothing else does. The host's places behave alike."""
    limit = InflightLimit(start=4, cap=4)
    assert limit.acquire(0, n=3) and limit.inflight == 3
    assert not limit.acquire(0.01, n=2) and limit.inflight == 3  # two do not fit: none taken
    assert limit.acquire(0, n=1) and limit.inflight == 4
    limit.release(1024, n=3)
    assert not limit.acquire(0.01, n=9)  # larger than the limit: waits while anything is in flight
    limit.release(1024)
    assert limit.acquire(0, n=9) and limit.inflight == 9
    limit.release(9 * 1024, n=9)
    assert limit.inflight == 0

    host = Slots(3)
    assert host.acquire(2) and not host.acquire(2, timeout=0.01)
    host.release(2)
    assert host.acquire(5) and not host.acquire(1, timeout=0.01)
    host.release(5)
    with host:
        assert host.acquire(2, timeout=0) and not host.acquire(1, timeout=0.01)

"""http:// sources against a real HTTP server on 127.0.0.1 (tests/support/httpd.py): token shards named by a
range, .npy pairs and raw arrays found by probing, a manifest; the bytes equal what file:// reads
from the same files; one Range request per contiguous run, several in flight but never more than
``concurrency``, over few keep-alive connections; dropped connections retried, and errors that name
the URL and the status when retries run out or a body comes back short; and a provider serving an
HTTP dataset through the real services."""

from __future__ import annotations

import datetime
import ipaddress
import textwrap
import threading
import time

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from libbus.errors import BusError, DatasetError, Unavailable
from libbus.loader.remote import RemoteLoader
from libbus.order.epochs import epoch_order
from libbus.wire.messages import BatchRequest, DatasetInfoRequest
from services.provider.sources import open_source
from services.provider.sources.http import expand_template
from services.provider.sources.storage.inflight import InflightLimit
from tests.support.httpd import RangeServer

FAST = "retries=2&backoff=0.01&timeout=5"


@pytest.fixture
def server(tmp_path):
    srv = RangeServer(tmp_path)
    yield srv
    srv.close()


def write_shards(d, rng, sizes=(100, 37, 80, 64)):
    d.mkdir(exist_ok=True)
    tokens = rng.integers(0, 60000, sum(sizes)).astype("<u2")
    at = 0
    for i, n in enumerate(sizes):
        (d / f"shard-{i:02d}.bin").write_bytes(tokens[at : at + n].tobytes())
        at += n
    return tokens


def test_template_ranges_expand_in_number_order():
    assert expand_template("http://h/s-{08..11}.bin") == [f"http://h/s-{i:02d}.bin" for i in (8, 9, 10, 11)]
    assert expand_template("http://h/{9..10}.ds") == ["http://h/9.ds", "http://h/10.ds"]
    assert expand_template("http://h/a.bin") == ["http://h/a.bin"]
    with pytest.raises(DatasetError, match="must run upwards"):
        expand_template("http://h/{3..1}.bin")
    with pytest.raises(DatasetError, match="one {A..B} range per URL"):
        expand_template("http://h/{0..1}/{0..1}.bin")


def test_token_shards_by_range_read_as_file_does(tmp_path, server):
    write_shards(tmp_path / "tok", np.random.default_rng(1))
    uri = f"{server.url}/tok/shard-{{00..03}}.bin?seq_len=15&token_bytes=2&{FAST}"
    remote = open_source(uri)
    local = open_source(f"file://{tmp_path / 'tok'}?seq_len=15&token_bytes=2&memory=stream")
    assert remote.info()["format"] == "tokens" and remote.num_samples("train") == local.num_samples("train") == 15
    assert remote.info()["path"] == f"{server.url}/tok/"
    idx = np.array([14, 0, 3, 3, 7, 6, 5, 13, 1], np.int64)  # unsorted, a duplicate, samples across shards
    assert np.array_equal(remote.read("train", idx)[0], local.read("train", idx)[0])
    assert np.array_equal(remote.read("val", np.arange(2))[0], local.read("val", np.arange(2))[0])

    before = len(server.gets())
    remote.read("train", np.arange(0, 6))  # 96 tokens inside shard 00: one run, one request
    assert server.gets()[before:] == [("/tok/shard-00.bin", "bytes=0-191")]
    before = len(server.gets())
    x = remote.read("train", np.array([0, 1, 4, 2]))[0]  # runs 0-2 and 4, 32 bytes apart: coalesced
    assert server.gets()[before:] == [("/tok/shard-00.bin", "bytes=0-159")]
    assert np.array_equal(x, local.read("train", np.array([0, 1, 4, 2]))[0])
    apart = open_source(uri + "&coalesce=0")  # no gap is small enough: one request per run
    before = len(server.gets())
    assert np.array_equal(apart.read("train", np.array([0, 1, 4, 2]))[0], x)
    assert sorted(server.gets()[before:]) == [
        ("/tok/shard-00.bin", "bytes=0-95"),
        ("/tok/shard-00.bin", "bytes=128-159"),
    ]
    apart.close()
    # sizes learned once, at open: no HEAD after it; requests reuse their thread's keep-alive connection
    heads = [r for r in server.requests if r[0] == "HEAD"]
    assert len(heads) == 8  # 4 shards, each opened twice (remote, apart)
    connections, before = server.connections, len(server.requests)
    for i in range(20):
        remote.read("train", np.array([i % 6]))  # one run in shard 00: read on the calling thread
    assert len(server.requests) - before == 20 and server.connections == connections


def test_a_range_in_a_folder_name_keeps_every_file(tmp_path, server):
    rng = np.random.default_rng(15)
    parts = [rng.integers(0, 999, 20).astype("<u2") for _ in range(3)]
    for i, part in enumerate(parts):
        (tmp_path / "days" / f"{i}").mkdir(parents=True)
        (tmp_path / "days" / f"{i}" / "data.bin").write_bytes(part.tobytes())
    src = open_source(f"{server.url}/days/{{0..2}}/data.bin?seq_len=9&token_bytes=2&val_fraction=0&{FAST}")
    assert np.array_equal(src.read("train", np.arange(6))[0], np.concatenate(parts).reshape(6, 10))


def test_runs_are_fetched_concurrently_within_the_bound(tmp_path, server):
    write_shards(tmp_path / "tok", np.random.default_rng(2), sizes=(2000,))
    src = open_source(f"{server.url}/tok/shard-00.bin?seq_len=9&token_bytes=2&concurrency=3&coalesce=0&{FAST}")
    server.delay_s = 0.3
    idx = np.arange(0, 160, 10)  # 16 separate runs
    x, _ = src.read("train", idx)
    assert 2 <= server.max_inflight <= 3
    tokens = np.frombuffer((tmp_path / "tok" / "shard-00.bin").read_bytes(), "<u2")
    assert np.array_equal(x, tokens[:1600].reshape(160, 10)[idx])


def test_requests_in_flight_climb_while_throughput_does_within_the_cap(tmp_path, server):
    """Without an operator's fixed ``concurrency``, a dataset starts at ``concurrency`` requests in flight
    and climbs while the bytes per second climb (a store that takes 100 ms per GET delivers twice as
    much with twice as many in flight), never past ``max_concurrency``; a store that answers 503
    (throttled) halves it."""
    write_shards(tmp_path / "tok", np.random.default_rng(2), sizes=(8000,))
    tokens = np.frombuffer((tmp_path / "tok" / "shard-00.bin").read_bytes(), "<u2")
    src = open_source(
        f"{server.url}/tok/shard-00.bin?seq_len=9&token_bytes=2&val_fraction=0&concurrency=2&max_concurrency=6&coalesce=0&{FAST}"
    )
    limit = src.location.client.inflight  # the dataset's InflightLimit
    server.delay_s = 0.1
    idx = np.arange(0, 800, 4)  # 200 separate runs of one sample (coalesce=0 keeps them apart)
    for _ in range(2):
        x, _ = src.read("train", idx)
        assert np.array_equal(x, tokens.reshape(800, 10)[idx])
    # it climbed (the store saw more than the start in flight at once), within the cap; where it stands
    # at the end follows the last windows' bytes per second, which a loaded machine's scheduling moves
    assert 2 < server.max_inflight <= 6 and 1 <= limit.limit <= 6
    src.close()


def test_a_ram_cache_reads_whole_blocks_once_and_serves_a_full_shuffle_from_them(tmp_path, server):
    """``ram_cache``: samples come from whole blocks fetched once; a second full-shuffle pass asks the
    store for nothing; a smaller cache never holds more than its limit and still reads right."""
    tokens = write_shards(tmp_path / "tok", np.random.default_rng(21), sizes=(5000,))  # 10,000 bytes
    query = f"seq_len=9&token_bytes=2&val_fraction=0&block=1024&{FAST}"
    src = open_source(f"{server.url}/tok/shard-00.bin?{query}&ram_cache=16384")
    want = tokens.reshape(500, 10)
    before = len(server.gets())
    for epoch in range(2):
        order = np.random.default_rng(epoch).permutation(500)
        for idx in np.array_split(order, 10):
            assert np.array_equal(src.read("train", idx)[0], want[idx])
        if epoch == 0:  # every block of the file, each fetched whole, once
            gets = sorted(r for _, r in server.gets()[before:])
            assert gets == sorted(f"bytes={b * 1024}-{min(b * 1024 + 1023, 9999)}" for b in range(10))
            before = len(server.gets())
    assert len(server.gets()) == before, "the second pass went to the store"
    memory = src.location.client.memory
    assert memory.held == 10000 and memory.stats()["ram_cache_fetches"] == 10
    small = open_source(f"{server.url}/tok/shard-00.bin?{query}&ram_cache=3072")
    for idx in np.array_split(np.random.default_rng(5).permutation(500), 25):
        assert np.array_equal(small.read("train", idx)[0], want[idx])
        assert small.location.client.memory.held <= 3072
    assert small.location.client.memory.evictions > 0
    src.close(), small.close()


def test_a_block_asked_for_while_it_is_fetched_is_fetched_once(tmp_path, server):
    tokens = write_shards(tmp_path / "tok", np.random.default_rng(22), sizes=(5000,))
    src = open_source(
        f"{server.url}/tok/shard-00.bin?seq_len=9&token_bytes=2&val_fraction=0&block=4096&ram_cache=65536&timeout=60"
    )
    server.hold()
    before = len(server.gets())
    got: dict[int, np.ndarray] = {}
    readers = [
        threading.Thread(target=lambda i=i: got.setdefault(i, src.read("train", np.array([i]))[0])) for i in (3, 7)
    ]
    deadline = time.monotonic() + 30
    readers[0].start()
    while server.inflight < 1:
        assert time.monotonic() < deadline, "the first read never reached the store"
        time.sleep(0.01)
    readers[1].start()  # sample 7 lies in the block being fetched for sample 3: it waits for that fetch
    while src.location.client.memory.joined < 1:
        assert time.monotonic() < deadline, f"the second read did not wait for the fetch: {server.gets()[before:]}"
        time.sleep(0.01)
    server.release()
    for t in readers:
        t.join(30)
    assert len(server.gets()) - before == 1
    assert np.array_equal(got[3], tokens.reshape(500, 10)[[3]]) and np.array_equal(got[7], tokens.reshape(500, 10)[[7]])
    src.close()


def test_an_inflight_limit_bounds_waits_and_halves_when_throttled():
    limit = InflightLimit(start=4, cap=16)
    assert all(limit.acquire(0) for _ in range(4)) and limit.inflight == 4
    assert not limit.acquire(0.01)  # full: a request waits, bounded
    limit.release(1024, throttled=True)  # a 429 or 503: the store asks for less
    assert limit.limit == 2 and limit.inflight == 3
    assert not limit.acquire(0.01)  # three in flight, two allowed: none more until two end
    limit.release(1024), limit.release(1024)
    assert limit.acquire(0.01) and limit.inflight == 2


def test_a_step_down_that_cost_throughput_is_taken_back_and_one_that_did_not_is_kept():
    """The limit's verdict per window of requests (the rate in bytes per second): a rate that fell at the
    same limit steps it down; the next window judges that step against the window before it. A rate lower
    again says the limit was holding the dataset back (it was not the store), and the step is taken back;
    without that, each window at the smaller limit looked worse than the last and the limit ratcheted
    down to its start. A rate as before (the store is busier) keeps the step."""
    bound = InflightLimit(start=8, cap=128)
    bound.limit, bound._last_rate = 64, 100e6
    bound._step(80e6)  # worse at the same limit
    assert bound.limit == 51
    bound._step(64e6)  # worse again at the smaller limit: the limit held it back
    assert bound.limit == 64
    for rate in (64e6, 64e6, 64e6):  # steady afterwards: no further step down
        bound._step(rate)
    assert bound.limit == 64

    busy = InflightLimit(start=8, cap=128)
    busy.limit, busy._last_rate = 64, 100e6
    busy._step(80e6)  # the store got busier
    busy._step(79e6)  # the same at the smaller limit: the step down stays
    assert busy.limit == 51
    busy._step(60e6)  # busier still: another step down, never below the start
    assert busy.limit == 40


def test_a_window_of_other_reads_is_not_judged_against_the_last_one():
    """Bytes per second compare only between windows of like reads: after a block shuffle's windows
    (megabytes a request), a full shuffle's (kilobytes a request) are judged afresh; judged against the block
    shuffle's rate, its first step up looked as if it had not paid, was taken back, and the limit sat at its
    start while four batches' GETs waited (first batch 2.1-2.6 s at 30 ms a request, 1.1 s without it)."""
    bound = InflightLimit(start=8, cap=128)
    bound._step(150e6, 1.5e6)  # a block shuffle's window: the limit held it back, a step up
    assert bound.limit == 12
    bound._step(10e6, 30e3)  # a full shuffle's first window: a start, not a step that did not pay
    assert bound.limit == 18
    bound._step(9e6, 30e3)  # like reads again, compared: this step did not pay and is taken back
    assert bound.limit == 12


def test_npy_pairs_are_found_by_probing_a_directory(tmp_path, server):
    d = tmp_path / "arrays"
    d.mkdir()
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((40, 3, 2)).astype(np.float32), rng.integers(0, 5, 40)
    np.save(d / "train_x.npy", x)
    np.save(d / "train_y.npy", y)
    np.save(d / "test_x.npy", x[:7])
    np.save(d / "test_y.npy", y[:7])
    src = open_source(f"{server.url}/arrays/?val_fraction=0.25&{FAST}")
    info = src.info()
    assert info["format"] == "npy" and info["memory"] == "stream" and info["num_classes"] == int(y.max()) + 1
    assert [info["splits"][s]["num_samples"] for s in ("train", "val", "test")] == [30, 10, 7]
    got_x, got_y = src.read("train", np.array([29, 0, 5]))
    assert np.array_equal(got_x, x[[29, 0, 5]]) and np.array_equal(got_y, y[[29, 0, 5]])
    assert np.array_equal(src.read("val", np.arange(10))[0], x[30:])
    assert np.array_equal(src.read("test", np.arange(7))[1], y[:7])


def test_raw_arrays_described_by_dataset_toml(tmp_path, server):
    d = tmp_path / "raw"
    d.mkdir()
    x = np.arange(24, dtype="<f4").reshape(6, 4)
    (d / "train.f32").write_bytes(x.tobytes())
    (d / "train.lbl").write_bytes(np.array([0, 1, 2, 0, 1, 2], np.uint8).tobytes())
    (d / "dataset.toml").write_text(
        textwrap.dedent("""
        val_fraction = 0.0
        [train]
        x = "train.f32"
        dtype = "float32"
        shape = [4]
        y = "train.lbl"
        label_dtype = "uint8"
    """)
    )
    src = open_source(f"{server.url}/raw/?{FAST}")
    assert src.info()["format"] == "raw" and src.num_samples("train") == 6 and src.num_classes == 3
    got_x, got_y = src.read("train", np.array([5, 2]))
    assert np.array_equal(got_x, x[[5, 2]]) and got_y.tolist() == [2, 2]


def test_a_manifest_gives_files_and_sizes_without_head_requests(tmp_path, server):
    tokens = write_shards(tmp_path / "tok", np.random.default_rng(4), sizes=(30, 50))
    sizes = [(tmp_path / "tok" / f"shard-0{i}.bin").stat().st_size for i in (0, 1)]
    (tmp_path / "tok" / "MANIFEST").write_text(f"# shards\nshard-00.bin {sizes[0]}\nshard-01.bin {sizes[1]}\n")
    src = open_source(f"{server.url}/tok/?manifest=MANIFEST&seq_len=7&token_bytes=2&val_fraction=0&{FAST}")
    assert src.num_samples("train") == 10
    assert np.array_equal(src.read("train", np.arange(10))[0], tokens[:80].reshape(10, 8))
    assert not [r for r in server.requests if r[0] == "HEAD"]
    listed = open_source(f"{server.url}/tok/?files=shard-01.bin&seq_len=7&token_bytes=2&val_fraction=0&{FAST}")
    assert np.array_equal(listed.read("train", np.arange(6))[0], tokens[30:78].reshape(6, 8))


def test_a_server_without_head_gives_sizes_by_a_range_request(tmp_path, server):
    tokens = write_shards(tmp_path / "tok", np.random.default_rng(5), sizes=(40,))
    server.no_head = True
    src = open_source(f"{server.url}/tok/shard-00.bin?seq_len=9&token_bytes=2&val_fraction=0&{FAST}")
    assert np.array_equal(src.read("train", np.arange(4))[0], tokens.reshape(4, 10))


def test_redirects_are_followed(tmp_path, server):
    tokens = write_shards(tmp_path / "tok", np.random.default_rng(12), sizes=(40,))
    server.redirects = {"/moved/": "/tok/", "/loop/": "/loop/"}
    src = open_source(f"{server.url}/moved/shard-00.bin?seq_len=9&token_bytes=2&val_fraction=0&{FAST}")
    assert np.array_equal(src.read("train", np.arange(4))[0], tokens.reshape(4, 10))
    assert ("GET", "/tok/shard-00.bin", "bytes=0-79") in server.requests
    with pytest.raises(DatasetError, match="HEAD .*/loop/shard-00.bin: more than 5 redirects"):
        open_source(f"{server.url}/loop/shard-00.bin?seq_len=9&token_bytes=2&{FAST}")


def test_dropped_connections_are_retried(tmp_path, server):
    tokens = write_shards(tmp_path / "tok", np.random.default_rng(6), sizes=(200,))
    src = open_source(f"{server.url}/tok/shard-00.bin?seq_len=9&token_bytes=2&val_fraction=0&{FAST}")
    server.drops = 2  # two hang-ups, then the third try of the same range succeeds
    x, _ = src.read("train", np.arange(3, 8))
    assert np.array_equal(x, tokens.reshape(20, 10)[3:8])
    assert server.gets()[-3:] == [("/tok/shard-00.bin", "bytes=60-159")] * 3


def test_retries_are_bounded_and_the_error_names_the_url(tmp_path, server):
    write_shards(tmp_path / "tok", np.random.default_rng(7), sizes=(200,))
    src = open_source(f"{server.url}/tok/shard-00.bin?seq_len=9&token_bytes=2&{FAST}")
    server.drops = 100
    before = len(server.gets())
    with pytest.raises(
        DatasetError,
        match=rf"GET {server.url}/tok/shard-00.bin \(bytes=0-39\): .* \(after 3 "
        "attempts\\)",
    ) as err:
        src.read("train", np.arange(2))
    assert err.value.code == "UNAVAILABLE" and len(server.gets()) - before == 3


def test_a_short_body_fails_the_batch_with_a_clear_error(tmp_path, server):
    write_shards(tmp_path / "tok", np.random.default_rng(8), sizes=(200,))
    src = open_source(f"{server.url}/tok/shard-00.bin?seq_len=9&token_bytes=2&{FAST}")
    server.short_body = True
    with pytest.raises(
        DatasetError, match=r"GET http://.*/shard-00.bin \(bytes=0-39\): body ended before the 40 bytes"
    ):
        src.read("train", np.arange(2))


def test_a_server_that_ignores_ranges_is_named(tmp_path, server):
    write_shards(tmp_path / "tok", np.random.default_rng(9), sizes=(200,))
    src = open_source(f"{server.url}/tok/shard-00.bin?seq_len=9&token_bytes=2&{FAST}")
    server.no_ranges = True
    with pytest.raises(DatasetError, match="HTTP 200 instead of 206 Partial Content; the server does not serve"):
        src.read("train", np.arange(2))


@pytest.mark.parametrize(
    "path, query, message",
    [
        (
            "/tok/shard-{00..05}.bin",
            "seq_len=9&token_bytes=2",
            r"HEAD http://127\.0\.0\.1:\d+/tok/shard-04.bin: HTTP 404",
        ),
        ("/tok/", "seq_len=9", "HTTP cannot list a directory"),
        ("/tok/shard-00.bin", "seq_len=9&token_bytes=2&retries=x", "retries must be an integer, got 'x'"),
        ("/tok/shard-00.bin", "seq_len=9&token_bytes=2&concurrency=0", "concurrency must be at least 1"),
        ("/tok/shard-00.bin", "seq_len=9&format=idx", "format 'idx' is not read over HTTP"),
        ("/tok/shard-{00..01}.bin", "seq_len=9&token_bytes=2&files=a.bin", "give one of files=, manifest= or"),
        (
            "/tok/shard-00.bin",
            "seq_len=9&token_bytes=2&files=a.bin",
            r"HEAD http://127\.0\.0\.1:\d+/tok/a.bin: HTTP 404",
        ),
        ("/tok/shard-00.bin", "token_bytes=2", "token shards need a sequence length"),
    ],
)
def test_bad_http_uris_are_refused_at_open(tmp_path, server, path, query, message):
    write_shards(tmp_path / "tok", np.random.default_rng(10))
    with pytest.raises(DatasetError, match=message):
        open_source(f"{server.url}{path}?{FAST}&{query}")


def test_an_unreachable_server_is_named():
    with pytest.raises(DatasetError, match=r"HEAD http://127\.0\.0\.1:9/x\.bin: ConnectionRefusedError"):
        open_source("http://127.0.0.1:9/x.bin?seq_len=3&token_bytes=2&retries=0")


def test_the_provider_serves_an_http_dataset(tmp_path, server, start_provider, client_for):
    tokens = write_shards(tmp_path / "tok", np.random.default_rng(11))
    provider = start_provider(f"web={server.url}/tok/shard-{{00..03}}.bin?seq_len=15&token_bytes=2&{FAST}")
    client = client_for(provider.endpoint)
    info = client.request(DatasetInfoRequest(dataset="web")).info
    assert info["kind"] == "tokens" and info["seq_len"] == 15 and info["splits"]["train"]["num_samples"] == 15
    idx = np.array([14, 2, 3], "<i8")
    reply = client.request(BatchRequest(dataset="web", split="train", frames=[idx.tobytes()]))
    x = np.frombuffer(reply.frames[0].buffer, reply.dtypes[0]).reshape(reply.shapes[0])
    assert np.array_equal(x, tokens[:256].reshape(16, 16)[idx])
    # the endpoint breaks: the batch fails with UNAVAILABLE naming the URL, no bytes are served,
    # and the provider serves again once the endpoint is back
    server.short_body = True
    with pytest.raises(Unavailable, match="shard-00.bin .* body ended"):
        client.request(BatchRequest(dataset="web", split="train", frames=[idx.tobytes()]))
    server.short_body = False
    again = client.request(BatchRequest(dataset="web", split="train", frames=[idx.tobytes()]))
    assert bytes(again.frames[0].buffer) == x.tobytes()
    assert issubclass(Unavailable, BusError)


def test_a_loader_on_this_host_gets_http_batches_through_the_shm_ring(tmp_path, server, start_provider, make_token):
    write_shards(tmp_path / "tok", np.random.default_rng(13), sizes=(700, 500))
    uri = f"{server.url}/tok/shard-{{00..01}}.bin?seq_len=15&token_bytes=2&{FAST}"
    provider = start_provider(f"web={uri}")
    source = open_source(uri)
    with RemoteLoader(
        "web", provider=provider.endpoint, token=make_token(), batch_size=16, seed=4, inflight=2
    ) as loader:
        assert loader.transport == "shm"
        order = epoch_order(loader.num_samples, epoch=0, seed=4, shuffle=True)
        start = 0
        for x, _ in loader:  # the provider's range reads land straight in the ring's slots
            assert np.array_equal(x.numpy(), source.read("train", order[start : start + len(x)])[0])
            start += len(x)
        assert start == loader.num_samples == 67
    # and at most inflight - 1 asked ahead of epoch 1 by the pass taken to its end
    assert len(loader) <= provider.service.handler.served["web"]["shm_batches"] <= len(loader) + 1


def self_signed(d) -> tuple:
    """A certificate for 127.0.0.1 signed by its own key: (certificate file, key file)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "batchbus test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    (d / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return d / "cert.pem", d / "key.pem"


def test_https_with_a_ca_file_and_an_untrusted_certificate(tmp_path):
    tokens = write_shards(tmp_path / "tok", np.random.default_rng(14), sizes=(40,))
    cert, key = self_signed(tmp_path)
    tls = RangeServer(tmp_path, tls=(cert, key))
    try:
        url = f"{tls.url}/tok/shard-00.bin?seq_len=9&token_bytes=2&val_fraction=0&{FAST}"
        src = open_source(f"{url}&ca={cert}")
        assert np.array_equal(src.read("train", np.array([3, 1]))[0], tokens.reshape(4, 10)[[3, 1]])
        with pytest.raises(DatasetError, match=rf"HEAD {tls.url}/tok/shard-00.bin: SSLCertVerificationError") as err:
            open_source(url)  # the system's CAs do not vouch for it
        assert "attempts" not in str(err.value)  # a certificate does not get better with retries
        with pytest.raises(DatasetError, match="ca '/nowhere.pem' is not a file"):
            open_source(f"{url}&ca=/nowhere.pem")
    finally:
        tls.close()


def test_a_closed_http_source_leaves_no_request_thread_behind(tmp_path, server):
    """A dataset behind HTTP releases its range client (the threads that fetch a batch's runs) when closed."""
    write_shards(tmp_path / "tok", np.random.default_rng(11))
    source = open_source(f"{server.url}/tok/shard-{{00..03}}.bin?seq_len=9&token_bytes=2&coalesce=0&{FAST}")
    earlier = set(threading.enumerate())  # other tests' sources, not yet collected, have threads of their own
    source.read("train", np.array([0, 2, 12, 20]))  # runs in three files: fetched on the client's threads
    busy = [t for t in threading.enumerate() if t.name.startswith("http-range") and t not in earlier]
    assert busy, "no request thread ran: this test no longer tests their release"
    source.close()
    for t in busy:
        t.join(5)
        assert not t.is_alive()

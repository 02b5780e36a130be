"""s3:// datasets against a real S3 API (moto in server mode, signatures checked) behind a proxy that
injects failures: every format serves the bytes its files hold, throttling is retried, credentials
stay out of URIs and messages, and the disk cache stays bounded, survives a restart and is shared."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from libbus.errors import DatasetError
from services.provider.sources import open_source
from services.provider.sources.storage.blockcache import cache_stats
from tests.support.busctl import REPO
from tests.support.formats import BUILDERS, some_indices
from tests.support.s3server import s3_in_env

FAST = "retries=3&backoff=0.01&deadline=20"


@pytest.fixture(scope="module")
def s3():
    with s3_in_env() as server:
        yield server


def _same(a, b, split: str, rng) -> None:
    n = a.num_samples(split)
    assert n == b.num_samples(split)
    if n:
        idx = some_indices(n, rng)
        (xa, ya), (xb, yb) = a.read(split, idx), b.read(split, idx)
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)


def _write_parquet(d, rng) -> None:
    ids = rng.integers(0, 1000, (40, 6)).astype(np.int32)
    table = pa.table({"input_ids": pa.array([r.tolist() for r in ids], pa.list_(pa.int32())), "label": ids[:, 0] % 3})
    pq.write_table(table, d / "train.parquet", row_group_size=7)


@pytest.mark.parametrize(
    "fmt", ["idx", "cifar10", "npy", "tokens-bin", "tokens-npy", "raw", "parquet", "raw-cached", "parquet-cached"]
)
def test_each_format_serves_the_bytes_of_its_files(s3, tmp_path, fmt):
    rng = np.random.default_rng(len(fmt))
    d = tmp_path / fmt
    d.mkdir()
    base = fmt.removesuffix("-cached")
    query = _write_parquet(d, rng) or "" if base == "parquet" else BUILDERS[base](d, rng).query
    s3.put_dir("formats", fmt, d)
    local = open_source(f"file://{d}?{query}")
    # through a disk cache of small blocks: samples and Parquet pages straddle block boundaries
    cache = f"&cache_dir={tmp_path / 'cache'}&cache_limit=100000&block=4096" if fmt != base else ""
    remote = open_source(f"s3://formats/{fmt}?{query}&{FAST}{cache}")
    try:
        assert remote.info()["uri"].startswith("s3://formats/")
        for split in ("train", "val", "test"):
            _same(local, remote, split, rng)
        assert bool(cache) == (tmp_path / "cache").is_dir() and (not cache or _cache_bytes(tmp_path / "cache") > 0)
    finally:
        local.close()
        remote.close()


def _tokens(s3, tmp_path, prefix: str, n_seq: int = 64, seq: int = 16, shards: int = 2):
    """Token shards (uint16, sequences of ``seq``) uploaded to ``data/prefix``; returns the tokens."""
    tokens = np.random.default_rng(7).integers(0, 500, n_seq * seq, dtype=np.uint16)
    d = tmp_path / prefix
    d.mkdir()
    for i, part in enumerate(np.array_split(tokens, shards)):
        (d / f"shard-{i:02d}.bin").write_bytes(part.tobytes())
    s3.put_dir("data", prefix, d)
    return tokens.reshape(n_seq, seq)


def test_throttling_and_dropped_connections_are_retried(s3, tmp_path):
    ref = _tokens(s3, tmp_path, "retry", shards=1)
    src = open_source(f"s3://data/retry/?seq_len=15&token_bytes=2&val_fraction=0&{FAST}")
    s3.faults = [(503, "SlowDown"), (429, "TooManyRequests"), "drop"]
    before = len(s3.gets())
    x, _ = src.read("train", np.arange(4, 9))
    assert np.array_equal(x, ref[4:9])
    assert len(s3.gets()) - before == 4 and not s3.faults  # three failures, then the range
    src.close()


def test_retries_that_run_out_fail_unavailable_naming_the_object(s3, tmp_path):
    _tokens(s3, tmp_path, "gone", shards=1)
    src = open_source("s3://data/gone/?seq_len=15&token_bytes=2&retries=2&backoff=0.01")
    s3.faults = [(503, "SlowDown")] * 10
    with pytest.raises(
        DatasetError,
        match=r"GET s3://data/gone/shard-00.bin \(bytes 0-63\): HTTP 503 SlowDown "
        r"\(gave up after 3 attempts\)",
    ) as err:
        src.read("train", np.arange(2))
    assert err.value.code == "UNAVAILABLE"
    # the batch deadline stops retrying early: backoff up to 5 s would pass a 0.2 s deadline
    s3.faults = [(503, "SlowDown")] * 10
    slow = open_source("s3://data/gone/?seq_len=15&token_bytes=2&retries=10&backoff=5&deadline=0.2")
    with pytest.raises(DatasetError, match=r"shard-00.bin .*deadline"):
        slow.read("train", np.arange(2))
    s3.faults = []
    src.close()
    slow.close()


def test_bad_credentials_are_refused_without_showing_them(s3, tmp_path, monkeypatch, caplog):
    _tokens(s3, tmp_path, "creds", shards=1)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-1234")
    caplog.set_level(logging.DEBUG)
    with pytest.raises(DatasetError, match=r"LIST s3://data/creds/: refused \(403 SignatureDoesNotMatch\): check"):
        open_source("s3://data/creds/?seq_len=15&token_bytes=2&retries=0")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWN0000000")
    with pytest.raises(DatasetError, match=r"refused \(403 InvalidAccessKeyId\)") as err:
        open_source("s3://data/creds/?seq_len=15&token_bytes=2&retries=0")
    for secret in ("not-the-secret-1234", "AKIAUNKNOWN0000000", s3.secret_key):
        assert secret not in str(err.value) and secret not in caplog.text


@pytest.mark.parametrize(
    "uri",
    [
        "s3://AKIAEXAMPLE:hunter2secret@data/creds/?seq_len=15",
        "s3://data/creds/?seq_len=15&secret_access_key=hunter2secret",
        "s3://data/creds/?seq_len=15&X-Amz-Signature=hunter2secret",
    ],
)
def test_a_uri_carrying_credentials_is_refused(uri):
    with pytest.raises(DatasetError, match="credential") as err:
        open_source(uri)
    assert "hunter2secret" not in str(err.value) and "AKIAEXAMPLE" not in str(err.value)


def _cache_bytes(root) -> int:
    return sum(p.stat().st_size for p in (root / "blocks").rglob("*") if p.is_file() and not p.name.startswith("."))


def test_the_cache_stays_bounded_evicts_and_is_reused_after_a_restart(s3, tmp_path):
    ref = _tokens(s3, tmp_path, "big", n_seq=512, seq=64, shards=4)  # 64 KiB of tokens
    cache = tmp_path / "cache"
    uri = f"s3://data/big/?seq_len=63&token_bytes=2&val_fraction=0&block=4096&cache_dir={cache}&{FAST}"
    src = open_source(f"{uri}&cache_limit=16384")  # a quarter of the dataset
    rng = np.random.default_rng(3)
    for batch in np.array_split(rng.permutation(512), 16):
        assert np.array_equal(src.read("train", batch)[0], ref[batch])
        assert _cache_bytes(cache) <= 16384
    stats = cache_stats()[os.path.realpath(cache)]
    assert stats["evictions"] > 0 and stats["misses"] > 16 and stats["bytes"] <= 16384
    src.close()
    # a provider restarted on a cache that holds the whole dataset fetches nothing it has
    whole = open_source(f"{uri}&cache_limit=1000000")
    whole.read("train", np.arange(512))
    whole.close()
    before = len(s3.gets())
    again = open_source(f"{uri}&cache_limit=1000000")
    idx = rng.permutation(512)
    assert np.array_equal(again.read("train", idx)[0], ref[idx])
    assert len(s3.gets()) == before, "the restarted source fetched blocks its cache holds"
    again.close()


READER = textwrap.dedent(
    """\
    import hashlib, sys, numpy as np
    from services.provider.sources import open_source
    src = open_source(sys.argv[1])
    rng = np.random.default_rng(int(sys.argv[2]))
    for batch in np.array_split(rng.permutation(512), 8):
        x = src.read("train", batch)[0]
        assert hashlib.sha256(x.tobytes()).hexdigest() == hashlib.sha256(
            np.load(sys.argv[3])[batch].tobytes()).hexdigest()
    print("ok")
    """
)


def test_a_ram_cache_serves_a_full_shuffle_from_whole_blocks_fetched_once(s3, tmp_path):
    ref = _tokens(s3, tmp_path, "ram", n_seq=512, seq=64, shards=4)  # 64 KiB of tokens, 4 objects
    uri = f"s3://data/ram/?seq_len=63&token_bytes=2&val_fraction=0&block=4096&cache=off&ram_cache=65536&{FAST}"
    src = open_source(uri)
    before = len(s3.gets())
    rng = np.random.default_rng(4)
    for batch in np.array_split(rng.permutation(512), 16):
        assert np.array_equal(src.read("train", batch)[0], ref[batch])
    assert len(s3.gets()) - before == 16  # 64 KiB in blocks of 4 KiB: each fetched once, whole
    before = len(s3.gets())
    for batch in np.array_split(rng.permutation(512), 16):
        assert np.array_equal(src.read("train", batch)[0], ref[batch])
    assert len(s3.gets()) == before, "a second pass went to the store"
    src.close()


def test_two_providers_share_one_cache_directory(s3, tmp_path):
    ref = _tokens(s3, tmp_path, "shared", n_seq=512, seq=64, shards=4)
    np.save(tmp_path / "ref.npy", ref)
    cache = tmp_path / "cache"
    uri = f"s3://data/shared/?seq_len=63&token_bytes=2&val_fraction=0&block=4096&cache_dir={cache}&cache_limit=32768&{FAST}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", READER, uri, str(seed), str(tmp_path / "ref.npy")],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for seed in (1, 2)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=90)
        assert p.returncode == 0 and out.strip().endswith("ok"), out
    assert 0 < _cache_bytes(cache) <= 32768
    assert int((cache / "usage").read_text()) == _cache_bytes(cache)


def test_an_object_rewritten_while_served_fails_its_batch(s3, tmp_path):
    _tokens(s3, tmp_path, "rewrite", shards=1)
    src = open_source(f"s3://data/rewrite/?seq_len=15&token_bytes=2&val_fraction=0&{FAST}")
    src.read("train", np.arange(2))
    s3.s3.put_object(Bucket="data", Key="rewrite/shard-00.bin", Body=bytes(64 * 16 * 2))
    with pytest.raises(DatasetError, match=r"rewrite/shard-00.bin .*changed since the dataset was opened"):
        src.read("train", np.arange(2))
    src.close()


def test_requests_in_flight_are_bounded_per_dataset_and_per_host(s3, tmp_path, monkeypatch):
    ref = _tokens(s3, tmp_path, "hosts", n_seq=64, seq=16, shards=1)
    src = open_source(f"s3://data/hosts/?seq_len=15&token_bytes=2&val_fraction=0&concurrency=8&coalesce=0&{FAST}")
    idx = np.arange(0, 64, 4)  # 16 runs: 16 requests
    s3.delay_s, s3.max_inflight = 0.1, 0
    try:
        assert np.array_equal(src.read("train", idx)[0], ref[idx])
        assert s3.max_inflight == 8  # the dataset's concurrency
        # two datasets on one host (named anew, so that its limit is theirs): 3 requests at once in all
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url.replace("127.0.0.1", "localhost"))
        query = f"seq_len=15&token_bytes=2&val_fraction=0&concurrency=8&host_concurrency=3&coalesce=0&{FAST}"
        pair = [open_source(f"s3://data/hosts/?{query}") for _ in range(2)]
        s3.max_inflight = 0
        threads = [threading.Thread(target=p.read, args=("train", idx)) for p in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert 1 < s3.max_inflight <= 3
        for p in pair:
            p.close()
    finally:
        s3.delay_s = 0.0
        src.close()


@pytest.mark.parametrize(
    "uri, message",
    [
        ("s3://data/nothing-here/?seq_len=3", r"s3://data/nothing-here/: no objects under this prefix"),
        ("s3://no-such-bucket/a/?seq_len=3", r"LIST s3://no-such-bucket/a/: not found \(404 NoSuchBucket\)"),
        ("s3:///a/?seq_len=3", r"name a bucket"),
        ("s3://data/refuse/?seq_len=15&token_bytes=2&concurrency=0", r"concurrency must be at least 1, got '0'"),
        ("s3://data/refuse/?seq_len=15&token_bytes=2&cache_dir=/tmp/c", r"a cache_dir needs a cache_limit"),
        ("s3://data/refuse/?seq_len=15&token_bytes=2&format=csv", r"unknown format 'csv'"),
    ],
)
def test_bad_object_uris_are_refused_at_open(s3, tmp_path, uri, message):
    _tokens(s3, tmp_path, "refuse", shards=1)
    with pytest.raises(DatasetError, match=message):
        open_source(uri + "&retries=0")


def test_a_dataset_toml_cannot_name_objects_outside_its_prefix(s3, tmp_path):
    _tokens(s3, tmp_path, "private", shards=1)
    d = tmp_path / "raw"
    d.mkdir()
    (d / "dataset.toml").write_text('[train]\nx = "../private/shard-00.bin"\ndtype = "uint8"\nshape = [4]\n')
    s3.put_dir("data", "public", d)
    with pytest.raises(DatasetError, match=r"s3://data/public/../private/shard-00.bin: no such object"):
        open_source(f"s3://data/public/?{FAST}")


def test_credentials_from_a_profile_file(s3, tmp_path, monkeypatch):
    ref = _tokens(s3, tmp_path, "profile", shards=1)
    creds = tmp_path / "credentials"
    creds.write_text(f"[reader]\naws_access_key_id = {s3.access_key}\naws_secret_access_key = {s3.secret_key}\n")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_PROFILE", "reader")
    src = open_source(f"s3://data/profile/?seq_len=15&token_bytes=2&val_fraction=0&{FAST}")
    assert np.array_equal(src.read("train", np.array([5, 0]))[0], ref[[5, 0]])
    src.close()


def test_a_damaged_cache_block_is_fetched_again(s3, tmp_path):
    ref = _tokens(s3, tmp_path, "damaged", n_seq=64, seq=64, shards=1)  # 8 KiB: two 4 KiB blocks
    cache = tmp_path / "cache"
    uri = f"s3://data/damaged/?seq_len=63&token_bytes=2&val_fraction=0&block=4096&cache_dir={cache}&cache_limit=65536"
    src = open_source(uri)
    src.read("train", np.arange(64))
    blocks = sorted(p for p in (cache / "blocks").rglob("*") if p.is_file() and not p.name.startswith("."))
    assert len(blocks) == 2
    blocks[0].write_bytes(blocks[0].read_bytes()[:100])  # cut short, as a full disk or a crash might
    before = len(s3.gets())
    assert np.array_equal(src.read("train", np.arange(64))[0], ref)
    assert len(s3.gets()) - before == 1 and blocks[0].stat().st_size == 4096
    src.close()


def test_an_object_store_dataset_read_in_a_helper_process_counts_its_requests(s3, tmp_path, start_provider, client_for):
    """Beside a local dataset an s3:// dataset is read in a helper process of the provider's: its bytes
    are the objects', and the helper's requests are in the provider's ``object_store`` stats."""
    from libbus.wire.messages import BatchRequest  # noqa: PLC0415
    from tests.support.held_store import batch, npy_pair  # noqa: PLC0415

    ref = _tokens(s3, tmp_path, "helped", n_seq=64, seq=16, shards=2)
    npy_pair(tmp_path / "local", 8, 1)
    provider = start_provider(
        f"toks=s3://data/helped/?seq_len=15&token_bytes=2&val_fraction=0&cache=off&{FAST}",
        f"disk=file://{tmp_path / 'local'}?val_fraction=0",
    )
    helper = provider.service.handler.helped["toks"].helper
    assert helper.pid is not None
    before = provider.service.handler.stats()["object_store"]["requests"]
    idx = np.array([63, 0, 17], "<i8")
    x, _ = batch(
        client_for(provider.endpoint).request(BatchRequest(dataset="toks", split="train", frames=[idx.tobytes()])), 3
    )
    assert np.array_equal(x, ref[idx])
    assert helper.objects["requests"] >= 1
    assert provider.service.handler.stats()["object_store"]["requests"] - before >= helper.objects["requests"]

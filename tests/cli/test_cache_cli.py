"""``busctl start provider --cache-dir DIR --cache-limit BYTES``: the object-store disk cache from flags,
shown by ``busctl config show``, and careless values refused in one line before anything starts."""

from __future__ import annotations

import json

import pytest

from tests.support.busctl import busctl, busctl_in_process
from tests.support.cluster import Cluster
from tests.support.s3server import S3Server


def test_config_show_shows_the_cache_and_where_it_came_from(tmp_path):
    out = busctl(
        "config",
        "show",
        "--json",
        env={"BATCHBUS_CACHE_DIR": str(tmp_path / "cache"), "BATCHBUS_CACHE_LIMIT": "5000000"},
    )
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["cache_dir"] == {"value": str(tmp_path / "cache"), "source": "env BATCHBUS_CACHE_DIR"}
    assert shown["cache_limit"] == {"value": 5000000, "source": "env BATCHBUS_CACHE_LIMIT"}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cache-limit", "-1"], "cache_limit (flag) must be a number of bytes, not negative, got -1"),
        (["--cache-limit", "ten gigs"], "--cache-limit: 'cache_limit' must be int, got 'ten gigs'"),
        (["--cache-dir", "FILE", "--cache-limit", "1000"], "is a file, not a directory"),
        (["--cache-dir", "DIR"], "cache_dir (flag) needs a cache_limit in bytes (--cache-limit"),
    ],
)
def test_careless_cache_flags_are_refused_in_one_line(tmp_path, flags, message):
    (tmp_path / "FILE").write_text("not a directory")
    flags = [str(tmp_path / f) if f in ("FILE", "DIR") else f for f in flags]
    code, out, err = busctl_in_process("start", "provider", "--state-dir", str(tmp_path / "state"), *flags)
    assert code != 0
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in out + err
    assert not (tmp_path / "DIR").exists()  # refused before anything was made


def test_a_provider_started_with_cache_flags_caches_its_object_store_dataset(tmp_path):
    server = S3Server()
    cluster = Cluster(tmp_path / "state", env=server.env())
    try:
        data = tmp_path / "data"
        data.mkdir()
        (data / "train.bin").write_bytes(bytes(range(256)) * 64)
        server.put_dir("bucket", "tokens", data)
        cache = tmp_path / "cache"
        cluster.start_router()
        cluster.start(
            "p1",
            "provider",
            "--dataset",
            "t=s3://bucket/tokens?seq_len=16&token_bytes=2",
            "--cache-dir",
            str(cache),
            "--cache-limit",
            "1000000",
            ready=True,
        )
        cluster.endpoint_of("p1")
        assert (cache / "blocks").is_dir()  # the provider's dataset opened through the flags' cache
    finally:
        cluster.close()
        server.close()

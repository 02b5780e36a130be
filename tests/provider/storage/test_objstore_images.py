"""Image layouts under s3:// (moto in server mode): an ImageFolder prefix and WebDataset shards serve
the bytes ``file://`` serves for the same tree, batches are fetched by range through the object client,
and a shard's index is cached in the cache directory under its ETag, rebuilt when the object changes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from libbus.errors import DatasetError
from services.provider.sources import open_source
from services.provider.sources.objstore import object_store_stats
from tests.support.images import shard_members, tar_bytes, write_imagefolder, write_shards
from tests.support.s3server import s3_in_env

FAST = "retries=3&backoff=0.01&deadline=20"


@pytest.fixture(scope="module")
def s3():
    with s3_in_env() as server:
        yield server


def _same_everywhere(local, remote) -> None:
    assert remote.info()["class_names"] == local.info()["class_names"]
    for split in ("train", "val", "test"):
        n = local.num_samples(split)
        assert remote.num_samples(split) == n
        if n:
            idx = np.random.default_rng(n).permutation(n)
            (xl, yl), (xr, yr) = local.read(split, idx), remote.read(split, idx)
            assert np.array_equal(xl, xr) and np.array_equal(yl, yr)


def test_an_imagefolder_prefix_serves_the_bytes_of_its_local_tree(s3, tmp_path):
    root = write_imagefolder(tmp_path / "pets", per_class=6, classes=3, splits=("train", "test"))
    (root / "train" / ".hidden").mkdir()
    (root / "train" / "class0" / "notes.txt").write_text("not an image")
    s3.put_dir("images", "pets", root)
    local = open_source(f"file://{root}?size=16&workers=2")
    before = len(s3.gets())
    remote = open_source(f"s3://images/pets?size=16&workers=2&{FAST}")
    try:
        assert remote.info()["format"] == "imagefolder" and remote.info()["sample_shape"] == [3, 16, 16]
        _same_everywhere(local, remote)
        assert len(s3.gets()) > before  # images came by ranged GETs
        assert object_store_stats({"pets": remote})["object_store"]["bytes_fetched"] > 0  # busctl queues
    finally:
        local.close()
        remote.close()


def test_webdataset_shards_under_a_prefix_serve_the_bytes_of_the_local_shards(s3, tmp_path):
    root = tmp_path / "wds"
    write_shards(root, "train", shards=2, per_shard=8)
    write_shards(root, "test", shards=1, per_shard=5)
    (root / "classes.txt").write_text("cat\ndog\n")
    s3.put_dir("images", "wds", root)
    cache = tmp_path / "cache"
    local = open_source(f"file://{root}?size=12&cache={tmp_path / 'local-index'}")
    remote = open_source(f"s3://images/wds?size=12&{FAST}&cache_dir={cache}&cache_limit=10000000&block=4096")
    try:
        assert remote.info()["format"] == "webdataset" and remote.info()["class_names"] == ["cat", "dog"]
        _same_everywhere(local, remote)
        assert len(list((cache / "webdataset").glob("*.index.json"))) == 3
        assert "object_store" in object_store_stats({"wds": remote})
    finally:
        local.close()
        remote.close()


def test_the_shard_index_is_keyed_on_the_etag_and_rebuilt_when_the_object_changes(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # no cache_dir: the user's cache
    s3.s3.create_bucket(Bucket="changing")
    s3.s3.put_object(Bucket="changing", Key="wds/train-0000.tar", Body=tar_bytes(shard_members("train", 0, 5)))
    uri = f"s3://changing/wds?size=8&val_fraction=0&{FAST}"
    first = open_source(uri)
    assert first.num_samples("train") == 5
    first.close()
    (cached,) = (tmp_path / "xdg" / "batchbus" / "webdataset").glob("*.index.json")
    etag = s3.s3.head_object(Bucket="changing", Key="wds/train-0000.tar")["ETag"]
    assert json.loads(cached.read_text())["stamp"] == etag
    s3.s3.put_object(Bucket="changing", Key="wds/train-0000.tar", Body=tar_bytes(shard_members("train", 0, 7)))
    second = open_source(uri)
    try:
        assert second.num_samples("train") == 7
        assert second.read("train", np.arange(7))[0].shape == (7, 3, 8, 8)
        assert json.loads(cached.read_text())["stamp"] not in ("", etag)
    finally:
        second.close()


def test_an_image_prefix_without_size_is_refused_with_what_to_add(s3, tmp_path):
    root = write_imagefolder(tmp_path / "few", per_class=2, classes=2)
    s3.put_dir("images", "few", root)
    with pytest.raises(DatasetError, match=r"add \?size=S"):
        open_source(f"s3://images/few?{FAST}")

"""Image datasets decoded on the provider: ImageFolder trees and WebDataset shards under ``file://DIR?size=S``,
read against reference decodes, with the bad-image policy both ways and the shard index cache."""

import io
import os

import numpy as np
import pytest
from PIL import Image

from libbus.errors import DatasetError
from services.provider.sources import open_source
from tests.support.images import (
    image_bytes,
    shard_members,
    tar_bytes,
    write_imagefolder,
    write_shards,
)


def reference(data: bytes, size: int) -> np.ndarray:
    """Pillow's decode, shorter side to ``size`` (bilinear), centre crop: (3, size, size) uint8."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = img.size
    nw, nh = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)
    img = img.resize((nw, nh), Image.BILINEAR)
    left, top = int(round((nw - size) / 2)), int(round((nh - size) / 2))
    return np.asarray(img.crop((left, top, left + size, top + size))).transpose(2, 0, 1)


def test_imagefolder_serves_each_image_as_its_reference_decode(tmp_path):
    root = write_imagefolder(tmp_path / "pets", per_class=12, classes=3, splits=("train", "test"))
    source = open_source(f"file://{root}?size=20&workers=2")
    info = source.info()
    assert (info["sample_shape"], info["dtype"], info["format"]) == ([3, 20, 20], "uint8", "imagefolder")
    assert info["class_names"] == ["class0", "class1", "class2"]
    assert {s: v["num_samples"] for s, v in info["splits"].items()} == {"train": 33, "val": 3, "test": 36}
    files = source.store.files
    for split in ("train", "val", "test"):
        n = source.num_samples(split)
        x, y = source.read(split, np.arange(n))
        for i, (path, label) in enumerate(files[split]):
            assert y[i] == label == ["class0", "class1", "class2"].index(path.parent.name)
            assert np.array_equal(x[i], reference(path.read_bytes(), 20)), path
    # val is carved per class, the same files every time, and never overlaps train
    again = open_source(f"file://{root}?size=20")
    assert again.store.files["val"] == files["val"]
    assert sorted(y for _, y in files["val"]) == [0, 1, 2]
    assert not {p for p, _ in files["val"]} & {p for p, _ in files["train"]}


def test_a_lossless_square_image_at_its_own_size_comes_back_pixel_for_pixel(tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    for mode, expected in (("RGB", pixels), ("L", None)):
        folder = tmp_path / mode / "train" / "a"
        folder.mkdir(parents=True)
        img = Image.fromarray(pixels).convert(mode)
        img.save(folder / "one.png")
        x, _ = open_source(f"file://{tmp_path / mode}?size=16&val_fraction=0").read("train", np.arange(1))
        if expected is None:  # grey: one channel copied into all three
            grey = np.asarray(img)
            expected = np.stack([grey] * 3, -1)
        assert np.array_equal(x[0], expected.transpose(2, 0, 1))


def test_augment_is_deterministic_per_epoch_and_only_on_train(tmp_path):
    root = write_imagefolder(tmp_path / "d", per_class=8, classes=2, splits=("train", "val"))
    plain = open_source(f"file://{root}?size=16")
    aug = open_source(f"file://{root}?size=16&augment=1&seed=3")
    idx = np.arange(8)
    shape = (8, 3, 16, 16)
    a0, a0b, a1 = (np.empty(shape, np.uint8) for _ in range(3))
    y = np.empty(8, np.int64)
    aug.serve_into("train", idx, a0, y, epoch=0)
    aug.serve_into("train", idx[::-1].copy(), a0b, y, epoch=0)
    aug.serve_into("train", idx, a1, y, epoch=1)
    assert np.array_equal(a0, a0b[::-1])  # per index, whatever the batch
    assert not np.array_equal(a0, a1)
    assert not np.array_equal(a0, plain.read("train", idx)[0])
    assert np.array_equal(aug.read("val", np.arange(4))[0], plain.read("val", np.arange(4))[0])


def test_webdataset_shards_serve_reference_decodes_and_splits_from_names(tmp_path):
    root = tmp_path / "wds"
    write_shards(root, "train", shards=2, per_shard=10)
    write_shards(root, "test", shards=1, per_shard=6)
    source = open_source(f"file://{root}?size=12")
    info = source.info()
    assert info["format"] == "webdataset" and info["sample_shape"] == [3, 12, 12]
    assert {s: v["num_samples"] for s, v in info["splits"].items()} == {"train": 18, "val": 2, "test": 6}
    members = dict(shard_members("test", 0, 6))
    x, y = source.read("test", np.arange(6))
    for i, sample in enumerate(source.store.fetch("test", np.arange(6))):
        key = sample.where.split(":", 1)[1]
        image = next(v for k, v in members.items() if k.startswith(key + ".") and not k.endswith(".cls"))
        assert np.array_equal(x[i], reference(image, 12)) and y[i] == int(members[key + ".cls"])


def test_the_shard_index_is_cached_and_rebuilt_when_the_shard_changes(tmp_path):
    root = tmp_path / "wds"
    (path,) = write_shards(root, "train", shards=1, per_shard=5)
    assert open_source(f"file://{root}?size=8&val_fraction=0").num_samples("train") == 5
    cached = root / ".batchbus-cache" / "train-0000.tar.index.json"
    assert cached.is_file()
    path.write_bytes(tar_bytes(shard_members("train", 0, 7)))
    os.utime(path, ns=(1, 1))  # a different mtime even on coarse clocks
    source = open_source(f"file://{root}?size=8&val_fraction=0")
    assert source.num_samples("train") == 7
    assert source.read("train", np.arange(7))[0].shape == (7, 3, 8, 8)
    # a stale index that claims the old size is not trusted
    assert '"size":' + str(path.stat().st_size) in cached.read_text()


def test_a_truncated_shard_is_refused_or_served_up_to_its_last_whole_sample(tmp_path):
    root = tmp_path / "wds"
    data = tar_bytes(shard_members("train", 0, 6))
    (root).mkdir()
    (root / "train-0000.tar").write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(DatasetError, match="train-0000.tar is truncated"):
        open_source(f"file://{root}?size=8")
    source = open_source(f"file://{root}?size=8&bad=skip&val_fraction=0")
    n = source.num_samples("train")
    assert 0 < n < 6
    assert source.read("train", np.arange(n))[0].shape == (n, 3, 8, 8)
    (root / "train-0000.tar").write_bytes(b"this is not a tar file" * 40)
    with pytest.raises(DatasetError, match="not a tar shard"):
        open_source(f"file://{root}?size=8&cache={tmp_path / 'c2'}")


def test_a_bad_image_fails_the_batch_naming_it_or_is_skipped_and_counted(tmp_path):
    root = write_imagefolder(tmp_path / "d", per_class=4, classes=2)
    good = image_bytes(0, 1, "JPEG")
    (root / "train" / "class0" / "00001.png").write_bytes(good[: len(good) // 2])  # truncated JPEG, .png name
    (root / "train" / "class1" / "00002.webp").write_bytes(b"not an image at all")
    failing = open_source(f"file://{root}?size=8&val_fraction=0")
    with pytest.raises(DatasetError, match="00001.png: not a whole image"):
        failing.read("train", np.arange(8))
    skipping = open_source(f"file://{root}?size=8&val_fraction=0&bad=skip")
    x, y = skipping.read("train", np.arange(8))
    reference_x, reference_y = failing.read("train", np.array([0, 2, 3, 4, 5, 7]))
    # each bad row holds its nearest good neighbour: rows 1 → 0, 6 → 5
    assert np.array_equal(x[[0, 1, 2, 3, 4, 5, 6, 7]], reference_x[[0, 0, 1, 2, 3, 4, 4, 5]])
    assert list(y) == list(reference_y[[0, 0, 1, 2, 3, 4, 4, 5]])
    assert skipping.metrics()["stages"][0]["bad_images"] == 2
    with pytest.raises(DatasetError, match="every sample of the batch"):
        skipping.read("train", np.array([1, 6]))


@pytest.mark.parametrize(
    "query, message",
    [
        ("", "add \\?size=S"),
        ("?size=0", "size must be between"),
        ("?size=8&bad=ignore", "bad must be one of fail, skip"),
        ("?size=8&augment=maybe", "augment must be 0 or 1"),
        ("?size=8&workers=0", "workers must be between"),
        ("?size=8&pool=fork", "pool must be one of thread, process"),
        ("?size=8&encoded=1", "not both"),
        ("?size=8&val_fraction=2", "val_fraction must be in"),
        ("?size=8&colour=1", "unknown parameter"),
    ],
)
def test_careless_image_uris_are_refused_with_what_to_change(tmp_path, query, message):
    root = write_imagefolder(tmp_path / "d", per_class=2, classes=2)
    with pytest.raises(DatasetError, match=message):
        open_source(f"file://{root}{query}")


def test_a_class_folder_that_train_lacks_is_refused(tmp_path):
    root = write_imagefolder(tmp_path / "d", per_class=2, classes=2)
    (root / "test" / "class7").mkdir(parents=True)
    (root / "test" / "class7" / "a.jpg").write_bytes(image_bytes(0, 0))
    with pytest.raises(DatasetError, match="class7 is a class folder that train/ does not have"):
        open_source(f"file://{root}?size=8")


def test_webdataset_shards_behind_http_read_as_local_ones_with_coalesced_reads(tmp_path):
    from tests.support.httpd import RangeServer

    root = tmp_path / "www"
    paths = write_shards(root, "train", shards=2, per_shard=8)
    server = RangeServer(root)
    try:
        query = f"size=12&val_fraction=0&cache={tmp_path / 'cache'}&retries=1&backoff=0.01"
        remote = open_source(f"{server.url}/train-{{0000..0001}}.tar?{query}")
        local = open_source(f"file://{root}?size=12&val_fraction=0")
        assert remote.info()["format"] == "webdataset" and remote.num_samples("train") == 16
        before = len(server.gets())
        x, y = remote.read("train", np.arange(8, 16))
        assert len(server.gets()) - before == 1  # one shard's 8 samples: one range request
        assert np.array_equal(x, local.read("train", np.arange(8, 16))[0])
        assert list(y) == list(local.read("train", np.arange(8, 16))[1])
        assert len(list((tmp_path / "cache").iterdir())) == 2
        # the shard changes (a new ETag): its index is rebuilt, the other one comes from the cache
        paths[1].write_bytes(tar_bytes(shard_members("train", 8, 5)))
        before = len(server.gets())
        again = open_source(f"{server.url}/train-{{0000..0001}}.tar?{query}")
        assert again.num_samples("train") == 13
        assert all(path.endswith("train-0001.tar") for path, _ in server.gets()[before:])
    finally:
        server.close()


def test_skipped_bad_images_are_counted_in_the_providers_metrics(tmp_path, start_provider, client_for):
    from libbus.wire.messages import BatchRequest
    from tests.support import scrape, value

    root = write_imagefolder(tmp_path / "d", per_class=3, classes=2)
    (root / "train" / "class0" / "00001.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    running = start_provider(
        f"pics=file://{root}?size=8&bad=skip&val_fraction=0", metrics_bind="127.0.0.1:0", name="prov-img"
    )
    reply = client_for(running.endpoint).request(BatchRequest(dataset="pics", split="train", range=[0, 6]))
    assert reply is not None
    s = scrape(running.service.metrics.url)
    labels = dict(service="provider", name="prov-img", dataset="pics", stage="images")
    assert value(s, "batchbus_stage_bad_images_total", **labels) == 1
    assert value(s, "batchbus_stage_items_in_total", **labels) == 6
    assert value(s, "batchbus_stage_errors_total", **labels) == 0


def test_worker_processes_serve_the_same_bytes_as_threads(tmp_path):
    root = write_imagefolder(tmp_path / "d", per_class=5, classes=2)
    (root / "train" / "class1" / "00002.webp").write_bytes(b"RIFF....WEBP broken")
    query = "size=12&augment=1&bad=skip&val_fraction=0&workers=2"
    threads = open_source(f"file://{root}?{query}")
    processes = open_source(f"file://{root}?{query}&pool=process")
    try:
        shape = (10, 3, 12, 12)
        for epoch in (0, 3):
            xt, xp = np.empty(shape, np.uint8), np.empty(shape, np.uint8)
            yt, yp = np.empty(10, np.int64), np.empty(10, np.int64)
            threads.serve_into("train", np.arange(10), xt, yt, epoch=epoch)
            processes.serve_into("train", np.arange(10), xp, yp, epoch=epoch)
            assert np.array_equal(xt, xp) and np.array_equal(yt, yp)
        assert processes.metrics()["stages"][0]["bad_images"] == 2
        failing = open_source(f"file://{root}?size=12&val_fraction=0&workers=2&pool=process")
        with pytest.raises(DatasetError, match="00002.webp: not a whole image"):
            failing.read("train", np.arange(10))
        failing.close()
    finally:
        threads.close()
        processes.close()

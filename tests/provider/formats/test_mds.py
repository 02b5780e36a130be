"""MosaicML Streaming's MDS shards, written by its own ``MDSWriter`` (mosaicml-streaming, installed without
its dependencies: see pyproject's test extra), served as written: every column kind as a named field in the
shards' own order, each compression, Streaming's split folders, ``(x, y)`` with a label, an unmapped column
refused naming it, a damaged shard named, and both deliveries through a real provider."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from libbus.errors import DatasetError
from libbus.loader.remote import RemoteLoader
from services.provider.sources import open_source
from tests.support.peers import mds_job, png_pixels, write_mds

N = 23
COMPRESSIONS = ["", "gz", "bz2", "zstd:7", "br", "snappy"]
SMALL = ("x", "y", "caption", "blob")


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    """Every directory the tests read, written by MDSWriter in one process: Streaming's split folders
    (train: many small shards, zstd; test), one directory per compression, and a small plain one."""
    d = tmp_path_factory.mktemp("mds")
    jobs = [mds_job(d / "split" / "train", 1, N, "zstd"), mds_job(d / "split" / "test", 2, 5)]
    jobs += [mds_job(d / f"c{i}", 4, 9, c, columns=SMALL) for i, c in enumerate(COMPRESSIONS)]
    jobs.append(mds_job(d / "small", 5, 8, columns=SMALL))
    return d, write_mds(*jobs)


@pytest.fixture
def written(peers):
    d, samples = peers
    return d / "split", samples[0], samples[1]


@pytest.fixture
def small(peers, tmp_path):
    """A copy of the small plain directory, for a test to change."""
    shutil.copytree(peers[0] / "small", tmp_path / "d")
    return tmp_path / "d"


def _same(got: dict, samples: list[dict], idx) -> None:
    for k, i in enumerate(idx):
        s = samples[i]
        assert got["x"][k].tobytes() == s["x"].tobytes() and int(got["y"][k]) == s["y"]
        assert got["caption"][k] == s["caption"] and got["blob"][k] == s["blob"]
        assert got["tokens"][k].tobytes() == s["tokens"].tobytes() and got["tokens"][k].dtype == np.int32
        assert got["any"][k].shape == s["any"].shape and got["any"][k].tobytes() == s["any"].tobytes()
        assert np.array_equal(png_pixels(got["image"][k]), s["image"])


def test_every_column_is_a_field_in_the_shards_order(written):
    d, train, test = written
    assert len(json.loads((d / "train" / "index.json").read_text())["shards"]) > 3  # several shards
    source = open_source(f"file://{d}")
    try:
        assert [f.describe() for f in source.fields] == [
            "any float64 (?, ?)",
            "blob bytes *",
            "caption str *",
            "image bytes *",
            "tokens int32 (?,)",
            "x float32 (2, 3)",
            "y int64 ()",
        ]
        info = source.info()
        assert info["format"] == "mds" and info["columns"]["image"] == "png" and info["kind"] == "fields"
        assert [source.num_samples(s) for s in ("train", "val", "test")] == [21, 2, 5]
        assert all(f.max_bytes > 0 for f in source.fields if f.variable)  # from the offsets: shm works
        idx = np.array([20, 0, 7, 7, 3])
        _same(source.read_fields("train", idx), train, idx)
        _same(source.read_fields("val", np.array([1, 0])), train, [22, 21])
    finally:
        source.close()


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_each_compression_reads_the_same_samples(peers, compression):
    d, samples = peers[0] / f"c{COMPRESSIONS.index(compression)}", peers[1][2 + COMPRESSIONS.index(compression)]
    names = {p.name.rsplit(".", 1)[-1] for p in d.iterdir() if p.name.startswith("shard")}
    assert names == ({"mds"} if not compression else {compression.split(":")[0]})
    source = open_source(f"file://{d}?val_fraction=0")
    try:
        got = source.read_fields("train", np.arange(9)[::-1].copy())
        assert got["caption"] == [s["caption"] for s in samples[::-1]]
        assert got["blob"] == [s["blob"] for s in samples[::-1]]
        assert got["x"].tobytes() == np.stack([s["x"] for s in samples[::-1]]).tobytes()
    finally:
        source.close()


def test_label_and_one_column_are_an_xy_dataset(written):
    d, train, _ = written
    source = open_source(f"file://{d}?fields=x&label=y&shape=6")
    try:
        assert source.xy and source.sample_shape == (6,)
        assert source.num_classes == 1 + max(s["y"] for s in [*train, *written[2]])  # one pass over the labels
        x, y = source.read("train", np.array([4, 2]))
        assert x.tobytes() == np.stack([train[4]["x"], train[2]["x"]]).tobytes()
        assert y.tolist() == [train[4]["y"], train[2]["y"]]
    finally:
        source.close()


@pytest.mark.parametrize(
    "encoding, words",
    [
        ("pkl", "column 'blob' is pickled .encoding 'pkl'., and batchbus never unpickles"),
        ("list[jpeg]", "column 'blob' has encoding 'list\\[jpeg\\]', which batchbus does not map"),
        ("ndarray:complex64", "column 'blob' is an ndarray of 'complex64'"),
    ],
)
def test_an_unmapped_column_is_refused_at_open_naming_it(small, encoding, words):
    d = small
    index = json.loads((d / "index.json").read_text())
    for shard in index["shards"]:
        shard["column_encodings"][shard["column_names"].index("blob")] = encoding
    (d / "index.json").write_text(json.dumps(index))
    with pytest.raises(DatasetError, match=words + ".*fields="):
        open_source(f"file://{d}")
    open_source(f"file://{d}?fields=x,y,caption").close()  # left out, the rest serves


def test_a_damaged_shard_is_named(small):
    d = small
    shard = sorted(d.glob("shard.*.mds"))[0]
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(DatasetError, match=rf"{shard.name}: its sample offsets run past its"):
        open_source(f"file://{d}")


@pytest.mark.parametrize("shm", [False, True])
def test_mds_through_a_provider_on_both_deliveries(written, start_provider, make_token, shm):
    d, train, _ = written
    running = start_provider(f"mds=file://{d}", f"xy=file://{d}?fields=x&label=y&classes=4")
    with RemoteLoader(
        "mds", provider=running.endpoint, token=make_token(), batch_size=4, shuffle=False, shm=shm, collate="list"
    ) as loader:
        assert loader.transport == ("shm" if shm else "socket")
        seen = 0
        for batch in loader:
            n = len(batch["caption"])
            got = {k: [v.numpy() if hasattr(v, "numpy") else v for v in vs] for k, vs in batch.items()}
            _same(got, train, range(seen, seen + n))
            seen += n
        assert seen == 21
    with RemoteLoader("xy", provider=running.endpoint, token=make_token(), batch_size=7, shuffle=False, shm=shm) as xy:
        xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in xy])
        assert np.concatenate(xs).tobytes() == np.stack([s["x"] for s in train[:21]]).tobytes()
        assert np.concatenate(ys).tolist() == [s["y"] for s in train[:21]]


def test_split_folders_of_compressed_shards_in_a_bucket(written, tmp_path, monkeypatch):
    """Streaming's split folders at a bucket prefix: the zstd shards fetched once into the cache, the same
    samples as the local files."""
    from tests.support.s3server import s3_in_env

    d, train, test = written
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with s3_in_env() as s3:
        s3.put_dir("mds", "split", d)
        source = open_source("s3://mds/split/?retries=1&backoff=0.01")
        try:
            assert [source.num_samples(s) for s in ("train", "val", "test")] == [21, 2, 5]
            idx = np.array([20, 0, 7])
            _same(source.read_fields("train", idx), train, idx)
            assert sorted((tmp_path / "xdg").rglob("*.mds"))  # the decompressed copies
        finally:
            source.close()

"""The provider's decode cache (services/provider/sources/pipeline/decode_cache/): samples kept as they leave a
pipeline's deterministic prefix, shared by jobs, and every job's bytes those of an uncached run."""

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from libbus.errors import ConfigError
from services.provider.sources import open_source
from services.provider.sources.pipeline import Pipeline, pipeline_stats
from services.provider.sources.pipeline.decode_cache import DecodeCache, Entry, PrefixCache, file_name
from services.provider.sources.pipeline.stages import Chunk
from tests.support.images import write_imagefolder

TRAIN = """seed = {seed}
chunk = 8
[[stages]]
name = "files"
source = {{ uri = "file://{data}?encoded=1" }}
[[stages]]
name = "decode"
input = "files"
decode = {{ bad = "fail", workers = 2 }}
[[stages]]
name = "crop"
input = "decode"
random_resized_crop = {{ size = 24 }}
[[stages]]
name = "flip"
input = "crop"
flip = {{ p = 0.5 }}
[[stages]]
name = "normalize"
input = "flip"
normalize = {{ mean = [120.0, 110.0, 100.0], std = [60.0, 60.0, 60.0] }}
"""


def pipeline(tmp_path: Path, data: Path, seed: int = 0, name: str = "train.toml") -> Pipeline:
    path = tmp_path / name
    path.write_text(TRAIN.format(data=data, seed=seed))
    source = open_source(f"pipeline://{path}")
    assert isinstance(source, Pipeline)
    return source


def read(source: Pipeline, indices: np.ndarray, epoch: int, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    x = np.empty((len(indices), *source.sample_shape), source.dtype)
    y = np.empty((len(indices), *source.label_shape), source.label_dtype)
    source.serve_into(split, indices, x, y, epoch=epoch)
    return x, y


@pytest.fixture
def images(tmp_path: Path) -> Path:
    return write_imagefolder(tmp_path / "images", per_class=12, classes=2, splits=("train", "val"))


def jobs(n: int, seed: int) -> list[tuple[int, np.ndarray]]:
    """A job's requests: (epoch, indices) for two epochs of a shuffled order drawn from ``seed``, in batches
    of 5 (chunks of 8 split across batches: hits and misses mixed in one chunk)."""
    rng = np.random.default_rng(seed)
    out = []
    for epoch in range(2):
        order = rng.permutation(n)
        out += [(epoch, order[i : i + 5]) for i in range(0, n, 5)]
    return out


def test_jobs_get_the_bytes_of_an_uncached_run_and_share_the_decode_and_the_final_outputs(tmp_path, images):
    plain = pipeline(tmp_path, images, name="plain.toml")
    cached = pipeline(tmp_path, images, name="cached.toml")
    cache = DecodeCache(64 << 20)
    assert cached.use_cache(cache, "imgs") and cached.final is not None
    n = plain.num_samples("train")
    # three jobs (a study's trials: the pipeline's seed, each its own order), one after another
    for seed in (1, 2, 3):
        for epoch, idx in jobs(n, seed):
            want, got = read(plain, idx, epoch), read(cached, idx, epoch)
            assert np.array_equal(want[0], got[0]) and np.array_equal(want[1], got[1])
    decode = next(s for s in cached.metrics()["stages"] if s["name"] == "decode")
    assert decode["items_in"] == n  # each image decoded once, for six epochs of three jobs
    stats = cache.stats()
    # the first job computed epochs 0 and 1 (decoding in epoch 0); the others were served whole
    assert stats["final"]["misses"] == 2 * n and stats["final"]["hits"] == 4 * n
    assert stats["misses"] == n and stats["hits"] == n
    assert stats["final"]["entries"] == 2 * n and stats["entries"] == 3 * n
    per = stats["datasets"]["imgs"]
    assert per["hit_rate"] == 0.5 and per["final_hit_rate"] == round(4 / 6, 4)
    # the random stages ran once per sample and epoch: for the first job only
    crop = next(s for s in cached.metrics()["stages"] if s["name"] == "crop")
    assert crop["items_in"] == 2 * n
    assert pipeline_stats({"imgs": cached})["decode_cache"]["final"]["hits"] == 4 * n
    plain.close()
    cached.close()


def test_a_final_output_is_never_served_under_another_seed_or_epoch(tmp_path, images):
    cache = DecodeCache(64 << 20)
    # two pipelines under one dataset name, the same stages but the file's seed: one final digest
    p0, p7 = pipeline(tmp_path, images, seed=0, name="p0.toml"), pipeline(tmp_path, images, seed=7, name="p7.toml")
    assert p0.use_cache(cache, "imgs") and p7.use_cache(cache, "imgs")
    plain0, plain7 = (
        pipeline(tmp_path, images, seed=0, name="q0.toml"),
        pipeline(tmp_path, images, seed=7, name="q7.toml"),
    )
    idx = np.arange(16)
    want0, want7 = read(plain0, idx, 0)[0], read(plain7, idx, 0)[0]
    assert not np.array_equal(want0, want7)
    assert np.array_equal(read(p0, idx, 0)[0], want0)
    assert np.array_equal(read(p7, idx, 0)[0], want7)  # its own seed: not p0's final outputs
    assert cache.stats()["final"]["hits"] == 0
    assert np.array_equal(read(p0, idx, 1)[0], read(plain0, idx, 1)[0])  # another epoch: other crops
    assert cache.stats()["final"]["hits"] == 0
    assert np.array_equal(read(p0, idx, 0)[0], want0) and cache.stats()["final"]["hits"] == 16
    # a control command changes what the random stages draw from: the key follows
    for stage in ("crop", "flip"):
        p0.stage(stage).control("set", {"seed": 7})
    assert np.array_equal(read(p0, idx, 0)[0], want7)
    for stage in ("crop", "flip"):
        p0.stage(stage).control("set", {"epoch": 1})  # pinned: epoch 1's crops whatever is asked
    assert np.array_equal(read(p0, idx, 0)[0], read(plain7, idx, 1)[0])
    for p in (p0, p7, plain0, plain7):
        p.close()


def test_final_outputs_never_evict_decoded_samples(tmp_path):
    cache = DecodeCache(1000)
    decoded = [("d", "train", i, "prefix") for i in range(4)]
    final = [("d", "train", i, "all", "0:0") for i in range(4)]

    def entry(size: int) -> Entry:
        return Entry(np.zeros(size - 8, np.uint8), np.zeros((), np.int64))

    for key in decoded[:4]:
        cache.put(key, entry(200))  # 800 of 1000 bytes
    cache.put(final[0], entry(300))  # only 200 free, and decoded samples come first: not kept
    assert cache.get(final[0]) is None and cache.stats()["entries"] == 4
    cache.put(final[1], entry(150))
    cache.put(final[2], entry(50))
    assert cache.stats()["final"]["entries"] == 2 and cache.stats()["bytes"] == 1000
    cache.put(final[3], entry(100))  # evicts the older final output, not a decoded sample
    assert cache.get(final[1]) is None and cache.get(final[3]) is not None
    cache.put(("d", "train", 9, "prefix"), entry(150))  # a decoded sample evicts final outputs first
    stats = cache.stats()
    assert stats["final"]["entries"] == 0 and stats["entries"] == 5 and stats["bytes"] <= 1000
    assert all(cache.get(key) is not None for key in decoded)
    # the same order of priority on the disk tier
    probe = DecodeCache(1, disk_bytes=1 << 20, disk_dir=str(tmp_path / "probe"))
    probe.put(final[1], entry(500))
    size = probe.stats()["disk"]["bytes"]  # a file: the entry, its key, a header (decoded ones a little less)
    probe.close()
    limit = 5 * size + size // 2
    disk = DecodeCache(1, disk_bytes=limit, disk_dir=str(tmp_path / "dc"))
    for i in range(4):
        disk.put(("d", "train", i, "prefix"), entry(500))
    disk.put(final[0], entry(500 + 2 * size))  # would need a decoded sample's room: not written
    assert disk.get(final[0]) is None and disk.stats()["disk"]["entries"] == 4
    disk.put(final[1], entry(500))
    assert disk.stats()["disk"]["final_entries"] == 1
    disk.put(("d", "train", 5, "prefix"), entry(500))  # evicts the final file first
    d = disk.stats()["disk"]
    assert d["final_entries"] == 0 and d["entries"] == 5 and d["bytes"] <= limit
    assert all(disk.get(("d", "train", i, "prefix")) is not None for i in (0, 1, 2, 3, 5))
    disk.close()


def test_a_corrupt_final_output_on_disk_is_computed_again_not_served(tmp_path, images):
    disk = tmp_path / "dc"
    cache = DecodeCache(1, disk_bytes=64 << 20, disk_dir=str(disk))  # RAM of one byte: all goes to disk
    cached, plain = pipeline(tmp_path, images, name="c.toml"), pipeline(tmp_path, images, name="p.toml")
    cached.use_cache(cache, "imgs")
    idx = np.arange(8)
    want = read(plain, idx, 0)
    read(cached, idx, 0)
    assert cache.stats()["disk"]["final_entries"] == 8
    for f in disk.iterdir():  # every file, decoded and final: one byte flipped
        data = f.read_bytes()
        f.write_bytes(data[:-3] + bytes([data[-3] ^ 1]) + data[-2:])
    got = read(cached, idx, 0)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    stats = cache.stats()
    assert stats["final"]["hits"] == 0 and stats["disk"]["corrupt"] == 16  # 8 final outputs, then 8 decoded
    cached.close()
    plain.close()
    cache.close()


def test_concurrent_jobs_read_correct_bytes_from_one_cache(tmp_path, images):
    plain = pipeline(tmp_path, images, name="plain.toml")
    cached = pipeline(tmp_path, images, name="cached.toml")
    cached.use_cache(DecodeCache(64 << 20), "imgs")
    n = plain.num_samples("train")
    expected = {seed: [read(plain, idx, epoch) for epoch, idx in jobs(n, seed)] for seed in range(4)}
    failures: list[str] = []

    def job(seed: int) -> None:
        for (epoch, idx), (want_x, want_y) in zip(jobs(n, seed), expected[seed]):
            x, y = read(cached, idx, epoch)
            if not (np.array_equal(x, want_x) and np.array_equal(y, want_y)):
                failures.append(f"job {seed} epoch {epoch} indices {idx.tolist()}")

    # two jobs with the same seed ask for the same samples at the same time
    threads = [threading.Thread(target=job, args=(seed,)) for seed in (0, 0, 1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures
    assert not any(t.is_alive() for t in threads)
    plain.close()
    cached.close()


def test_pipelines_and_splits_never_share_an_entry(tmp_path, images):
    cache = DecodeCache(64 << 20)
    a, b = pipeline(tmp_path, images, seed=0, name="a.toml"), pipeline(tmp_path, images, seed=7, name="b.toml")
    a.use_cache(cache, "a")
    b.use_cache(cache, "b")
    plain_b = pipeline(tmp_path, images, seed=7, name="plain.toml")
    idx = np.arange(10)
    read(a, idx, 0)
    read(a, idx, 0, "val")
    assert np.array_equal(read(b, idx, 0)[0], read(plain_b, idx, 0)[0])  # b: its own seed, its own entries
    assert np.array_equal(read(b, idx, 0, "val")[0], read(plain_b, idx, 0, "val")[0])
    per = cache.stats()["datasets"]
    # 20 decoded samples and 20 final outputs each
    assert per["a"]["entries"] == per["b"]["entries"] == 40 and per["b"]["hits"] == per["b"]["final_hits"] == 0
    # another prefix (resize before the crop) over the same files and dataset name: another digest
    other = (tmp_path / "a.toml").read_text().replace(
        'input = "decode"\nrandom', 'input = "resize"\nrandom'
    ) + '[[stages]]\nname = "resize"\ninput = "decode"\nresize = { size = 30 }\n'
    (tmp_path / "r.toml").write_text(other)
    resized = open_source(f"pipeline://{tmp_path / 'r.toml'}")
    assert isinstance(resized, Pipeline) and resized.deterministic_prefix() == 3
    resized.use_cache(cache, "a")
    read(resized, idx, 0)
    assert cache.stats()["datasets"]["a"]["hits"] == 0
    for p in (a, b, plain_b, resized):
        p.close()


def test_only_a_prefix_with_work_in_it_is_cached(tmp_path, images):
    cache = DecodeCache(1 << 20)
    path = tmp_path / "bare.toml"
    path.write_text(
        '[[stages]]\nname = "m"\nsource = { uri = "mock://cifar10?n=64" }\n'
        '[[stages]]\nname = "flip"\ninput = "m"\nflip = {}\n'
    )
    bare = open_source(f"pipeline://{path}")
    assert isinstance(bare, Pipeline) and not bare.use_cache(cache, "bare")  # the source alone: nothing saved
    assert not pipeline(tmp_path, images).use_cache(DecodeCache(0), "off")
    bare.close()


def test_the_ram_tier_never_grows_past_its_limit(tmp_path):
    limit = 50_000
    cache = DecodeCache(limit)
    path = tmp_path / "n.toml"
    path.write_text(
        '[[stages]]\nname = "m"\nsource = { uri = "mock://cifar10?n=2000" }\n'
        '[[stages]]\nname = "norm"\ninput = "m"\nnormalize = { mean = 1.0, std = 2.0 }\n'
        '[[stages]]\nname = "flip"\ninput = "norm"\nflip = {}\n'
    )
    source = open_source(f"pipeline://{path}")
    plain = open_source(f"pipeline://{path}")
    assert isinstance(source, Pipeline) and source.use_cache(cache, "n")
    row = 3 * 32 * 32 * 4 + 8  # float32 sample and int64 label
    for start in range(0, 1600, 100):
        idx = np.arange(start, start + 100)
        assert np.array_equal(read(source, idx, 0)[0], read(plain, idx, 0)[0])
        stats = cache.stats()
        assert stats["bytes"] <= limit and stats["entries"] == limit // row
    assert stats["evictions"] == 1600 - limit // row
    big = Entry(np.zeros(limit + 1, np.uint8), np.zeros((), np.int64))
    cache.put(("n", "train", 10**6, "d"), big)  # larger than the whole tier: not kept
    assert cache.get(("n", "train", 10**6, "d")) is None and cache.stats()["bytes"] <= limit
    source.close()
    plain.close()


def test_the_disk_tier_keeps_what_ram_evicts_and_stays_under_its_limit(tmp_path, images):
    disk = tmp_path / "dc"
    cache = DecodeCache(4_000, disk_bytes=60_000, disk_dir=str(disk))
    cached, plain = pipeline(tmp_path, images, name="c.toml"), pipeline(tmp_path, images, name="p.toml")
    cached.use_cache(cache, "imgs")
    idx = np.arange(24)
    for epoch in range(3):
        assert np.array_equal(read(cached, idx, epoch)[0], read(plain, idx, epoch)[0])
        stats = cache.stats()["disk"]
        assert stats["bytes"] <= 60_000
        assert sum(f.stat().st_size for f in disk.iterdir()) == stats["bytes"]
    assert stats["hits"] > 0 and stats["writes"] > 0
    cached.close()
    plain.close()
    cache.close()
    assert not list(disk.iterdir())  # emptied on close


def entries_on_disk(tmp_path: Path) -> tuple[DecodeCache, Path, list[tuple]]:
    disk = tmp_path / "dc"
    cache = DecodeCache(1, disk_bytes=10 << 20, disk_dir=str(disk))  # RAM of one byte: all goes to disk
    keys = [("d", "train", i, "digest") for i in range(3)]
    for i, key in enumerate(keys):
        cache.put(key, Entry(np.full((3, 4, 4), i, np.uint8), np.array(i)))
    assert len(list(disk.iterdir())) == 3
    return cache, disk, keys


@pytest.mark.parametrize("damage", ["truncate", "flip_a_byte", "empty", "swap"])
def test_a_corrupt_or_truncated_disk_file_is_decoded_again_not_served(tmp_path, damage):
    cache, disk, keys = entries_on_disk(tmp_path)
    files = {p.name: p for p in disk.iterdir()}
    victim = files[file_name(keys[1])]
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[: len(data) - 7])
    elif damage == "flip_a_byte":
        victim.write_bytes(data[:-3] + bytes([data[-3] ^ 1]) + data[-2:])
    elif damage == "empty":
        victim.write_bytes(b"")
    else:  # another sample's intact file under this sample's name
        victim.write_bytes(files[file_name(keys[2])].read_bytes())
    assert cache.get(keys[1]) is None  # a miss: the pipeline decodes it again
    assert not victim.exists() and cache.stats()["disk"]["corrupt"] == 1
    good = cache.get(keys[0])
    assert good is not None and np.array_equal(good.x, np.zeros((3, 4, 4), np.uint8))
    cache.close()


def test_the_disk_tier_never_follows_a_symlink_out_of_its_directory(tmp_path):
    cache, disk, keys = entries_on_disk(tmp_path)
    outside = tmp_path / "outside"
    outside.write_bytes((disk / file_name(keys[0])).read_bytes())  # a valid file, but not in the cache dir
    target = disk / file_name(keys[0])
    target.unlink()
    target.symlink_to(outside)
    assert cache.get(keys[0]) is None  # not read through the link
    cache.close()  # clears the directory: the link may go, its target stays
    assert outside.exists()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(ConfigError, match="not a symlink"):
        DecodeCache(1, disk_bytes=1 << 20, disk_dir=str(link))
    assert not os.listdir(tmp_path / "elsewhere")


def test_a_provider_shares_its_cache_and_shows_it_in_busctl_datasets_and_prometheus(
    tmp_path, images, start_provider, client_for, router, state_dir
):
    from libbus.wire.messages import BatchRequest
    from tests.support import busctl, scrape, value

    path = tmp_path / "train.toml"
    path.write_text(TRAIN.format(data=images, seed=0))
    running = start_provider(
        f"imgs=pipeline://{path}",
        "plain=mock://mnist?n=60",
        name="prov-dc",
        metrics_bind="127.0.0.1:0",
        decode_cache_bytes=32 << 20,
        decode_cache_disk_bytes=8 << 20,
    )
    # three jobs (clients) over the same 12 samples: in epochs 0, 1 and 1 again
    for epoch in (0, 1, 1):
        client = client_for(running.endpoint)
        for start in (0, 6):
            client.request(BatchRequest(dataset="imgs", split="train", range=[start, start + 6], epoch=epoch))
    me = dict(service="provider", name="prov-dc")
    s = scrape(running.service.metrics.url)
    assert value(s, "batchbus_decode_cache_hits_total", dataset="imgs", **me) == 12
    assert value(s, "batchbus_decode_cache_misses_total", dataset="imgs", **me) == 12
    assert value(s, "batchbus_decode_cache_hit_rate", dataset="imgs", **me) == 0.5
    assert value(s, "batchbus_decode_cache_final_hits_total", dataset="imgs", **me) == 12
    assert value(s, "batchbus_decode_cache_final_misses_total", dataset="imgs", **me) == 24
    assert value(s, "batchbus_decode_cache_entries", **me) == 12 + 24  # decoded, and final for epochs 0 and 1
    assert 0 < value(s, "batchbus_decode_cache_bytes", **me) <= 32 << 20
    assert value(s, "batchbus_decode_cache_disk_limit_bytes", **me) == 8 << 20
    disk = Path(running.service.decode_cache.disk.path)
    assert disk == state_dir / "decode-cache" / "prov-dc"

    args = ("datasets", "--router", router.endpoint, "--state-dir", str(state_dir))
    env = {"BATCHBUS_REQUEST_TIMEOUT_S": "5", "BATCHBUS_REQUEST_RETRIES": "0"}
    for _ in range(100):  # the router holds the provider's stats as of its last heartbeat
        out = busctl(*args, "--json", env=env)
        assert out.returncode == 0, out.stderr
        rows = {r["dataset"]: r for r in json.loads(out.stdout)}
        if rows["imgs"]["decode_cache"].get("prov-dc", {}).get("hits") == 12:
            break
    cache = rows["imgs"]["decode_cache"]["prov-dc"]
    assert cache["misses"] == 12 and cache["entries"] == 36 and cache["limit_bytes"] == 32 << 20
    assert cache["final_hits"] == 12 and cache["final_misses"] == 24
    assert rows["plain"]["decode_cache"] == {}  # mock://mnist: no pipeline, nothing cached
    text = busctl(*args, env=env)
    assert "cache      prov-dc: 36 samples" in text.stdout and "hit rate 50.0%" in text.stdout, text.stdout
    assert "final outputs: hits 12, misses 24" in text.stdout, text.stdout
    running.shutdown()
    assert not any(disk.iterdir())


def test_decode_cache_limits_are_checked(tmp_path):
    from libbus.config import load_settings

    with pytest.raises(ConfigError, match="decode_cache_bytes .*BATCHBUS_DECODE_CACHE_BYTES.* not negative"):
        load_settings(env={"BATCHBUS_STATE_DIR": str(tmp_path), "BATCHBUS_DECODE_CACHE_BYTES": "-1"})
    settings, sources = load_settings(env={"BATCHBUS_STATE_DIR": str(tmp_path)})
    assert settings.decode_cache_bytes == 0 and settings.decode_cache_disk_bytes == 0  # off by default


def numeric_prefix(tmp_path: Path) -> tuple[Pipeline, PrefixCache]:
    path = tmp_path / "n.toml"
    path.write_text(
        '[[stages]]\nname = "m"\nsource = { uri = "mock://cifar10?n=64" }\n'
        '[[stages]]\nname = "norm"\ninput = "m"\nnormalize = { mean = 1.0, std = 2.0 }\n'
        '[[stages]]\nname = "flip"\ninput = "norm"\nflip = {}\n'
    )
    source = open_source(f"pipeline://{path}")
    assert isinstance(source, Pipeline)
    return source, PrefixCache(DecodeCache(1 << 20), "n", source.stages[:2])


def through_prefix(source: Pipeline, chunk: Chunk) -> None:
    for stage in source.stages[:2]:
        stage.apply(chunk)


def test_a_sample_being_decoded_is_waited_for_not_decoded_again(tmp_path):
    source, prefix = numeric_prefix(tmp_path)
    stop = threading.Event()
    first = Chunk(None, 0, np.arange(0, 4), "train", 0)
    prefix.lookup(first, stop, time.monotonic() + 60)  # claims 0..3: its decode is under way
    assert first.indices.tolist() == [0, 1, 2, 3]
    second = Chunk(None, 0, np.arange(2, 6), "train", 0)
    waiter = threading.Thread(target=prefix.lookup, args=(second, stop, time.monotonic() + 60))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # waits for samples 2 and 3 rather than decoding them too
    through_prefix(source, first)
    prefix.merge(first)  # stored: the waiter takes them from the cache
    waiter.join(10)
    assert not waiter.is_alive()
    assert second.indices.tolist() == [4, 5]  # only what nobody decodes
    through_prefix(source, second)
    prefix.merge(second)
    plain = Chunk(None, 0, np.arange(2, 6), "train", 0)
    through_prefix(source, plain)
    assert np.array_equal(second.x, plain.x)
    assert prefix.cache.stats()["hits"] == 2 and prefix.cache.stats()["misses"] == 6
    source.close()


def test_a_final_output_being_computed_is_waited_for_not_computed_again(tmp_path, images):
    cached, plain = pipeline(tmp_path, images, name="c.toml"), pipeline(tmp_path, images, name="p.toml")
    cached.use_cache(DecodeCache(64 << 20), "imgs")
    assert cached.final is not None
    stop = threading.Event()
    first = np.arange(0, 4)
    rows = cached.final.lookup("train", first, 0, stop, time.monotonic() + 60)  # another job computes 0..3
    assert rows.misses.tolist() == [0, 1, 2, 3]
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(read(cached, np.arange(2, 6), 0)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # waits for samples 2 and 3 rather than computing them too
    x, y = read(plain, first, 0)
    cached.final.store(rows, "train", first, x, y, 0)
    rows.release()
    waiter.join(30)
    assert not waiter.is_alive()
    want = read(plain, np.arange(2, 6), 0)
    assert np.array_equal(got[0][0], want[0]) and np.array_equal(got[0][1], want[1])
    crop = next(s for s in cached.metrics()["stages"] if s["name"] == "crop")
    assert crop["items_in"] == 2  # only 4 and 5 went through the stages
    assert cached.final.cache.stats()["final"]["hits"] == 2
    cached.close()
    plain.close()


def test_a_failed_decode_releases_its_claims_and_the_waiter_decodes(tmp_path):
    source, prefix = numeric_prefix(tmp_path)
    stop = threading.Event()
    doomed = Chunk(None, 0, np.arange(10, 12), "train", 0)
    prefix.lookup(doomed, stop, time.monotonic() + 60)
    other = Chunk(None, 0, np.arange(10, 13), "train", 0)
    waiter = threading.Thread(target=prefix.lookup, args=(other, stop, time.monotonic() + 60))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()
    PrefixCache.abandon(doomed)  # its batch failed: the engine drops the chunk
    waiter.join(10)
    assert not waiter.is_alive() and other.indices.tolist() == [10, 11, 12]
    # and a stopping pipeline ends a wait at once
    prefix.lookup(held := Chunk(None, 0, np.arange(20, 21), "train", 0), stop, time.monotonic() + 60)
    stop.set()
    late = Chunk(None, 0, np.arange(20, 21), "train", 0)
    prefix.lookup(late, stop, time.monotonic() + 60)
    assert late.indices.tolist() == [20] and held.indices.tolist() == [20]
    source.close()


def test_a_skipped_bad_image_is_served_on_every_read_with_the_cache(tmp_path, images):
    bad = sorted((images / "train" / "class1").iterdir())[0]
    bad.write_bytes(bad.read_bytes()[:50])
    path = tmp_path / "skip.toml"
    path.write_text(TRAIN.format(data=images, seed=0).replace('bad = "fail"', 'bad = "skip"'))
    source = open_source(f"pipeline://{path}")
    assert isinstance(source, Pipeline) and source.use_cache(DecodeCache(64 << 20), "imgs")
    files = [p for p, _ in source.source.store.files["train"]]
    at = files.index(bad)
    first = read(source, np.arange(24), 0)
    again = read(source, np.array([at - 1, at, at + 1]), 0)  # its neighbours now hits, it too
    alone = read(source, np.array([at]), 1)
    assert np.array_equal(again[1], first[1][at - 1 : at + 2]) and alone[1][0] == first[1][at]
    source.close()

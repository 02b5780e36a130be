"""TFRecord shards of ``tf.train.Example``, written by a peer's writer (the ``tfrecord`` package: TensorFlow's
framing and messages; TensorFlow itself is too big to install for a test), served as written: features as
named fields or as ``(x, y)``, gzip or not, the offsets index kept on disk and rebuilt when a file changes,
a corrupt or cut record named with its file and offset, and both deliveries through a real provider."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from libbus.errors import DatasetError
from libbus.loader.remote import RemoteLoader
from services.provider.sources import open_source
from services.provider.sources.formats import tfrecord
from tests.support.peers import write_tfrecords


@pytest.fixture
def written(tmp_path):
    d = tmp_path / "tfr"
    return d, write_tfrecords(d, np.random.default_rng(7))


def _carved(ref: dict, split: str, fraction: float = 0.1) -> dict:
    """What ``split`` serves: val is the tail of train, in file order."""
    n = len(ref["train"]["label"])
    cut = n - round(n * fraction)
    part = {"train": slice(0, cut), "val": slice(cut, n)}.get(split, slice(None))
    return {k: v[part] for k, v in ref["train" if split in ("train", "val") else split].items()}


def test_every_feature_is_a_named_field_read_exactly(written):
    d, ref = written
    source = open_source(f"file://{d}")
    try:
        assert [f.describe() for f in source.fields] == [
            "jpeg bytes *",
            "label int64 ()",
            "pixels float32 (6,)",
            "tokens int64 (?,)",
        ]
        info = source.info()
        assert info["format"] == "tfrecord" and info["kind"] == "fields" and info["files"] == 3
        by_name = {f["name"]: f for f in info["fields"]}
        assert by_name["jpeg"]["max_bytes"] == max(len(b) for s in ref.values() for b in s["jpeg"])
        assert by_name["tokens"]["max_bytes"] == 8 * max(len(t) for s in ref.values() for t in s["tokens"])
        assert [source.num_samples(s) for s in ("train", "val", "test")] == [27, 3, 6]
        for split in ("train", "val"):
            want = _carved(ref, split)
            idx = np.array([2, 0, len(want["label"]) - 1, 1, 0])
            got = source.read_fields(split, idx)
            assert got["jpeg"] == [want["jpeg"][i] for i in idx]
            assert got["label"].tolist() == [want["label"][i] for i in idx]
            assert got["pixels"].tobytes() == np.stack([want["pixels"][i] for i in idx]).tobytes()
            assert [t.tolist() for t in got["tokens"]] == [want["tokens"][i].tolist() for i in idx]
    finally:
        source.close()


def test_label_and_one_field_are_an_xy_dataset_reshaped(written):
    d, ref = written
    source = open_source(f"file://{d}?fields=pixels&label=label&shape=2,3&classes=4")
    try:
        assert source.xy and source.sample_shape == (2, 3) and source.num_classes == 4
        x, y = source.read("train", np.array([5, 1]))
        assert x.tobytes() == np.stack([ref["train"]["pixels"][i] for i in (5, 1)]).tobytes()
        assert y.tolist() == [ref["train"]["label"][i] for i in (5, 1)]
    finally:
        source.close()


def test_gzip_shards_read_as_the_plain_ones(tmp_path):
    plain, gz = tmp_path / "plain", tmp_path / "gz"
    write_tfrecords(plain, np.random.default_rng(3))
    write_tfrecords(gz, np.random.default_rng(3), gz=True)
    assert all(p.name.endswith(".gz") for p in gz.iterdir() if p.is_file())
    a, b = open_source(f"file://{plain}"), open_source(f"file://{gz}")
    try:
        idx = np.arange(a.num_samples("train"))[::-1].copy()
        for name, va in a.read_fields("train", idx).items():
            vb = b.read_fields("train", idx)[name]
            assert [bytes(v) if isinstance(v, bytes) else np.asarray(v).tobytes() for v in va] == [
                bytes(v) if isinstance(v, bytes) else np.asarray(v).tobytes() for v in vb
            ], name
    finally:
        a.close()
        b.close()


def test_the_index_is_kept_on_disk_and_rebuilt_when_a_file_changes(written, monkeypatch):
    d, _ = written
    open_source(f"file://{d}").close()
    kept = sorted((d / ".batchbus-cache").glob("*.tfrecord-index.npz"))
    assert len(kept) == 3
    walks = []
    real = tfrecord.build_index
    monkeypatch.setattr(tfrecord, "build_index", lambda *a: walks.append(a[0]) or real(*a))
    open_source(f"file://{d}").close()
    assert walks == [], "an unchanged file was walked again"
    write_tfrecords(d, np.random.default_rng(8), per_shard=9)  # rewritten: other sizes and mtimes
    source = open_source(f"file://{d}")
    assert len(walks) == 3 and source.num_samples("train") + source.num_samples("val") == 18
    source.close()


def _record_offsets(path) -> list[int]:
    data, pos, out = path.read_bytes(), 0, []
    while pos < len(data):
        out.append(pos)
        pos += 16 + struct.unpack_from("<Q", data, pos)[0]
    return out


def test_a_corrupt_record_is_named_with_its_file_and_offset(written):
    d, _ = written
    path = d / "train-0001-of-0002.tfrecord"
    off = _record_offsets(path)[4]
    data = bytearray(path.read_bytes())
    data[off + 20] ^= 0xFF  # a byte of the record's data: its CRC no longer matches
    path.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=rf"{path.name}: record 4 at byte {off}: the data's CRC does not match"):
        open_source(f"file://{d}")


def test_a_record_corrupted_after_indexing_is_named_when_read(written):
    """The index is trusted while the file's size and mtime match; each record's CRC is checked as read."""
    d, _ = written
    open_source(f"file://{d}").close()
    path = d / "train-0000-of-0002.tfrecord"
    st = path.stat()
    off = _record_offsets(path)[2]
    data = bytearray(path.read_bytes())
    data[off + 14] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    source = open_source(f"file://{d}")
    try:
        source.read_fields("train", np.array([0, 1]))  # others are fine
        with pytest.raises(DatasetError, match=rf"{path.name}: record at byte {off}: its CRC does not match"):
            source.read_fields("train", np.array([2]))
    finally:
        source.close()


@pytest.mark.parametrize("gz", [False, True])
def test_a_file_cut_short_is_named_with_the_offset(tmp_path, gz):
    d = tmp_path / "cut"
    write_tfrecords(d, np.random.default_rng(1), shards=1, gz=gz)
    path = next(d.glob("train-*"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5])
    want = "gzip stream is cut short" if gz else r"record 14 at byte \d+ is cut short"
    with pytest.raises(DatasetError, match=rf"{path.name}.*{want}" if not gz else want):
        open_source(f"file://{d}")


@pytest.mark.parametrize(
    "query, words",
    [
        ("fields=nope", r"no feature 'nope'; the features: jpeg \(bytes \*\), label \(int64 \(\)\)"),
        ("label=pixels", "label .pixels. must be an integer feature of one value per sample"),
        ("label=tokens", "label .tokens. must be an integer feature of one value per sample"),
        ("fields=pixels&label=label&shape=4,4", "shape 4,4 holds 16 values; feature 'pixels' has 6"),
        ("fields=jpeg&shape=2", "shape= reshapes x"),
        ("fields=label,label", "each feature once"),
        ("label=label&classes=2", "beyond classes=2"),
    ],
)
def test_bad_selections_are_refused_naming_the_feature(written, query, words):
    d, _ = written
    if "classes=2" in query:
        assert max(max(s["label"]) for s in written[1].values()) == 2
    with pytest.raises(DatasetError, match=words):
        open_source(f"file://{d}?{query}")


@pytest.mark.parametrize("shm", [False, True])
def test_tfrecords_through_a_provider_on_both_deliveries(written, start_provider, make_token, shm):
    d, ref = written
    running = start_provider(f"tf=file://{d}", f"xy=file://{d}?fields=pixels&label=label")
    want = _carved(ref, "train")
    with RemoteLoader(
        "tf", provider=running.endpoint, token=make_token(), batch_size=5, shuffle=False, shm=shm, collate="list"
    ) as loader:
        assert loader.transport == ("shm" if shm else "socket")
        seen = 0
        for batch in loader:
            for row in range(len(batch["jpeg"])):
                i = seen + row
                assert batch["jpeg"][row] == want["jpeg"][i] and int(batch["label"][row]) == want["label"][i]
                assert batch["tokens"][row].tolist() == want["tokens"][i].tolist()
                assert batch["pixels"][row].numpy().tobytes() == want["pixels"][i].tobytes()
            seen += len(batch["jpeg"])
        assert seen == len(want["label"])
    with RemoteLoader(
        "xy", provider=running.endpoint, token=make_token(), batch_size=9, shuffle=False, shm=shm
    ) as loader:
        xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in loader])
        assert np.concatenate(xs).tobytes() == np.stack(want["pixels"]).tobytes()
        assert np.concatenate(ys).tolist() == want["label"]


def test_a_list_of_byte_strings_is_refused_naming_it_unless_left_out(tmp_path):
    from tfrecord.writer import TFRecordWriter

    d = tmp_path / "tags"
    d.mkdir()
    writer = TFRecordWriter(str(d / "train.tfrecord"))
    for i in range(10):
        writer.write({"tags": ([b"a", b"bc"][: 1 + i % 2], "byte"), "label": (i % 2, "int")})
    writer.close()
    with pytest.raises(DatasetError, match=r"feature 'tags' holds up to 2 byte strings per record.*fields=label"):
        open_source(f"file://{d}")
    source = open_source(f"file://{d}?fields=label&val_fraction=0")
    try:
        assert source.read_fields("train", np.arange(4))["label"].tolist() == [0, 1, 0, 1]
    finally:
        source.close()


def test_gzip_shards_in_a_bucket_are_decompressed_once_into_the_cache(tmp_path, monkeypatch):
    """A gzip file cannot be read by range: it is fetched through the location once, decompressed into the
    cache, and read from there; the next open reads neither it nor its records again."""
    from tests.support.s3server import s3_in_env

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    ref = write_tfrecords(tmp_path / "gz", np.random.default_rng(9), gz=True)
    with s3_in_env() as s3:
        s3.put_dir("tfr", "gz", tmp_path / "gz")
        uri = "s3://tfr/gz/?retries=1&backoff=0.01&fields=jpeg,label"
        source = open_source(uri)
        try:
            got = source.read_fields("train", np.array([4, 0]))
            assert got["jpeg"] == [ref["train"]["jpeg"][i] for i in (4, 0)]
            assert got["label"].tolist() == [ref["train"]["label"][i] for i in (4, 0)]
        finally:
            source.close()
        copies = sorted((tmp_path / "xdg").rglob("*.tfrecord"))
        assert len(copies) == 3 and len(sorted((tmp_path / "xdg").rglob("*.tfrecord-index.npz"))) == 3
        before = [p.stat().st_mtime_ns for p in copies]
        open_source(uri).close()
        assert [p.stat().st_mtime_ns for p in copies] == before  # reused, not made again

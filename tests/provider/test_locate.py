"""Where each sample lives: ``LocateSamples`` to a real provider over real files, each
location checked by reading the bytes it names and comparing them with the sample; refusals (too many
indices, out of range, another dataset's token, the private test split); ``busctl job samples --where``
on a real job."""

from __future__ import annotations

import gzip
import json
import re
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from libbus.constants import MAX_LOCATE_INDICES
from libbus.errors import BadRequest, Forbidden, OutOfRange, SplitPrivate, TooLarge
from libbus.wire.messages import BatchRequest, GetJobSamples, LocateSamples, frame_buffer
from tests.support.formats import BUILDERS, expected_splits
from tests.support.images import write_imagefolder, write_shards
from tests.support.jobs import SPEC, JobCluster

LOCATION = re.compile(r"^(?P<file>[^@]+)@(?P<offset>\d+)\+(?P<length>\d+)$")


def _npy_dataset(root: Path, n: int = 50) -> np.ndarray:
    root.mkdir(parents=True, exist_ok=True)
    x = np.arange(n * 12, dtype=np.float32).reshape(n, 3, 4)  # every sample's bytes differ
    np.save(root / "train_x.npy", x)
    np.save(root / "train_y.npy", (np.arange(n) % 3).astype(np.int64))
    return x


def _bytes_at(root: Path, location: str) -> bytes:
    m = LOCATION.match(location)
    assert m, f"not FILE@OFFSET+LENGTH: {location!r}"
    assert not Path(m["file"]).is_absolute(), location  # never the provider's own path
    with open(root / m["file"], "rb") as f:
        f.seek(int(m["offset"]))
        return f.read(int(m["length"]))


def _locate(client, dataset: str, split: str, indices: list[int]) -> list[str]:
    return client.request(LocateSamples(dataset=dataset, split=split, indices=indices)).locations


def test_npy_locations_name_the_file_and_the_bytes_of_each_sample(tmp_path, start_provider, client_for):
    root = tmp_path / "arrays"
    x = _npy_dataset(root)
    provider = start_provider(f"arr=file://{root}?memory=stream")
    client = client_for(provider.endpoint)
    train = [0, 7, 44, 3, 3]
    found = _locate(client, "arr", "train", train)
    assert len(found) == len(train)
    for i, where in zip(train, found):
        assert where.startswith("train_x.npy@"), where
        assert _bytes_at(root, where) == x[i].tobytes()
    # val is carved from the tail of train: its index 0 is the file's sample 45 (val_fraction 0.1 of 50)
    [where] = _locate(client, "arr", "val", [0])
    assert _bytes_at(root, where) == x[45].tobytes()


def test_image_folder_locations_are_the_image_files_under_the_root(tmp_path, start_provider, client_for):
    root = write_imagefolder(tmp_path / "folder", per_class=6, classes=3)
    provider = start_provider(f"imgs=file://{root}?size=8&val_fraction=0")
    client = client_for(provider.endpoint)
    indices = list(range(18))
    found = _locate(client, "imgs", "train", indices)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert sorted(found) == files  # each sample its own file, named under the root
    # the file a location names is the sample served at that index: its class folder is the label
    reply = client.request(BatchRequest.for_indices(np.array(indices), dataset="imgs", split="train"))
    labels = np.frombuffer(frame_buffer(reply.frames[1]), np.dtype(reply.dtypes[1])).tolist()
    assert [int(Path(w).parts[1].removeprefix("class")) for w in found] == labels
    assert len(set(labels)) == 3


def test_webdataset_locations_name_the_shard_member_and_its_bytes(tmp_path, start_provider, client_for):
    root = tmp_path / "shards"
    write_shards(root, "train", shards=2, per_shard=5)
    provider = start_provider(f"wds=file://{root}?size=8&val_fraction=0")
    client = client_for(provider.endpoint)
    found = _locate(client, "wds", "train", [0, 6, 9])
    for where in found:
        m = re.match(r"^(?P<shard>train-\d{4}\.tar):(?P<member>[^@]+)@(?P<offset>\d+)\+(?P<length>\d+)$", where)
        assert m, where
        with tarfile.open(root / m["shard"]) as tar:
            member = tar.getmember(m["member"])
            expected = tar.extractfile(member).read()  # type: ignore[union-attr]
        assert member.offset_data == int(m["offset"]) and member.size == int(m["length"])
        assert _bytes_at(root, f"{m['shard']}@{m['offset']}+{m['length']}") == expected
    assert found[0].startswith("train-0000.tar:train/s000000.") and found[1].startswith("train-0001.tar:train/s000006.")


def test_a_source_that_does_not_know_says_nothing(start_provider, client_for):
    provider = start_provider("mnist=mock://mnist?n=600")
    client = client_for(provider.endpoint)
    assert _locate(client, "mnist", "train", [0, 5, 599 - 60]) == ["", "", ""]


def test_bad_requests_are_refused(tmp_path, start_provider, client_for, make_token):
    root = tmp_path / "arrays"
    _npy_dataset(root)
    provider = start_provider(f"arr=file://{root}", "mnist=mock://mnist?n=600")
    client = client_for(provider.endpoint)
    with pytest.raises(TooLarge, match=f"at most {MAX_LOCATE_INDICES}"):
        _locate(client, "arr", "train", [0] * (MAX_LOCATE_INDICES + 1))
    with pytest.raises(OutOfRange, match=r"index 45 is outside arr/train \(0\.\.44\)"):
        _locate(client, "arr", "train", [1, 45])
    with pytest.raises(OutOfRange, match="index -1"):
        _locate(client, "arr", "train", [-1])
    with pytest.raises(BadRequest, match="list of integers"):
        _locate(client, "arr", "train", ["3"])  # type: ignore[list-item]
    with pytest.raises(SplitPrivate, match="never leaves"):
        _locate(client, "arr", "test", [0])
    # a token scoped to another dataset is refused, as its batches would be
    scoped = client_for(provider.endpoint, "reader", make_token("reader", sub="s", datasets=["mnist"]))
    assert _locate(scoped, "mnist", "train", [1]) == [""]
    with pytest.raises(Forbidden, match="scope"):
        _locate(scoped, "arr", "train", [1])


def test_busctl_job_samples_where_names_each_samples_bytes(tmp_path):
    root = tmp_path / "arrays"
    x = _npy_dataset(root, n=200)
    cluster = JobCluster(tmp_path / "cluster")
    try:
        cluster.start_router()
        cluster.start("provider", "provider", "--dataset", f"arr=file://{root}", ready=True)
        cluster.start_trainer("t1")
        job = cluster.submit_spec({**SPEC, "dataset": "arr", "epochs": 1})
        info = cluster.wait_end(job, timeout=90)
        assert info["state"] == "succeeded", f"{info['error']}; logs in {cluster.state}"
        step = 3
        [entry] = cluster.admin.request(GetJobSamples(job=job, step=step)).samples
        out = json.loads(cluster.busctl("job", "samples", job, "--step", str(step), "--where", "--json").stdout)
        [got] = out["samples"]
        assert got["indices"] == entry["indices"] and len(got["locations"]) == SPEC["batch_size"]
        for i, where in zip(got["indices"], got["locations"]):
            assert _bytes_at(root, where) == x[i].tobytes()
        text = cluster.busctl("job", "samples", job, "--step", str(step), "--where").stdout
        first = entry["indices"][0]
        assert f"  {first}  train_x.npy@" in text, text
        # without --where nothing changes: indices on one line
        plain = cluster.busctl("job", "samples", job, "--step", str(step)).stdout
        assert " ".join(map(str, entry["indices"])) in plain and "@" not in plain
    finally:
        cluster.close()


def test_parquet_locations_name_the_file_and_row(tmp_path, start_provider, client_for):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "pq" / "data"
    data.mkdir(parents=True)
    for f in range(2):  # ids 0..9 in the first file, 10..19 in the second; row groups of 3
        ids = list(range(f * 10, f * 10 + 10))
        table = pa.table({"x": pa.array([[float(i)] * 3 for i in ids]), "label": pa.array([i % 3 for i in ids])})
        pq.write_table(table, data / f"train-{f:05d}-of-00002.parquet", row_group_size=3)
    provider = start_provider(f"pq=file://{tmp_path / 'pq'}?val_fraction=0")
    client = client_for(provider.endpoint)
    indices = [0, 4, 11, 19]
    reply = client.request(BatchRequest.for_indices(np.array(indices), dataset="pq", split="train"))
    served = np.frombuffer(frame_buffer(reply.frames[0]), np.dtype(reply.dtypes[0])).reshape(reply.shapes[0])
    for where, sample in zip(_locate(client, "pq", "train", indices), served):
        m = re.match(r"^(?P<file>data/train-\d{5}-of-00002\.parquet) row (?P<row>\d+)$", where)
        assert m, where
        row = pq.read_table(tmp_path / "pq" / m["file"]).slice(int(m["row"]), 1).to_pylist()[0]
        assert row["x"] == sample.tolist()


def test_tfrecord_locations_name_each_records_frame(tmp_path, start_provider, client_for):
    from tests.support.peers import write_tfrecords

    root = tmp_path / "tfr"
    want = write_tfrecords(root, np.random.default_rng(3))
    provider = start_provider(f"tfr=file://{root}?fields=pixels,label&val_fraction=0")
    client = client_for(provider.endpoint)
    indices = [0, 14, 15, 29]  # the first and last records of both train files
    for i, where in zip(indices, _locate(client, "tfr", "train", indices)):
        frame = _bytes_at(root, where)
        assert where.startswith(f"train-{i // 15:04d}-of-0002.tfrecord@"), where
        (length,) = struct.unpack_from("<Q", frame)
        assert len(frame) == 8 + 4 + length + 4  # length, its CRC, the Example, its CRC
        assert want["train"]["pixels"][i].tobytes() in frame[12 : 12 + length]


@pytest.mark.parametrize("name", ["idx", "idx-gz-float", "cifar10", "tokens-bin", "npz", "npz-compressed"])
def test_every_array_layout_names_the_bytes_of_each_sample(tmp_path, start_provider, client_for, name):
    built = BUILDERS[name](tmp_path, np.random.default_rng(9))
    provider = start_provider(f"d=file://{tmp_path}{'?' + built.query if built.query else ''}")
    client = client_for(provider.endpoint)
    x = expected_splits(built)["train"][0]
    stored = np.dtype(built.info["dtype"]).newbyteorder(">" if name.startswith("idx") else "<")
    indices = [0, len(x) // 2, len(x) - 1]
    for i, where in zip(indices, _locate(client, "d", "train", indices)):
        packed = where.endswith(" (decompressed)")
        m = re.match(
            r"^(?P<file>[^\[@]+)(\[(?P<member>[^\]]+)\])?@(?P<offset>\d+)\+(?P<length>\d+)$",
            where.removesuffix(" (decompressed)"),
        )
        assert m, where
        if packed:  # offsets of the decompressed bytes: of a gzip file, or of a compressed npz member
            path = tmp_path / m["file"]
            if m["member"]:
                with zipfile.ZipFile(path) as z:
                    data = z.read(m["member"])
            else:
                data = gzip.decompress(path.read_bytes())
            got = data[int(m["offset"]) : int(m["offset"]) + int(m["length"])]
        elif m["member"]:  # a stored npz member: offsets in the .npz file itself
            got = _bytes_at(tmp_path, f"{m['file']}@{m['offset']}+{m['length']}")
        else:
            got = _bytes_at(tmp_path, where)
        assert got == np.ascontiguousarray(x[i]).astype(stored).tobytes(), (name, i, where)
    if name == "cifar10":  # the run of samples spans two files: the last sample is in the second
        assert where.startswith(f"data_batch_2.bin@{(len(x) - 1 - 10) * 3073 + 1}+3072"), where
    if name == "idx-gz-float":
        assert where.endswith(" (decompressed)")

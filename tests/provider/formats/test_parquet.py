"""Parquet datasets written here with pyarrow in the layouts dataset hubs use: PNG images in the
``{bytes, path}`` struct with hub class names, JPEG bytes, list and numeric columns, subset folders,
validation files; reads equal what was written, row groups are read through a bounded cache, bad
layouts and columns are refused naming what is wrong, and a provider serves one through the real
services (parquet:// and file://)."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from libbus.errors import DatasetError
from libbus.wire.messages import BatchRequest, DatasetInfoRequest
from services.provider.sources import open_source


def png(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def write_images(root, rng, splits=(("train", 2, 30), ("test", 1, 9)), names=("zero", "one", "two")):
    """HF-style ``data/{split}-0000i-of-0000n.parquet`` of 6x5 grey PNGs with ClassLabel metadata."""
    (root / "data").mkdir(parents=True)
    meta = {
        b"huggingface": json.dumps(
            {
                "info": {
                    "features": {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": list(names)}}
                }
            }
        ).encode()
    }
    out = {}
    for split, shards, n in splits:
        x = rng.integers(0, 256, (n, 6, 5), dtype=np.uint8)
        y = rng.integers(0, len(names), n)
        out[split] = (x[:, None], y)
        for s, part in enumerate(np.array_split(np.arange(n), shards)):
            images = [{"bytes": png(x[i]), "path": f"{i}.png"} for i in part]
            table = pa.table({"image": images, "label": pa.array(y[part], pa.int64())}).replace_schema_metadata(meta)
            pq.write_table(table, root / "data" / f"{split}-{s:05d}-of-{shards:05d}.parquet", row_group_size=4)
    return out


def test_hub_images_read_back_as_written(tmp_path):
    want = write_images(tmp_path, np.random.default_rng(1))
    src = open_source(f"parquet://{tmp_path}?val_fraction=0.2")
    info = src.info()
    assert info["format"] == "parquet" and info["columns"] == ["image"] and info["label_column"] == "label"
    assert info["sample_shape"] == [1, 6, 5] and info["dtype"] == "uint8"
    assert info["class_names"] == ["zero", "one", "two"] and info["num_classes"] == 3
    assert [info["splits"][s]["num_samples"] for s in ("train", "val", "test")] == [24, 6, 9]
    x, y = want["train"]
    idx = np.array([23, 0, 15, 16, 4, 4])  # across both files and several row groups, a duplicate
    got_x, got_y = src.read("train", idx)
    assert np.array_equal(got_x, x[idx]) and np.array_equal(got_y, y[idx])
    assert np.array_equal(src.read("val", np.arange(6))[0], x[24:])
    assert np.array_equal(src.read("test", np.arange(9))[1], want["test"][1])


def test_row_groups_are_cached_within_the_budget(tmp_path):
    write_images(tmp_path, np.random.default_rng(2), splits=(("train", 1, 40),))
    src = open_source(f"parquet://{tmp_path}?cache_mb=0.000001")
    for i in range(0, 36, 3):
        src.read("train", np.array([i]))
    assert len(src._cache) == 1  # the budget holds less than one group: only the last stays
    roomy = open_source(f"parquet://{tmp_path}")
    roomy.read("train", np.arange(36))
    assert len(roomy._cache) == 9  # the 9 row groups of 4 rows that train (36 of 40) touches


def test_jpeg_bytes_decode_as_pillow_does(tmp_path):
    rng = np.random.default_rng(3)
    blobs = []
    for _ in range(5):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (8, 7, 3), dtype=np.uint8)).save(buf, format="JPEG")
        blobs.append(buf.getvalue())
    pq.write_table(
        pa.table({"img": pa.array(blobs, pa.binary()), "target": [0, 1, 0, 1, 1]}), tmp_path / "train.parquet"
    )
    src = open_source(f"parquet://{tmp_path}?val_fraction=0")
    x, y = src.read("train", np.arange(5))
    assert x.shape == (5, 3, 8, 7) and y.tolist() == [0, 1, 0, 1, 1]
    assert np.array_equal(x[2], np.asarray(Image.open(io.BytesIO(blobs[2])).convert("RGB")).transpose(2, 0, 1))


def test_list_columns_in_subsets_with_validation_files(tmp_path):
    rng = np.random.default_rng(4)
    data = {}
    for subset in ("small", "big"):
        for split, n in (("train", 12), ("validation", 5)):
            (tmp_path / subset).mkdir(exist_ok=True)
            feats = rng.standard_normal((n, 2, 3)).astype(np.float32)
            data[subset, split] = feats
            column = pa.array([f.tolist() for f in feats], pa.list_(pa.list_(pa.float32())))
            pq.write_table(
                pa.table({"features": column, "labels": rng.integers(0, 4, n)}),
                tmp_path / subset / f"{split}-00000-of-00001.parquet",
                row_group_size=5,
            )
    with pytest.raises(DatasetError, match=r"2 subsets \(big, small\); choose one with \?subset=NAME"):
        open_source(f"parquet://{tmp_path}")
    src = open_source(f"parquet://{tmp_path}?subset=big&label=labels&column=features")
    assert src.sample_shape == (2, 3) and src.dtype == np.float32
    assert src.num_samples("train") == 12 and src.num_samples("val") == 5
    assert np.array_equal(src.read("val", np.array([4, 0]))[0], data["big", "validation"][[4, 0]])
    assert np.array_equal(src.read("train", np.arange(12))[0], data["big", "train"])


@pytest.mark.parametrize("statistics", [True, False])
def test_classes_are_counted_from_statistics_or_labels(tmp_path, statistics):
    table = pa.table({"x": pa.array([[1.0, 2.0]] * 6, pa.list_(pa.float32())), "label": [0, 4, 2, 1, 0, 3]})
    pq.write_table(table, tmp_path / "train.parquet", row_group_size=2, write_statistics=statistics)
    src = open_source(f"parquet://{tmp_path}?val_fraction=0")
    assert src.num_classes == 5 and src.class_names == ["0", "1", "2", "3", "4"]
    pq.write_table(
        table.set_column(1, "label", pa.array([0, 1, -1, 0, 0, 0])),
        tmp_path / "train.parquet",
        write_statistics=statistics,
    )
    with pytest.raises(DatasetError, match="label -1 is negative"):
        open_source(f"parquet://{tmp_path}")


def test_token_lists_of_one_length_and_a_row_that_differs(tmp_path):
    ids = np.arange(60, dtype=np.int32).reshape(12, 5)
    column = pa.array([r.tolist() for r in ids] + [[1, 2]], pa.list_(pa.int32()))
    pq.write_table(pa.table({"input_ids": column}), tmp_path / "train.parquet", row_group_size=5)
    src = open_source(f"parquet://{tmp_path}?val_fraction=0")
    assert src.sample_shape == (5,) and src.dtype == np.int32 and src.label_shape == (0,)
    assert np.array_equal(src.read("train", np.array([11, 0, 6, 7]))[0], ids[[11, 0, 6, 7]])
    with pytest.raises(DatasetError, match=r"row group 2 row 2: column 'input_ids' has shape \(2,\)"):
        src.read("train", np.array([10, 12]))


def test_numeric_columns_side_by_side_and_no_labels(tmp_path):
    pq.write_table(
        pa.table({"a": [1.0, 2.0, 3.0], "b": [10, 20, 30], "note": ["x", "y", "z"]}), tmp_path / "train.parquet"
    )
    src = open_source(f"file://{tmp_path}?column=a,b&label=&val_fraction=0")
    assert src.info()["format"] == "parquet" and src.label_shape == (0,)
    x, y = src.read("train", np.array([2, 0]))
    assert x.tolist() == [[3.0, 30.0], [1.0, 10.0]] and y.shape == (2, 0)


@pytest.mark.parametrize(
    "query, message",
    [
        ("column=pixels", "no column 'pixels'; the columns are image, label"),
        ("label=klass", "no label column 'klass'"),
        ("subset=nope", "no subset folder 'nope'"),
        ("cache_mb=-1", "cache_mb must be a positive number"),
        ("val_fraction=1.5", r"val_fraction must be a number in \[0, 1\)"),
    ],
)
def test_bad_parameters_are_named(tmp_path, query, message):
    write_images(tmp_path, np.random.default_rng(5), splits=(("train", 1, 8),))
    with pytest.raises(DatasetError, match=message):
        open_source(f"parquet://{tmp_path}?{query}")


def test_bad_files_are_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no Parquet train files .* train-\\*.parquet"):
        open_source(f"parquet://{tmp_path / 'empty'}")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    images = [png(np.zeros((4, 4), np.uint8)), png(np.zeros((5, 4), np.uint8))]
    pq.write_table(pa.table({"image": images, "label": [0, 1]}), mixed / "train.parquet")
    src = open_source(f"parquet://{mixed}?val_fraction=0")
    with pytest.raises(DatasetError, match=r"train.parquet row group 0 row 1: column 'image' has shape \(1, 5, 4\)"):
        src.read("train", np.array([1]))
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "train.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        open_source(f"parquet://{junk}")
    two = tmp_path / "two"
    two.mkdir()
    pq.write_table(pa.table({"a": [1], "b": [2], "label": [0]}), two / "train.parquet")
    with pytest.raises(DatasetError, match="cannot tell which column is the feature among a, b"):
        open_source(f"parquet://{two}")


def test_the_provider_serves_a_parquet_dataset(tmp_path, start_provider, client_for):
    want = write_images(tmp_path, np.random.default_rng(6))
    provider = start_provider(f"hub=parquet://{tmp_path}?val_fraction=0.2", f"same=file://{tmp_path}")
    client = client_for(provider.endpoint)
    for name in ("hub", "same"):
        info = client.request(DatasetInfoRequest(dataset=name)).info
        assert info["format"] == "parquet" and info["class_names"] == ["zero", "one", "two"]
    idx = np.array([5, 1, 20], "<i8")
    reply = client.request(BatchRequest(dataset="hub", split="train", frames=[idx.tobytes()]))
    x = np.frombuffer(reply.frames[0].buffer, reply.dtypes[0]).reshape(reply.shapes[0])
    y = np.frombuffer(reply.frames[1].buffer, reply.dtypes[1]).reshape(reply.shapes[1])
    assert np.array_equal(x, want["train"][0][idx]) and np.array_equal(y, want["train"][1][idx])

"""file:// sources against bad files written here byte for byte: the errors a user gets for an unknown or
incomplete layout, a damaged gzip or IDX header, an out-of-range label, a file cut short after opening
and hostile layouts, and the gzip cache. The contract over every format is in tests/provider/sources/test_files.py."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from libbus.errors import DatasetError
from services.provider.sources import open_source
from tests.support.formats import build_idx_gz_float, build_raw, write_cifar, write_idx


def test_gzip_is_decompressed_once_into_the_cache(tmp_path):
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    build_idx_gz_float(data, np.random.default_rng(5))
    open_source(f"file://{data}?cache={cache}")
    copies = sorted(p.name for p in cache.iterdir())
    assert copies == ["train-images-idx4-ubyte", "train-labels-idx1-ubyte"]  # no temporaries left
    stamp = (cache / copies[0]).stat().st_mtime_ns
    open_source(f"file://{data}?cache={cache}")
    assert (cache / copies[0]).stat().st_mtime_ns == stamp  # reused, not decompressed again
    assert not (data / ".batchbus-cache").exists()


def test_damaged_gzip_is_named(tmp_path):
    build_idx_gz_float(tmp_path, np.random.default_rng(6))
    gz = tmp_path / "train-labels-idx1-ubyte.gz"
    gz.write_bytes(gz.read_bytes()[:20])
    with pytest.raises(DatasetError, match=f"{gz.name}: cannot decompress"):
        open_source(f"file://{tmp_path}")


@pytest.mark.parametrize(
    "setup, match",
    [
        (lambda d: None, r"no known dataset layout in .*: expected one of .*train-images-idx3-ubyte.*found nothing"),
        (lambda d: (d / "notes.txt").write_text("hi"), "found notes.txt"),
        (lambda d: np.arange(10, dtype=np.uint16).tofile(d / "s.bin"), "need a sequence length"),
        (
            lambda d: (
                np.arange(99, dtype=np.uint16).tofile(d / "s.bin") or (d / "dataset.toml").write_text("seq_len = 4\n")
            ),
            "token_bytes=2 or 4",
        ),
        (
            lambda d: (
                np.save(d / "s.npy", np.arange(50, dtype=np.uint32)) or (d / "dataset.toml").write_text("seq_len = 4\n")
            ),
            "4-byte tokens need vocab_size",
        ),
        (lambda d: (d / "dataset.toml").write_text("seq_len = 4\nvocab = 3\n"), "unknown key.*vocab"),
        (lambda d: (d / "dataset.toml").write_text("seq_len = 'long'\n"), "seq_len must be a int"),
        (
            lambda d: ((d / "train_x.npy").write_bytes(b"not numpy"), np.save(d / "train_y.npy", np.zeros(3))),
            "train_x.npy: not a readable .npy",
        ),
        (lambda d: np.save(d / "train_x.npy", np.zeros((3, 2))), "has no partner; expected train_y.npy"),
        (
            lambda d: write_idx(d / "train-images-idx3-ubyte", np.zeros((2, 2, 2), np.uint8), 0x08),
            "images without labels",
        ),
    ],
)
def test_layout_errors_say_what_to_do(tmp_path, setup, match):
    setup(tmp_path)
    with pytest.raises(DatasetError, match=match):
        open_source(f"file://{tmp_path}")


def test_missing_directory_and_bad_idx_header(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        open_source(f"file://{tmp_path}/nope")
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((4, 3, 3), np.uint8), 0x08)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"\0\0\x07\x01" + struct.pack(">I", 4) + bytes(4))
    with pytest.raises(DatasetError, match="unknown IDX type code 0x07"):
        open_source(f"file://{tmp_path}")
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(4, np.uint8), 0x08)
    with open(tmp_path / "train-images-idx3-ubyte", "ab") as f:
        f.write(b"extra")
    with pytest.raises(
        DatasetError,
        match=r"header says 4 images of 3x3 uint8 \(52 bytes\) but the file "
        r"has 57 bytes \(longer",
    ):
        open_source(f"file://{tmp_path}")


@pytest.mark.parametrize("memory", ["ram", "stream"])
def test_an_out_of_range_label_is_never_served(tmp_path, memory):
    x = np.zeros((20, 3, 32, 32), np.uint8)
    y = np.zeros(20, np.uint8)
    y[13] = 200
    write_cifar(tmp_path / "data_batch_1.bin", x, y)
    source = open_source(f"file://{tmp_path}?memory={memory}")
    assert np.array_equal(source.read("train", np.arange(10))[1], np.zeros(10))
    with pytest.raises(DatasetError, match="data_batch_1.bin: label 200 is outside the 10 classes"):
        source.read("train", np.array([12, 13]))


def test_a_file_cut_short_after_opening_is_named_when_read(tmp_path):
    build_raw(tmp_path, np.random.default_rng(7))
    source = open_source(f"file://{tmp_path}?memory=stream")
    os.truncate(tmp_path / "train.f32", 40 * 40)
    with pytest.raises(DatasetError, match="train.f32: unexpected end of file"):
        source.read("train", np.array([45]))


def test_hostile_layouts_are_refused_with_a_dataset_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no IDX image/label pairs"):
        open_source(f"file://{tmp_path / 'empty'}?format=idx")
    neg = tmp_path / "neg"
    neg.mkdir()
    np.save(neg / "train_x.npy", np.zeros((2, 3), np.float32))
    np.save(neg / "train_y.npy", np.zeros(2, np.int64))
    raw = (neg / "train_x.npy").read_bytes().replace(b"(2, 3)", b"(-2,-3)")
    (neg / "train_x.npy").write_bytes(raw)
    with pytest.raises(DatasetError, match="negative dimension"):
        open_source(f"file://{neg}")
    text = tmp_path / "text"
    text.mkdir()
    np.save(text / "train_x.npy", np.array([["a", "b"], ["c", "d"]]))
    np.save(text / "train_y.npy", np.zeros(2, np.int64))
    with pytest.raises(DatasetError, match="str32 values; expected an array of numbers"):
        open_source(f"file://{text}")

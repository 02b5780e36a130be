"""file:// sources against real files written here byte for byte (the formats are built by
tests/support/formats.py): one contract run against every format, in RAM and streamed, with its
refusals of truncated files, mismatched counts and bad parameters; val carved from train; resident
memory that does not grow with a streamed dataset's size; and a file dataset served by the real
provider. The errors for bad layouts and damaged files are in tests/provider/sources/test_files_errors.py."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from libbus.errors import DatasetError
from libbus.wire.messages import BatchRequest, DatasetInfoRequest
from services.provider.sources import open_source
from tests.support import REPO
from tests.support.formats import BUILDERS, build_idx, expected_splits, some_indices


@pytest.mark.parametrize("memory", ["ram", "stream"])
@pytest.mark.parametrize("fmt", BUILDERS)
def test_contract_serves_exactly_the_files_bytes(tmp_path, fmt, memory):
    rng = np.random.default_rng(0)
    built = BUILDERS[fmt](tmp_path, rng)
    source = open_source(f"file://{tmp_path}?memory={memory}{built.query}")
    want = expected_splits(built)
    info = source.info()
    assert info["memory"] == memory
    assert {k: info[k] for k in built.info} == built.info
    for split in ("train", "val", "test"):
        assert info["splits"][split]["num_samples"] == len(want[split][0]), split
    assert info["label_dtype"] == "int64" and info["splits"]["test"]["available"] is False
    for split in ("train", "val"):
        wx, wy = want[split]
        idx = some_indices(len(wx), rng)
        x, y = source.read(split, idx)
        assert x.dtype == source.dtype and x.dtype.isnative and y.dtype == np.int64
        assert np.array_equal(x, wx[idx]) and np.array_equal(y, wy[idx]), split
        # read_into fills given buffers (as a shared-memory slot would be), including strided ones
        x2 = np.full((len(idx), *source.sample_shape), 77, source.dtype)
        y2 = np.full((len(idx), *source.label_shape), -1, np.int64)
        source.read_into(split, idx, x2, y2)
        assert np.array_equal(x2, wx[idx]) and np.array_equal(y2, wy[idx])
        wide = np.zeros((len(idx) * 2, *source.sample_shape), source.dtype)[::2]
        source.read_into(split, idx, wide, y2)
        assert np.array_equal(wide, wx[idx])
        full = source.read(split, np.arange(len(wx)))
        assert np.array_equal(full[0], wx) and np.array_equal(full[1], wy)
    if want["test"][0].size:
        x, y = source.read("test", np.arange(len(want["test"][0]))[::-1].copy())
        assert np.array_equal(x, want["test"][0][::-1]) and np.array_equal(y, want["test"][1][::-1])
    with pytest.raises(IndexError):
        source.read("train", np.array([info["splits"]["train"]["num_samples"]]))


@pytest.mark.parametrize("fmt", BUILDERS)
def test_contract_a_truncated_file_is_named(tmp_path, fmt):
    built = BUILDERS[fmt](tmp_path, np.random.default_rng(1))
    with open(built.truncate, "r+b") as f:
        f.truncate(os.path.getsize(built.truncate) - 3)
    with pytest.raises(DatasetError, match=built.truncate.name):
        open_source(f"file://{tmp_path}?memory=stream{built.query}")


@pytest.mark.parametrize("fmt", [f for f in BUILDERS if f not in ("cifar10", "tokens-bin", "tokens-npy")])
def test_contract_mismatched_sample_and_label_counts_are_refused(tmp_path, fmt):
    built = BUILDERS[fmt](tmp_path, np.random.default_rng(2))
    built.mismatch()
    with pytest.raises(DatasetError, match=r"has \d+ (samples|images)"):
        open_source(f"file://{tmp_path}{built.query}")


@pytest.mark.parametrize("fmt", BUILDERS)
@pytest.mark.parametrize(
    "bad, match",
    [
        ("memory=lots", "memory must be one of"),
        ("val_fraction=1.5", r"val_fraction must be in \[0, 1\)"),
        ("val_fraction=x", "must be a number"),
        ("cache=", None),
        ("frobnicate=1", "unknown parameter"),
        ("format=tiff", "unknown format 'tiff'"),
    ],
)
def test_contract_bad_parameters_are_refused(tmp_path, fmt, bad, match):
    built = BUILDERS[fmt](tmp_path, np.random.default_rng(3))
    uri = f"file://{tmp_path}?{bad}{built.query}"
    if match is None:  # an empty cache= means the default
        assert open_source(uri).num_samples("train") > 0
        return
    with pytest.raises(DatasetError, match=match):
        open_source(uri)


def test_val_fraction_moves_the_tail_of_train_to_val(tmp_path):
    built = build_idx(tmp_path, np.random.default_rng(4))
    source = open_source(f"file://{tmp_path}?val_fraction=0.3")
    want = expected_splits(built, 0.3)
    assert source.num_samples("train") == 35 and source.num_samples("val") == 15
    assert np.array_equal(source.read("val", np.arange(15))[0], want["val"][0])
    assert source.info()["val_fraction"] == 0.3
    assert open_source(f"file://{tmp_path}?val_fraction=0").num_samples("val") == 0


PEAK_RSS = """
import sys
import numpy as np
from services.provider.sources import open_source
source = open_source(sys.argv[1])
rng = np.random.default_rng(0)
n = source.num_samples("train")
x = np.empty((256, *source.sample_shape), source.dtype)
y = np.empty((256, *source.label_shape), source.label_dtype)
for start in range(0, n - 256, 256):  # every sample once, batches in shuffled order inside a window
    idx = rng.permutation(np.arange(start, start + 256))
    source.read_into("train", idx, x, y)
# VmHWM, not ru_maxrss: ru_maxrss keeps the peak of the forked parent across exec
print(int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024)
"""


def _peak_rss(uri: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, uri], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    return int(out.stdout.split()[-1])


def test_streamed_resident_memory_does_not_grow_with_the_dataset(tmp_path):
    mb = 1 << 20
    for name, size in (("small", 20 * mb), ("big", 200 * mb)):
        d = tmp_path / name
        d.mkdir()
        row = np.arange(4096, dtype=np.uint8)
        with open(d / "x.u8", "wb") as f:
            f.writelines(np.tile(row, 16 * mb // 4096).tobytes() for _ in range(size // (16 * mb)))
            f.write(np.tile(row, (size % (16 * mb)) // 4096).tobytes())
        (d / "dataset.toml").write_text('[train]\nx = "x.u8"\ndtype = "uint8"\nshape = [4096]\n')
    small = _peak_rss(f"file://{tmp_path / 'small'}?memory=stream")
    big = _peak_rss(f"file://{tmp_path / 'big'}?memory=stream")
    assert big - small < 16 * mb, f"peak RSS {small / mb:.0f} MB for 20 MB, {big / mb:.0f} MB for 200 MB"
    # the measure is sensitive: in RAM the same dataset does show up
    assert _peak_rss(f"file://{tmp_path / 'big'}?memory=ram") - small > 150 * mb


def test_the_provider_serves_a_file_dataset(tmp_path, start_provider, client_for):
    built = build_idx(tmp_path, np.random.default_rng(8))
    provider = start_provider(f"digits=file://{tmp_path}?memory=stream")
    client = client_for(provider.endpoint)
    info = client.request(DatasetInfoRequest(dataset="digits")).info
    assert info["format"] == "idx" and info["splits"]["train"]["num_samples"] == 45
    idx = np.array([44, 3, 3, 0, 1, 2], dtype="<i8")
    reply = client.request(BatchRequest(dataset="digits", split="train", frames=[idx.tobytes()]))
    x = np.frombuffer(reply.frames[0].buffer, reply.dtypes[0]).reshape(reply.shapes[0])
    y = np.frombuffer(reply.frames[1].buffer, reply.dtypes[1]).reshape(reply.shapes[1])
    want_x, want_y = built.files["train"]
    assert np.array_equal(x, want_x[idx]) and np.array_equal(y, want_y[idx])

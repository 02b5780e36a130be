"""Which samples become val when a dataset's files hold no val split, pinned per format on fixed examples.

A changed carve silently changes every user's validation set (and leaks old val samples into train), so
each format's carve is pinned by the samples it picks, not by how it picks them: the tail of train in
file order for the array layouts, TFRecord and Parquet here (``round`` half to even included); per class,
the lowest hashes of a file's path (ImageFolder) or a sample's key (WebDataset); the lowest hashes of the
line numbers for text lines. The tails of MDS, litData and ``save_to_disk``, whose files only the peers'
own writers make (seconds each), are pinned where those formats are tested, on those writers' files
(``test_mds.py``, ``test_litdata.py``, ``test_hfdisk.py``: val the last samples of train).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from libbus.errors import DatasetError
from services.provider.sources import open_source
from tests.support.images import write_imagefolder, write_shards
from tests.support.text import document, write_text

#: 45 train samples with the default val_fraction 0.1: round(4.5) is 4 (half to even), not 5.
N = 45
#: The tail carve's val: the last four samples of train, in file order.
TAIL = [41, 42, 43, 44]


def _write_arrays(d: Path) -> Path:
    """The samples ``x[i] = (i, -i)`` with class ``i % 3`` as ``train_x.npy``/``train_y.npy``."""
    d.mkdir()
    np.save(d / "train_x.npy", np.stack([np.arange(N), -np.arange(N)], axis=1).astype(np.float32))
    np.save(d / "train_y.npy", (np.arange(N) % 3).astype(np.int64))
    return d


def _write_tfrecord(d: Path) -> Path:
    """The same samples as TFRecord ``Example``s (``pixels``, ``label``), by the ``tfrecord`` package's writer."""
    from tfrecord.writer import TFRecordWriter  # the peer's writer: a test extra

    d.mkdir()
    writer = TFRecordWriter(str(d / "train-0000-of-0001.tfrecord"))
    for i in range(N):
        writer.write({"pixels": (np.array([i, -i], np.float32), "float"), "label": (i % 3, "int")})
    writer.close()
    return d


def _numbers(source, split: str) -> list[int]:
    """Which samples ``split`` serves, by the number each sample's x carries."""
    x, _ = source.read(split, np.arange(source.num_samples(split)))
    return [int(v) for v in np.asarray(x).reshape(len(x), -1)[:, 0]]


@pytest.mark.parametrize("fmt", ["npy", "tfrecord"])
def test_the_tail_of_train_becomes_val(tmp_path, fmt):
    if fmt == "npy":
        uri = f"file://{_write_arrays(tmp_path / fmt)}"
    else:
        uri = f"file://{_write_tfrecord(tmp_path / fmt)}?fields=pixels&label=label&shape=2"
    source = open_source(uri)
    try:
        assert _numbers(source, "val") == TAIL
        assert _numbers(source, "train") == list(range(N - len(TAIL)))
        assert source.info()["val_fraction"] == 0.1
    finally:
        source.close()


def test_the_tail_of_parquet_rows_becomes_val(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    x = np.arange(N, dtype=np.float32)
    table = pa.table({"x": x, "label": (np.arange(N) % 3).astype(np.int64)})
    pq.write_table(table, tmp_path / "train.parquet", row_group_size=10)
    source = open_source(f"parquet://{tmp_path}?column=x")
    try:
        assert _numbers(source, "val") == TAIL
        assert _numbers(source, "train") == list(range(N - len(TAIL)))
    finally:
        source.close()


def test_a_fraction_that_leaves_no_train_sample_is_refused(tmp_path):
    d = _write_arrays(tmp_path / "npy")
    with pytest.raises(DatasetError, match="of 45 train samples leaves none to train on"):
        open_source(f"file://{d}?val_fraction=0.99")


def test_image_folder_val_is_per_class_the_paths_that_hash_lowest(tmp_path):
    root = write_imagefolder(tmp_path / "imgs", per_class=12, classes=3)
    source = open_source(f"file://{root}?size=8&val_fraction=0.25")
    try:
        val = sorted(str(path.relative_to(root)) for path, _ in source.store.files["val"])
    finally:
        source.close()
    assert val == VAL_IMAGES


def test_webdataset_val_is_per_class_the_keys_that_hash_lowest(tmp_path):
    write_shards(tmp_path / "wds", "train", shards=3, per_shard=8, classes=3)
    source = open_source(f"file://{tmp_path / 'wds'}?size=8&val_fraction=0.25")
    try:
        store = source.store
        val = sorted(store.indexes[shard].keys[i] for shard, i in store.rows["val"])
    finally:
        source.close()
    assert val == VAL_KEYS


def test_text_val_is_the_lines_whose_number_hashes_lowest(tmp_path):
    root = write_text(tmp_path / "text", train=40)
    source = open_source(f"file://{root}?encoded=1&val_fraction=0.2")
    try:
        texts = [s.text for s in source.store.fetch("val", np.arange(source.num_samples("val")))]
    finally:
        source.close()
    lines = {document(n): n for n in range(40)}
    assert sorted(lines[t] for t in texts) == VAL_LINES


#: What each hash carve picked when these tests were written: a change here changes users' val sets.
VAL_IMAGES = [
    "train/class0/00000.jpg",
    "train/class0/00008.webp",
    "train/class0/00010.png",
    "train/class1/00001.png",
    "train/class1/00002.webp",
    "train/class1/00006.jpg",
    "train/class2/00000.jpg",
    "train/class2/00001.png",
    "train/class2/00008.webp",
]
VAL_KEYS = ["train/s000004", "train/s000005", "train/s000006", "train/s000007", "train/s000014", "train/s000021"]
VAL_LINES = [6, 14, 21, 25, 27, 37, 38, 39]

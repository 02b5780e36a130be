"""Hugging Face datasets saved with ``save_to_disk`` (written by ``datasets`` itself), served as written: the
columns as named fields in their order, a ClassLabel as ``y`` with its class names, a plain ``Dataset`` as
train, an unmapped column refused naming it, and both deliveries through a real provider."""

from __future__ import annotations

import numpy as np
import pytest

from libbus.errors import DatasetError
from libbus.loader.remote import RemoteLoader
from services.provider.sources import open_source
from tests.support.peers import png_pixels, write_hf


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "dd"
    return d, write_hf(d, 3, {"train": 21, "validation": 4, "test": 5})


def _same(got: dict, ref: dict, idx) -> None:
    for k, i in enumerate(idx):
        assert np.array_equal(png_pixels(got["image"][k]), ref["image"][i])
        assert int(got["label"][k]) == ref["label"][i] and got["text"][k] == ref["text"][i]
        assert np.asarray(got["vec"][k]).tobytes() == ref["vec"][i].tobytes()
        assert np.asarray(got["tokens"][k]).tobytes() == ref["tokens"][i].tobytes()


def test_columns_are_fields_in_their_order_read_exactly(written):
    d, ref = written
    assert len(list((d / "train").glob("*.arrow"))) > 1  # several Arrow files
    source = open_source(f"file://{d}")
    try:
        assert [f.describe() for f in source.fields] == [
            "image bytes *",
            "label int64 ()",
            "text str *",
            "vec float32 (3,)",
            "tokens int32 (?,)",
        ]
        assert all(f.max_bytes > 0 for f in source.fields if f.variable)
        info = source.info()
        assert info["format"] == "hf-disk" and "val_fraction" not in info
        assert [source.num_samples(s) for s in ("train", "val", "test")] == [21, 4, 5]
        idx = np.array([20, 0, 9, 9, 3])
        _same(source.read_fields("train", idx), ref["train"], idx)
        _same(source.read_fields("val", np.array([3, 1])), ref["validation"], [3, 1])
    finally:
        source.close()


def test_a_class_label_is_y_with_its_names(written):
    d, ref = written
    source = open_source(f"file://{d}?fields=vec&label=label")
    try:
        assert source.xy and source.num_classes == 3 and source.class_names == ["a", "b", "c"]
        x, y = source.read("train", np.array([5, 2]))
        assert x.tobytes() == np.stack([ref["train"]["vec"][i] for i in (5, 2)]).tobytes()
        assert y.tolist() == [ref["train"]["label"][i] for i in (5, 2)]
    finally:
        source.close()


def test_a_plain_dataset_is_train_and_val_its_tail(tmp_path):
    ref = write_hf(tmp_path / "ds", 4, {"": 20})[""]
    source = open_source(f"file://{tmp_path / 'ds'}")
    try:
        assert [source.num_samples(s) for s in ("train", "val", "test")] == [18, 2, 0]
        _same(source.read_fields("val", np.array([0, 1])), ref, [18, 19])
    finally:
        source.close()


def test_an_unmapped_column_is_refused_naming_it(tmp_path):
    write_hf(tmp_path / "ds", 5, {"train": 6}, extra=True)
    with pytest.raises(DatasetError, match=r"column 'meta' is struct<a: int32, b: string>.*fields="):
        open_source(f"file://{tmp_path / 'ds'}")
    open_source(f"file://{tmp_path / 'ds'}?fields=text,label").close()


@pytest.mark.parametrize("shm", [False, True])
def test_hf_datasets_through_a_provider_on_both_deliveries(written, start_provider, make_token, shm):
    d, ref = written
    running = start_provider(f"hf=file://{d}", f"xy=file://{d}?fields=vec&label=label")
    with RemoteLoader(
        "hf", provider=running.endpoint, token=make_token(), batch_size=4, shuffle=False, shm=shm, collate="list"
    ) as loader:
        assert loader.transport == ("shm" if shm else "socket")
        seen = 0
        for batch in loader:
            n = len(batch["text"])
            got = {k: [v.numpy() if hasattr(v, "numpy") else v for v in vs] for k, vs in batch.items()}
            _same(got, ref["train"], range(seen, seen + n))
            seen += n
        assert seen == 21
    with RemoteLoader("xy", provider=running.endpoint, token=make_token(), batch_size=6, shuffle=False, shm=shm) as xy:
        xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in xy])
        assert np.concatenate(xs).tobytes() == np.stack(ref["train"]["vec"]).tobytes()
        assert np.concatenate(ys).tolist() == ref["train"]["label"]


def test_rows_read_in_any_order_across_the_files_record_batches(tmp_path):
    """save_to_disk writes its Arrow file in record batches of 1,000 rows; a batch of indices spread
    over several of them (repeats too, and none) comes back as written, in the order asked. The reader
    takes rows chunk by chunk (copying only those) instead of concatenating the whole column per batch."""
    import datasets

    n = 2500
    x = np.random.default_rng(3).standard_normal((n, 6)).astype(np.float32)
    y = np.arange(n) % 7
    features = datasets.Features(
        {"x": datasets.Sequence(datasets.Value("float32"), length=6), "label": datasets.Value("int64")}
    )
    datasets.Dataset.from_dict({"x": list(x), "label": y.tolist()}, features=features).save_to_disk(
        str(tmp_path / "hf"), max_shard_size="10MB"
    )
    source = open_source(f"file://{tmp_path / 'hf'}?fields=x&label=label&shape=2,3")
    try:
        table = source.tables["train"]
        assert table.column("x").num_chunks > 1  # several record batches: the path under test
        n_train = source.num_samples("train")
        for idx in (
            np.random.default_rng(4).permutation(n_train)[:300],
            np.array([n_train - 1, 0, 1500, 0, 999, 1000]),
            np.array([], np.int64),
        ):
            got_x, got_y = source.read("train", idx)
            assert np.array_equal(got_x, x[idx].reshape(-1, 2, 3)) and np.array_equal(got_y, y[idx])
    finally:
        source.close()

"""litData's ``optimize()`` output (written by litData itself, installed without its dependencies: see
pyproject's test extra), served as written: the sample dict's leaves as named fields in their order, ``(x, y)``
with a label and a declared shape, what is not read refused naming it, and both deliveries through a real
provider."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from libbus.errors import DatasetError
from libbus.loader.remote import RemoteLoader
from services.provider.sources import open_source
from tests.support.peers import write_litdata

N = 23


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = tmp_path_factory.mktemp("lit")
    every, xy = write_litdata((d / "every", 1, N, False), (d / "xy", 2, 30, True))
    return d, every, xy


def _same(got: dict, samples: list[dict], idx) -> None:
    for k, i in enumerate(idx):
        s = samples[i]
        assert np.asarray(got["x"][k]).tobytes() == s["x"].tobytes() and int(got["y"][k]) == s["y"]
        assert got["caption"][k] == s["caption"] and got["blob"][k] == s["blob"]
        assert np.asarray(got["tokens"][k]).tobytes() == s["tokens"].tobytes()
        assert np.array_equal(np.asarray(got["image"][k]), np.asarray(s["image"]))


def test_the_leaves_are_fields_in_their_order_read_exactly(written):
    d, every, _ = written
    assert len(json.loads((d / "every" / "index.json").read_text())["chunks"]) > 1
    source = open_source(f"file://{d / 'every'}")
    try:
        assert [f.describe() for f in source.fields] == [
            "x float32 (?, ?)",
            "y int64 ()",
            "caption str *",
            "blob bytes *",
            "tokens int32 (?,)",
            "image uint8 (?, ?, ?)",
        ]
        assert source.info()["format"] == "litdata" and all(f.max_bytes > 0 for f in source.fields if f.variable)
        assert [source.num_samples(s) for s in ("train", "val", "test")] == [21, 2, 0]
        idx = np.array([20, 0, 11, 11, 4])
        _same(source.read_fields("train", idx), every, idx)
        _same(source.read_fields("val", np.array([1, 0])), every, [22, 21])
    finally:
        source.close()


def test_a_label_and_a_declared_shape_are_an_xy_dataset(written):
    d, _, xy = written
    source = open_source(f"file://{d / 'xy'}?fields=x&label=y&shape=6")
    try:
        assert source.xy and source.sample_shape == (6,) and source.num_classes == 1 + max(s["y"] for s in xy)
        x, y = source.read("train", np.array([3, 1]))
        assert x.tobytes() == np.stack([xy[3]["x"], xy[1]["x"]]).tobytes()
        assert y.tolist() == [xy[3]["y"], xy[1]["y"]]
    finally:
        source.close()


@pytest.mark.parametrize(
    "change, words",
    [
        ({"data_format": 3}, r"leaf 'blob' is pickled \(data_format 'pickle'\).*fields="),
        (
            {"compression": "zstd"},
            "chunks compressed with 'zstd' are not read yet; run optimize.. with compression=None",
        ),
        ({"item_loader": "TokensLoader"}, "item_loader 'TokensLoader': batchbus reads PyTreeLoader chunks"),
    ],
)
def test_what_is_not_read_is_refused_naming_it(written, tmp_path, change, words):
    shutil.copytree(written[0] / "every", tmp_path / "d")
    index = json.loads((tmp_path / "d" / "index.json").read_text())
    for key, value in change.items():
        if key == "data_format":
            index["config"]["data_format"][value] = "pickle"
        else:
            index["config"][key] = value
    (tmp_path / "d" / "index.json").write_text(json.dumps(index))
    with pytest.raises(DatasetError, match=words):
        open_source(f"file://{tmp_path / 'd'}")
    if "data_format" in change:
        open_source(f"file://{tmp_path / 'd'}?fields=x,y,caption").close()  # left out, the rest serves


@pytest.mark.parametrize("shm", [False, True])
def test_litdata_through_a_provider_on_both_deliveries(written, start_provider, make_token, shm):
    d, every, xy = written
    running = start_provider(f"lit=file://{d / 'every'}", f"xy=file://{d / 'xy'}?fields=x&label=y&shape=2,3&classes=4")
    with RemoteLoader(
        "lit", provider=running.endpoint, token=make_token(), batch_size=4, shuffle=False, shm=shm, collate="list"
    ) as loader:
        assert loader.transport == ("shm" if shm else "socket")
        seen = 0
        for batch in loader:
            n = len(batch["caption"])
            got = {k: [v.numpy() if hasattr(v, "numpy") else v for v in vs] for k, vs in batch.items()}
            _same(got, every, range(seen, seen + n))
            seen += n
        assert seen == 21
    with RemoteLoader("xy", provider=running.endpoint, token=make_token(), batch_size=9, shuffle=False, shm=shm) as ld:
        xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in ld])
        assert np.concatenate(xs).tobytes() == np.stack([s["x"] for s in xy[:27]]).tobytes()
        assert np.concatenate(ys).tolist() == [s["y"] for s in xy[:27]]

"""Pipelines over sources of named fields: each stage names the field it acts on and the others pass
through. A mix of two image folders decoded at their own sizes, cropped and flipped by a pipeline,
reaches a trainer as dict batches with exactly the pixels the x/y pipeline makes from the same files;
a corrupt image skipped by ``decode`` takes its row's every field from the neighbour it borrows; a
careless pipeline file (no field, an unknown one, a field on an x/y source, a label stage) is
refused at open naming the stage."""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from libbus import RemoteLoader
from libbus.errors import ConfigError
from services.provider.sources import open_source
from tests.support.contract import check_fields_contract
from tests.support.images import image_bytes, write_imagefolder

STAGES = """
[[stages]]
name = "crop"
input = "src"
{field}random_resized_crop = {{ size = 10 }}
[[stages]]
name = "flip"
input = "crop"
{field}flip = {{ p = 0.5 }}
"""


def write_pipeline(path: Path, source: str, body: str) -> str:
    path.write_text(f'[[stages]]\nname = "src"\nsource = {{ uri = "{source}" }}\n' + textwrap.dedent(body))
    return f"pipeline://{path}"


def write_mix(path: Path, uris: list[str]) -> str:
    path.write_text("".join(f'[[sources]]\nuri = "{u}"\nweight = {w}\n' for u, w in zip(uris, (2, 1))))
    return f"weighted://{path}"


def test_a_mix_of_image_folders_through_named_field_stages(tmp_path, start_provider, make_token):
    folders = [write_imagefolder(tmp_path / "a", per_class=4), write_imagefolder(tmp_path / "b", per_class=3)]
    (tmp_path / "b" / "train" / "class0" / "00000.jpg").write_bytes(image_bytes(0, 777))  # b differs from a
    named = write_mix(tmp_path / "named.toml", [f"file://{d}?fields=image,label&val_fraction=0" for d in folders])
    encoded = write_mix(tmp_path / "encoded.toml", [f"file://{d}?encoded=1&val_fraction=0" for d in folders])
    pipeline = write_pipeline(tmp_path / "named.toml.p", named, STAGES.format(field='field = "image"\n'))
    reference = write_pipeline(
        tmp_path / "xy.toml", encoded, '[[stages]]\nname = "dec"\ninput = "src"\ndecode = {}\n'
        + STAGES.replace('input = "src"', 'input = "dec"').format(field="")
    )  # fmt: skip
    provider = start_provider(f"aug={pipeline}")
    with RemoteLoader("aug", provider=provider.endpoint, token=make_token(), batch_size=4, shuffle=False) as loader:
        loader.set_epoch(3)
        batches = list(loader)
    images = np.concatenate([b["image"].numpy() for b in batches])
    labels = np.concatenate([b["label"].numpy() for b in batches])
    xy = open_source(reference)
    try:
        x = np.empty((14, 3, 10, 10), np.uint8)
        y = np.empty(14, np.int64)
        xy.serve_into("train", np.arange(14), x, y, epoch=3)
    finally:
        xy.close()
    assert set(batches[0]) == {"image", "label"} and images.shape == (14, 3, 10, 10)
    assert np.array_equal(images, x) and np.array_equal(labels, y)  # same crops, flips and labels
    assert not np.array_equal(images[:7], images[7:])  # and the two folders really differ


def _png(value: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((6 + value, 5, 3), value * 20, np.uint8)).save(out, "PNG")
    return out.getvalue()


def test_a_skipped_bad_image_takes_its_rows_every_field_from_its_neighbour(tmp_path):
    blobs = [_png(0), _png(1), b"not an image", _png(3)]
    table = pa.table({"png": pa.array(blobs, pa.binary()), "id": [10, 11, 12, 13], "tag": ["a", "b", "c", "d"]})
    pq.write_table(table, tmp_path / "train.parquet")
    source = f"parquet://{tmp_path}?fields=png,id,tag&val_fraction=0"
    body = """
        [[stages]]
        name = "dec"
        input = "src"
        field = "png"
        decode = { bad = "skip" }
        [[stages]]
        name = "crop"
        input = "dec"
        field = "png"
        center_crop = { size = 4 }
    """
    p = open_source(write_pipeline(tmp_path / "p.toml", source, body))
    try:
        assert [f.describe() for f in p.fields] == ["png uint8 (3, 4, 4)", "id int64 ()", "tag str *"]
        batch = p.read_fields("train", np.arange(4))
    finally:
        p.close()
    assert batch["id"].tolist() == [10, 11, 11, 13] and batch["tag"] == ["a", "b", "b", "d"]
    assert [int(img[0, 0, 0]) for img in batch["png"]] == [0, 20, 20, 60]


@pytest.mark.parametrize(
    ("source", "body", "message"),
    [
        ("mock://fields?n=8", STAGES.format(field=""), r"stage 'crop' \(random_resized_crop\): the source serves "
         r"named fields \(image, tokens, text, label\); name the one this stage acts on, e.g. field = \"image\""),
        ("mock://fields?n=8", STAGES.format(field='field = "img"\n'), "stage 'crop' .*no field 'img'; the fields are"),
        ("mock://mnist?n=8", STAGES.format(field='field = "x"\n'), "mock://mnist\\?n=8 serves x/y samples; leave"),
        ("mock://fields?n=8", '[[stages]]\nname = "h"\ninput = "src"\nfield = "label"\none_hot = {}\n',
         r"stage 'h' \(one_hot\): acts on x/y class labels"),
        ("mock://fields?n=8", '[[stages]]\nname = "d"\ninput = "src"\nfield = "text"\ndecode = {}\n',
         r"stage 'd' \(decode\): field text str \* is not encoded bytes"),
        ("mock://fields?n=8", '[[stages]]\nname = "n"\ninput = "src"\nfield = "text"\nnormalize = {}\n',
         r"stage 'n' \(normalize\): needs numeric image samples"),
        ("mock://fields?n=8", '[[stages]]\nname = "c"\ninput = "src"\nfield = "label"\ncast = { label_dtype = "int8" }\n',
         r"stage 'c' \(cast\): acts on x/y labels"),
    ],
)  # fmt: skip
def test_careless_pipelines_of_named_fields_are_refused_at_open(tmp_path, source, body, message):
    with pytest.raises(ConfigError, match=message):
        open_source(write_pipeline(tmp_path / "p.toml", source, body))


def test_a_pipeline_of_named_fields_keeps_the_source_contract(tmp_path):
    p = open_source(write_pipeline(tmp_path / "p.toml", "mock://fields?n=20", STAGES.format(field='field = "image"\n')))
    try:
        assert [f.describe() for f in p.fields] == [
            "image uint8 (3, 10, 10)", "tokens int32 (?,)", "text str *", "label int64 ()"
        ]  # fmt: skip
        alone = open_source("mock://fields?n=20").read_fields("val", np.arange(4))
        served = p.read_fields("val", np.arange(4))
        assert served["text"] == alone["text"] and np.array_equal(served["label"], alone["label"])
        assert all(np.array_equal(a, b) for a, b in zip(served["tokens"], alone["tokens"]))  # passed through
        check_fields_contract(p)  # closes p (the provider's handler does when it stops)
    finally:
        p.close()


def test_named_fields_that_come_out_as_fixed_x_and_y_are_served_as_x_y(tmp_path):
    table = pa.table({"x": pa.array([_png(v) for v in range(4)], pa.binary()), "y": [0, 1, 0, 1]})
    pq.write_table(table, tmp_path / "train.parquet")
    body = '[[stages]]\nname = "c"\ninput = "src"\nfield = "x"\ncenter_crop = { size = 4 }\n'
    p = open_source(write_pipeline(tmp_path / "p.toml", f"parquet://{tmp_path}?fields=x:image,y&val_fraction=0", body))
    try:
        assert p.xy and p.info()["sample_shape"] == [3, 4, 4]  # what a trainer's (x, y) loader expects
        x, y = np.empty((4, 3, 4, 4), np.uint8), np.empty(4, np.int64)
        p.serve_into("train", np.arange(4), x, y)
        assert y.tolist() == [0, 1, 0, 1] and [int(img[0, 0, 0]) for img in x] == [0, 20, 40, 60]
    finally:
        p.close()

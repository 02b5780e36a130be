"""The pipeline's image stages, through the shipped ImageNet recipes (examples/pipelines/) on generated images:
each sample against a reference decode, random stages deterministic per epoch, careless files refused."""

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from libbus.errors import ConfigError, DatasetError
from services.provider.sources import open_source
from tests.support import REPO
from tests.support.images import image_bytes, write_imagefolder

EXAMPLES = REPO / "examples" / "pipelines"
MEAN = np.array([123.675, 116.28, 103.53], np.float32)[:, None, None]
STD = np.array([58.395, 57.12, 57.375], np.float32)[:, None, None]


def recipe(tmp_path: Path, name: str, data: Path, **replace: str) -> str:
    text = (EXAMPLES / name).read_text().replace("file:///data/imagenet", f"file://{data}")
    for old, new in replace.items():
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text)
    return f"pipeline://{path}"


def eval_reference(data: bytes, resize: int, crop: int) -> np.ndarray:
    img = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = img.size
    nw, nh = (resize, int(resize * h / w)) if w <= h else (int(resize * w / h), resize)
    img = img.resize((nw, nh), Image.BILINEAR)
    left, top = int(round((nw - crop) / 2)), int(round((nh - crop) / 2))
    chw = np.asarray(img.crop((left, top, left + crop, top + crop))).transpose(2, 0, 1).astype(np.float32)
    return (chw - MEAN) * (np.float32(1) / STD)


def test_the_imagenet_eval_recipe_serves_reference_decodes(tmp_path):
    root = write_imagefolder(tmp_path / "d", per_class=4, classes=2, splits=("train", "val"))
    source = open_source(recipe(tmp_path, "imagenet-eval.toml", root))
    assert (source.sample_shape, source.dtype) == ((3, 224, 224), np.float32)
    files = source.source.store.files["val"]
    x, y = source.read("val", np.arange(len(files)))
    for i, (path, label) in enumerate(files):
        assert y[i] == label
        np.testing.assert_allclose(x[i], eval_reference(path.read_bytes(), 256, 224), atol=1e-4)
    source.close()


def test_the_imagenet_train_recipe_is_random_per_epoch_on_train_and_the_eval_recipe_elsewhere(tmp_path):
    root = write_imagefolder(tmp_path / "d", per_class=4, classes=2, splits=("train", "val"))
    source = open_source(recipe(tmp_path, "imagenet-train.toml", root, **{"size = 224": "size = 32"}))
    assert source.sample_shape == (3, 32, 32)
    idx = np.arange(8)
    epochs = []
    for epoch in (0, 0, 1):
        x, y = np.empty((8, 3, 32, 32), np.float32), np.empty(8, np.int64)
        source.serve_into("train", idx, x, y, epoch=epoch)
        epochs.append(x)
    assert np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[0], epochs[2])
    files = source.source.store.files["val"]
    x, _ = source.read("val", np.arange(len(files)))
    for i, (path, _) in enumerate(files):
        np.testing.assert_allclose(x[i], eval_reference(path.read_bytes(), 32, 32), atol=1e-4)
    source.close()


def test_decode_skips_or_fails_on_a_bad_image(tmp_path):
    root = write_imagefolder(tmp_path / "d", per_class=3, classes=2)
    (root / "train" / "class1" / "00000.jpg").write_bytes(image_bytes(1, 0)[:100])
    failing = open_source(recipe(tmp_path, "imagenet-eval.toml", root, **{'bad = "fail"': 'bad = "fail"'}))
    with pytest.raises(DatasetError, match="00000.jpg: not a whole image"):
        failing.read("train", np.arange(6))
    failing.close()
    (tmp_path / "skip").mkdir()
    skipping = open_source(recipe(tmp_path / "skip", "imagenet-eval.toml", root, **{'bad = "fail"': 'bad = "skip"'}))
    x, y = skipping.read("train", np.arange(6))
    assert np.array_equal(x[3], x[2]) and y[3] == y[2] == 0  # row 3 (class1/00000) → its nearest good row
    assert skipping.metrics()["stages"][1]["bad_images"] == 1
    skipping.close()


@pytest.mark.parametrize(
    "old, new, error, message",
    [
        ("?encoded=1", "?size=8", ConfigError, "needs encoded images"),
        (
            "center_crop = { size = 224 }",
            "color_jitter = { brightness = 0.2 }",
            ConfigError,
            "needs fixed \\(3, H, W\\)",
        ),
        ("center_crop = { size = 224 }", "resize = { size = 100 }", ConfigError, "needs numeric image samples"),
        ("resize = { size = 256 }", "resize = { size = 0 }", ConfigError, "size must be a size in pixels"),
        ('bad = "fail"', 'bad = "ignore"', ConfigError, "bad must be one of fail, skip"),
    ],
)
def test_careless_image_pipelines_are_refused_naming_the_stage(tmp_path, old, new, error, message):
    root = write_imagefolder(tmp_path / "d", per_class=2, classes=2)
    with pytest.raises(error, match=message):
        open_source(recipe(tmp_path, "imagenet-eval.toml", root, **{old: new}))


def test_a_pipeline_that_ends_on_images_of_any_size_is_refused(tmp_path):
    root = write_imagefolder(tmp_path / "d", per_class=2, classes=2)
    cut = {"center_crop = { size = 224 }": "resize = { size = 100 }", "normalize = { mean": "resize = { size = 8 }\n# "}
    with pytest.raises(ConfigError, match="leaves decoded images of any size; end with center_crop"):
        open_source(recipe(tmp_path, "imagenet-eval.toml", root, **cut))

"""Confinement of image and text layouts (docs/security.md §8): a class folder, an image, a
WebDataset shard, ``classes.txt`` or a text file that is a symlink out of the dataset's directory is refused,
naming it, unless the provider's operator allows the place (``?allow_paths=``)."""

import os

import numpy as np
import pytest

from libbus.errors import DatasetError
from services.provider.sources import open_source
from tests.support.images import image_bytes, write_imagefolder, write_shards
from tests.support.text import write_text

OUTSIDE = "outside the dataset's directory"


def test_a_class_folder_symlinked_out_of_an_imagefolder_is_refused_unless_allowed(tmp_path):
    etc = write_imagefolder(tmp_path / "etc", per_class=2, classes=1)  # an /etc-like place elsewhere
    root = write_imagefolder(tmp_path / "ds", per_class=3, classes=1)
    (root / "train" / "class1").symlink_to(etc / "train" / "class0", target_is_directory=True)
    with pytest.raises(DatasetError, match=rf"ds/train/class1: is really .*etc/train/class0, {OUTSIDE}"):
        open_source(f"file://{root}?size=8")
    source = open_source(f"file://{root}?size=8&val_fraction=0&allow_paths={etc}")  # the operator's word
    assert (source.num_samples("train"), source.class_names) == (5, ["class0", "class1"])
    assert source.read("train", np.arange(5))[1].tolist() == [0, 0, 0, 1, 1]
    source.close()
    # the whole train/ folder symlinked out: the same refusal
    os.remove(root / "train" / "class1")
    os.rename(root / "train", tmp_path / "moved")
    (root / "train").symlink_to(tmp_path / "moved", target_is_directory=True)
    with pytest.raises(DatasetError, match=rf"ds/train: is really .*moved, {OUTSIDE}"):
        open_source(f"file://{root}?size=8")


def test_an_image_symlinked_out_is_refused_at_open_and_when_read(tmp_path):
    root = write_imagefolder(tmp_path / "ds", per_class=3, classes=1)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "secret.png").write_bytes(image_bytes(0, 1, "PNG"))
    (root / "train" / "class0" / "zz.png").symlink_to(outside / "secret.png")
    with pytest.raises(DatasetError, match=rf"class0/zz.png: is really .*elsewhere/secret.png, {OUTSIDE}"):
        open_source(f"file://{root}?size=8")
    source = open_source(f"file://{root}?size=8&val_fraction=0&allow_paths={outside}")
    assert source.read("train", np.arange(4))[0].shape == (4, 3, 8, 8)
    source.close()
    # an image swapped for a symlink out after the provider opened the dataset: its batch fails
    os.remove(root / "train" / "class0" / "zz.png")
    source = open_source(f"file://{root}?size=8&val_fraction=0")
    first = sorted((root / "train" / "class0").iterdir())[0]
    os.remove(first)
    first.symlink_to(outside / "secret.png")
    with pytest.raises(DatasetError, match=rf"{first.name}: is really .*secret.png, {OUTSIDE}"):
        source.read("train", np.arange(1))
    source.close()


def test_a_shard_or_classes_file_symlinked_out_of_a_webdataset_is_refused_unless_allowed(tmp_path):
    outside = tmp_path / "elsewhere"
    write_shards(outside, "train", 1, 4)
    (outside / "passwd").write_text("root\nnobody\n")
    root = tmp_path / "wds"
    write_shards(root, "train", 1, 4)
    (root / "train-0001.tar").symlink_to(outside / "train-0000.tar")
    with pytest.raises(DatasetError, match=rf"train-0001.tar: is really .*elsewhere/train-0000.tar, {OUTSIDE}"):
        open_source(f"file://{root}?size=8")
    source = open_source(f"file://{root}?size=8&val_fraction=0&allow_paths={outside}")
    assert source.num_samples("train") == 8 and source.read("train", np.arange(8))[0].shape == (8, 3, 8, 8)
    source.close()
    os.remove(root / "train-0001.tar")
    (root / "classes.txt").symlink_to(outside / "passwd")  # its lines would show as class names
    with pytest.raises(DatasetError, match=rf"classes.txt: is really .*elsewhere/passwd, {OUTSIDE}"):
        open_source(f"file://{root}?size=8")


def test_a_text_file_symlinked_out_is_refused_unless_allowed(tmp_path):
    outside = write_text(tmp_path / "elsewhere", train=5)
    root = tmp_path / "text"
    root.mkdir()
    (root / "train.txt").symlink_to(outside / "train.txt")
    with pytest.raises(DatasetError, match=rf"text/train.txt: is really .*elsewhere/train.txt, {OUTSIDE}"):
        open_source(f"file://{root}?encoded=1")
    source = open_source(f"file://{root}?encoded=1&val_fraction=0&allow_paths={outside}")
    assert source.num_samples("train") == 5
    source.close()

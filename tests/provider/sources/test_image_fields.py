"""Image layouts served as named fields (``?fields=image,label,text``): WebDataset captions ride beside
their images, the same bytes as ``?size=`` serves for x/y (threads and worker processes alike), images
decoded at their own sizes equal Pillow's decode, and a skipped bad image takes its neighbour's
every field; a field the layout does not have is refused at open."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from libbus.errors import DatasetError
from services.provider.sources import open_source
from tests.support.images import shard_members, tar_bytes, write_imagefolder


def caption(n: int) -> str:
    return f"a picture number {n} ✓"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("wds")
    members = shard_members("train", 0, 6, text=caption)
    members[2 * 3 + 0] = (members[2 * 3][0], b"\xff\xd8\xff not a jpeg")  # sample 2's image (3 members each)
    (root / "train-0000.tar").write_bytes(tar_bytes(members))
    return root, members


@pytest.mark.parametrize("pool", ["thread", "process"])
def test_captions_ride_beside_their_images_and_follow_a_skipped_one(shards, pool):
    root, _ = shards
    common = f"size=8&bad=skip&val_fraction=0&cache={root / 'cache'}&workers=2"
    named = open_source(f"file://{root}?{common}&pool={pool}&fields=text,image,label")
    xy = open_source(f"file://{root}?{common}")
    try:
        assert [f.describe() for f in named.fields] == ["text str *", "image uint8 (3, 8, 8)", "label int64 ()"]
        batch = named.read_fields("train", np.arange(6))
        x, y = xy.read("train", np.arange(6))
    finally:
        named.close()
        xy.close()
    assert batch["text"] == [caption(n) for n in (0, 1, 1, 3, 4, 5)]  # sample 2 is bad: all of it from 1
    assert np.array_equal(batch["image"], x) and np.array_equal(batch["label"], y)


def test_images_at_their_own_sizes_equal_pillows_decode(shards):
    root, members = shards
    source = open_source(f"file://{root}?fields=image,text&val_fraction=0&cache={root / 'cache'}")
    try:
        assert [f.describe() for f in source.fields] == ["image uint8 (?, ?, 3)", "text str *"]
        batch = source.read_fields("train", np.array([5, 0]))
        with pytest.raises(DatasetError, match="bad image: .*s000002"):  # bad=fail: named, never garbage
            source.read_fields("train", np.array([2]))
    finally:
        source.close()
    for got, n in zip(batch["image"], (5, 0)):
        want = np.asarray(Image.open(io.BytesIO(members[3 * n][1])).convert("RGB"))
        assert got.shape == want.shape and np.array_equal(got, want)  # the same pixels as Pillow
    assert batch["text"] == [caption(5), caption(0)]


def test_a_field_the_layout_lacks_is_refused(tmp_path):
    root = write_imagefolder(tmp_path / "if", per_class=2)
    with pytest.raises(DatasetError, match=r"fields must list each of image, label at most once \(imagefolder\)"):
        open_source(f"file://{root}?size=8&fields=image,text")
    for query, message in (
        ("encoded=1&fields=image", "not both"),
        ("size=8&fields=image&max_bytes=100", "max_bytes declares the largest decoded image of fields= without size="),
        ("fields=image&max_bytes=-1", "max_bytes declares"),
        ("fields=image&pool=process", "fields= without size= decodes on threads, without augment"),
    ):
        with pytest.raises(DatasetError, match=message):
            open_source(f"file://{root}?{query}")

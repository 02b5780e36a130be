"""A real held-out set: an operator marks a dataset's test split readable with
``private_test=false`` on its URI, where nothing needs hiding; without it the split stays private.
A provider that carves val out of train says so at start and in ``busctl datasets``."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from libbus import RemoteLoader
from libbus.errors import ConfigError, SplitPrivate
from libbus.wire.messages import BatchRequest
from services.provider.app import private_test_option
from tests.support import busctl

TRAIN, VAL, TEST = 30, 6, 8


def ids_dir(root, *splits: str):
    """``.npy`` pairs for ``splits``: sample i of each split holds i in its first feature."""
    sizes = {"train": TRAIN, "val": VAL, "test": TEST}
    for split in splits:
        i = np.arange(sizes[split])
        np.save(root / f"{split}_x.npy", np.stack([i, i % 3], axis=1).astype(np.float32))
        np.save(root / f"{split}_y.npy", (i % 2).astype(np.int64))
    return root


@pytest.fixture
def served(start_provider, tmp_path_factory, caplog):
    public = ids_dir(tmp_path_factory.mktemp("public"), "train", "val", "test")
    held = ids_dir(tmp_path_factory.mktemp("held"), "train", "test")  # no val files: val is carved
    with caplog.at_level(logging.INFO, logger="services.provider.app"):
        running = start_provider(f"public=file://{public}?private_test=false", f"held=file://{held}")
    return running


def read_all(endpoint: str, token: str, dataset: str, split: str) -> list[int]:
    with RemoteLoader(dataset, provider=endpoint, token=token, split=split, batch_size=3, shuffle=False) as loader:
        return [int(i) for x, _ in loader for i in x[:, 0].tolist()]


def test_the_operator_marks_a_test_split_readable_and_the_default_stays_private(served, make_token, client_for):
    token = make_token()
    assert read_all(served.endpoint, token, "public", "test") == list(range(TEST))
    info = served.service.handler.infos
    assert info["public"]["splits"]["test"]["available"] is True
    assert info["held"]["splits"]["test"]["available"] is False
    with pytest.raises(SplitPrivate, match="never leaves its provider"):
        read_all(served.endpoint, token, "held", "test")
    # the provider itself refuses it, whatever the client, and says how an operator would open it
    client = client_for(served.endpoint, token=token)
    assert client.request(BatchRequest(dataset="public", split="test", range=[0, 2])).nbytes > 0
    with pytest.raises(SplitPrivate, match="private_test=false"):
        client.request(BatchRequest(dataset="held", split="test", range=[0, 2]))
    # the option is the provider's: the source never sees it, and its URI is the plain one
    assert "private_test" not in info["public"]["uri"]


def test_a_carved_val_is_said_at_start_and_in_busctl_datasets(router, served, state_dir, caplog):
    lines = [r.getMessage() for r in caplog.get_records("setup") if r.name == "services.provider.app"]
    carved = round(TRAIN * 0.1)
    assert (
        f"dataset held: train {TRAIN - carved}, val {carved} carved from train (the tail of train, in file order, val_fraction 0.1"
        in "\n".join(lines)
    )
    assert "dataset public: train 30, val 6, test 8 readable (private_test=false)" in lines
    out = busctl("datasets", "--router", router.endpoint, "--state-dir", str(state_dir), check=True).stdout
    flat = " ".join(out.split())
    assert (
        f"val {carved} (carved from train: the tail of train, in file order, val_fraction 0.1; the files hold no val)"
        in flat
    ), out
    assert f"test {TEST} (private: provider-side evaluation only)" in flat, out  # held's
    assert f"test {TEST} (readable: private_test=false)" in flat, out  # public's


def test_the_private_test_option_parses_strictly():
    assert private_test_option("file:///d?private_test=false&memory=ram") == ("file:///d?memory=ram", False)
    assert private_test_option("file:///d?private_test=true") == ("file:///d", True)
    assert private_test_option("mock://mnist") == ("mock://mnist", True)
    with pytest.raises(ConfigError, match="private_test must be true or false"):
        private_test_option("file:///d?private_test=maybe")


def test_image_folders_shards_and_text_say_how_they_carved_val(tmp_path):
    """Every source that carves val out of train says so in DatasetInfo (the provider's start-up line and
    ``busctl datasets`` print it); one whose files hold val says nothing."""
    from services.provider.app import split_notice
    from services.provider.sources import open_source
    from tests.support.images import write_imagefolder, write_shards
    from tests.support.text import write_text

    folder = write_imagefolder(tmp_path / "imgs", per_class=10)
    write_shards(tmp_path / "wds", "train", shards=2, per_shard=10)
    text = write_text(tmp_path / "text", train=40)
    for uri, how in [
        (f"file://{folder}?size=8", "per class, the files whose path hashes lowest"),
        (f"file://{tmp_path / 'wds'}?size=8", "per class, the samples whose key hashes lowest"),
        (f"file://{text}?encoded=1", "the lines whose number hashes lowest"),
    ]:
        source = open_source(uri)
        try:
            info = source.info()
            assert info["val_fraction"] == 0.1 and info["val_carved"] == how, (uri, info)
            assert f"carved from train ({how}, val_fraction 0.1" in split_notice("d", info)
        finally:
            source.close()
    held = write_imagefolder(tmp_path / "held", per_class=4, splits=("train", "val"))
    source = open_source(f"file://{held}?size=8")
    try:
        assert "val_fraction" not in source.info() and "carved" not in split_notice("d", source.info())
    finally:
        source.close()

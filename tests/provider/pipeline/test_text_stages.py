"""Text tokenized on the provider: a pipeline's tokenize and pack stages over text lines and WebDataset
``.txt`` members, against the tokenizer's own encoding; tiny-lm trains on the result and its loss falls."""

import numpy as np
import pytest
from tokenizers import Tokenizer

from libbus.errors import ConfigError, DatasetError
from services.provider.sources import open_source
from tests.support.images import shard_members, tar_bytes
from tests.support.text import document, text_pipeline, train_tiny_lm, write_text, write_tokenizer


def expected(tokenizer: Tokenizer, text: str, length: int) -> np.ndarray:
    ids = tokenizer.encode(text).ids + [tokenizer.token_to_id("</s>")]
    out = np.zeros(length + 1, np.uint16)
    out[: min(len(ids), length + 1)] = ids[: length + 1]
    return out


def test_tokenize_and_pack_serve_each_line_as_the_tokenizer_encodes_it(tmp_path):
    tok_path = write_tokenizer(tmp_path / "tokenizer.json")
    root = write_text(tmp_path / "text", train=40, test=10)
    source = open_source(text_pipeline(tmp_path / "p.toml", f"file://{root}?encoded=1", tok_path, 16))
    info = source.info()
    assert (info["kind"], info["sample_shape"], info["dtype"], info["num_classes"]) == ("tokens", [17], "uint16", 19)
    assert {s: v["num_samples"] for s, v in info["splits"].items()} == {"train": 36, "val": 4, "test": 10}
    tokenizer = Tokenizer.from_file(str(tok_path))
    x, y = source.read("test", np.arange(10))
    assert y.shape == (10, 0)
    for i in range(10):
        assert np.array_equal(x[i], expected(tokenizer, document(100_000 + i), 16))
    assert (x == 0).any() and (x[:, -1] != 0).any()  # some documents padded, some cut
    source.close()


def test_webdataset_txt_members_are_tokenized_too(tmp_path):
    tok_path = write_tokenizer(tmp_path / "tokenizer.json")
    root = tmp_path / "wds"
    root.mkdir()
    (root / "train-0000.tar").write_bytes(tar_bytes(shard_members("train", 0, 5, text=document)))
    source = open_source(text_pipeline(tmp_path / "p.toml", f"file://{root}?encoded=1&val_fraction=0", tok_path, 8))
    x, _ = source.read("train", np.arange(5))
    tokenizer = Tokenizer.from_file(str(tok_path))
    assert all(np.array_equal(x[i], expected(tokenizer, document(i), 8)) for i in range(5))
    source.close()
    # shards of images alone: the batch fails naming the sample, never a batch of padding
    (root / "train-0000.tar").write_bytes(tar_bytes(shard_members("train", 0, 3)))
    no_text = open_source(text_pipeline(tmp_path / "q.toml", f"file://{root}?encoded=1&val_fraction=0", tok_path, 8))
    with pytest.raises(DatasetError, match="train-0000.tar:train/s000000 has no text"):
        no_text.read("train", np.arange(3))
    no_text.close()


@pytest.mark.parametrize(
    "change, error, message",
    [
        (("tokenizer.json", "missing.json"), ConfigError, "tokenizer file .*missing.json does not exist"),
        (('eos = "</s>"', 'eos = "<end>"'), ConfigError, "eos token '<end>' is not in"),
        (("length = 8", "length = 0"), ConfigError, "length must be a positive"),
        (("pad_id = 0", "pad_id = 99"), ConfigError, "pad_id must be a token id below"),
        (("?encoded=1", ""), DatasetError, "text is tokenized in a pipeline"),
        (("pack = { length = 8, pad_id = 0 }", "normalize = {}"), ConfigError, "needs numeric image samples"),
    ],
)
def test_careless_text_pipelines_are_refused_naming_the_stage(tmp_path, change, error, message):
    tok_path = write_tokenizer(tmp_path / "tokenizer.json")
    root = write_text(tmp_path / "text", train=4)
    uri = text_pipeline(tmp_path / "p.toml", f"file://{root}?encoded=1", tok_path, 8)
    path = tmp_path / "p.toml"
    path.write_text(path.read_text().replace(*change))
    with pytest.raises(error, match=message):
        open_source(uri)


def test_a_job_trains_tiny_lm_on_text_tokenized_by_the_provider_and_its_loss_falls(
    tmp_path, router, start_provider, trainer, client_for
):  # noqa: F811 - pytest fixture
    root = write_text(tmp_path / "text", train=256, test=64)
    admin = client_for(router.endpoint, role="admin")
    result = train_tiny_lm(tmp_path, f"file://{root}?encoded=1", start_provider, admin, epochs=3)
    history = result["history"]
    # untrained: about log(19) = 2.94 nats; each next word (or the padding after </s>) is determined
    assert history[0]["train_loss"] > result["val_loss"] + 0.5
    assert history[-1]["val_loss"] < history[0]["val_loss"] and result["val_loss"] < 1.0
    assert result["test_n"] == 64

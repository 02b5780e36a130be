"""A Parquet text column tokenized on the provider (``?encoded=1``, then tokenize and pack): the tokens are
the tokenizer's own encoding of each row's string, and tiny-lm trains on them and its loss falls."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from libbus.errors import DatasetError
from services.provider.sources import open_source
from tests.support.text import text_pipeline, train_tiny_lm, write_parquet_text, write_tokenizer


def reference(tokenizer: Tokenizer, texts: list[str], length: int) -> np.ndarray:
    """What pack should hold: each text's ids and </s>, cut at ``length + 1`` or padded with 0."""
    out = np.zeros((len(texts), length + 1), np.uint16)
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text).ids + [tokenizer.token_to_id("</s>")]
        out[i, : min(len(ids), length + 1)] = ids[: length + 1]
    return out


def test_a_parquet_text_column_is_tokenized_as_the_tokenizer_encodes_its_strings(tmp_path):
    tok_path = write_tokenizer(tmp_path / "tokenizer.json")
    root = write_parquet_text(tmp_path / "pq", train=100, test=30, row_group=8)
    source = open_source(text_pipeline(tmp_path / "p.toml", f"parquet://{root}?encoded=1", tok_path, 16))
    info = source.info()
    assert (info["kind"], info["sample_shape"], info["dtype"]) == ("tokens", [17], "uint16")
    assert {s: v["num_samples"] for s, v in info["splits"].items()} == {"train": 90, "val": 10, "test": 30}
    tokenizer = Tokenizer.from_file(str(tok_path))
    column = pq.read_table(root / "test.parquet").column("text").to_pylist()
    picks = np.array([29, 0, 7, 8, 15, 3])  # out of order, across row groups
    x, y = source.read("test", picks)
    assert y.shape == (6, 0)
    assert np.array_equal(x, reference(tokenizer, [column[i] for i in picks], 16))
    assert (x == 0).any() and (x[:, -1] != 0).any()  # some documents padded, some cut
    source.close()
    # the same directory through file://, naming the column
    source = open_source(text_pipeline(tmp_path / "q.toml", f"file://{root}?encoded=1&column=text", tok_path, 16))
    assert np.array_equal(source.read("test", picks)[0], x)
    source.close()


def test_the_text_samples_are_the_rows_strings_and_cannot_be_served_without_a_pipeline(tmp_path):
    table = pa.table({"body": pa.array(["one two", None, "é three"], pa.large_string()), "n": [1, 2, 3]})
    pq.write_table(table, tmp_path / "train.parquet")
    source = open_source(f"parquet://{tmp_path}?encoded=1&column=body&val_fraction=0")
    x, y = source.read("train", np.arange(3))
    assert [s.text for s in x] == ["one two", "", "é three"] and y.shape == (3, 0)  # a null row: empty
    with pytest.raises(DatasetError, match="encoded=1 serves text for a pipeline's tokenize stage"):
        source.read_into("train", np.arange(1), np.empty(1, object), np.empty((1, 0), np.int64))
    source.close()


@pytest.mark.parametrize(
    "query, message",
    [
        ("encoded=1&column=id", "encoded=1 serves text, and column 'id' is int64; name a string column"),
        ("encoded=1&column=nope", "no column 'nope'"),
        ("encoded=1&fields=text", "encoded=1 serves one text column, without fields= or label="),
        ("encoded=2", "encoded must be 0 or 1"),
        ("column=text", "column 'text' is string; .* encoded=1 feeds a pipeline's tokenize stage"),
    ],
)
def test_careless_parquet_text_sources_are_refused_naming_the_column(tmp_path, query, message):
    tok_path = write_tokenizer(tmp_path / "tokenizer.json")
    root = write_parquet_text(tmp_path / "pq", train=8)
    uri = text_pipeline(tmp_path / "p.toml", f"parquet://{root}?{query}", tok_path, 8)
    with pytest.raises(DatasetError, match=message):
        open_source(uri)


def test_a_job_trains_tiny_lm_on_a_parquet_text_column_and_its_loss_falls(
    tmp_path, router, start_provider, trainer, client_for
):  # noqa: F811 - pytest fixture
    root = write_parquet_text(tmp_path / "pq", train=192, test=32)
    admin = client_for(router.endpoint, role="admin")
    result = train_tiny_lm(tmp_path, f"parquet://{root}?encoded=1", start_provider, admin, epochs=2)
    history = result["history"]
    # untrained: about log(19) = 2.94 nats; each next word (or the padding after </s>) is determined
    assert history[0]["train_loss"] > result["val_loss"] + 0.5
    assert history[-1]["val_loss"] < history[0]["val_loss"] and result["val_loss"] < 1.0
    assert result["test_n"] == 32

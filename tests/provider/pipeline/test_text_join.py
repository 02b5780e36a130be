"""``pack = { length = L, join = true }``: every document's tokens and its ``</s>``, concatenated and cut into
samples of ``L + 1`` tokens, addressable by index in any order, and refused where it cannot work."""

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from libbus.errors import ConfigError, DatasetError
from services.provider.sources import open_source
from services.provider.sources.base import ReadPolicy
from services.provider.sources.pipeline.text_join import JoinIndex
from tests.support.busctl import busctl_in_process
from tests.support.httpd import RangeServer
from tests.support.images import shard_members, tar_bytes
from tests.support.text import document, text_pipeline, train_tiny_lm, write_parquet_text, write_text, write_tokenizer


def reference(tokenizer: Tokenizer, texts: list[str], length: int) -> np.ndarray:
    """Packing by hand: each text's ids and </s>, one stream, cut into rows of ``length + 1`` (tail dropped)."""
    eos = tokenizer.token_to_id("</s>")
    stream = np.concatenate([tokenizer.encode(text).ids + [eos] for text in texts])
    rows = len(stream) // (length + 1)
    return stream[: rows * (length + 1)].reshape(rows, length + 1).astype(np.uint16)


def joined(tmp_path, source_uri: str, length: int, chunk: int = 64, keep_mb: int | None = None):
    """The pipeline's source, packed with join (``keep_mb`` 0: batches tokenize their documents again)."""
    tok_path = write_tokenizer(tmp_path / "tokenizer.json")
    path = tmp_path / "p.toml"
    uri = text_pipeline(path, source_uri, tok_path, length, join=True)
    keep = "" if keep_mb is None else f", keep_mb = {keep_mb}"
    path.write_text(f"chunk = {chunk}\n" + path.read_text().replace("join = true", "join = true" + keep))
    return open_source(uri), Tokenizer.from_file(str(tok_path))


# documents over several samples, samples over several documents; tokens kept in memory, tokenized again, or
# kept for the splits that fit the budget (test's 12 documents, not train's 30)
@pytest.mark.parametrize(
    "length, keep_mb, kept", [(4, None, "train test"), (4, 0, ""), (50, 0, ""), (4, 0.001, "test")]
)
def test_joined_samples_are_the_documents_token_stream_cut_into_rows(tmp_path, length, keep_mb, kept):
    root = write_text(tmp_path / "text", train=30, test=12)
    source, tokenizer = joined(tmp_path, f"file://{root}?encoded=1&val_fraction=0", length, keep_mb=keep_mb)
    assert source.read_policy is ReadPolicy.LOOP  # the provider reads it one batch at a time, on its loop
    info = source.info()
    assert (info["kind"], info["sample_shape"], info["dtype"]) == ("tokens", [length + 1], "uint16")
    for split, first, n in (("train", 0, 30), ("test", 100_000, 12)):
        ref = reference(tokenizer, [document(first + k) for k in range(n)], length)
        assert info["splits"][split]["num_samples"] == len(ref) > 0
        x, y = source.read(split, np.arange(len(ref)))
        assert np.array_equal(x, ref) and y.shape == (len(ref), 0)
        index = info["pack"]["splits"][split]
        assert (index["documents"], index["samples"]) == (n, len(ref))
        assert 0 <= index["dropped"] == index["tokens"] - ref.size < length + 1  # only the partial tail
        assert (index["kept_mb"] > 0) == (split in kept)
    assert info["splits"]["val"]["num_samples"] == 0
    source.close()


def test_any_order_and_any_batch_give_the_bytes_of_the_sequential_read(tmp_path):
    root = write_parquet_text(tmp_path / "pq", train=60, test=20, row_group=8)
    source, tokenizer = joined(tmp_path, f"parquet://{root}?encoded=1", 10, chunk=5, keep_mb=0)
    column = pq.read_table(root / "test.parquet").column("text").to_pylist()
    rng = np.random.default_rng(0)
    for split in ("train", "val", "test"):
        n = source.num_samples(split)
        whole = source.read(split, np.arange(n))[0]
        if split == "test":
            assert np.array_equal(whole, reference(tokenizer, column, 10))
        order = rng.permutation(n)
        cuts = np.cumsum(rng.integers(1, 18, n))
        for batch in np.split(order, cuts[cuts < n]):
            assert np.array_equal(source.read(split, batch)[0], whole[batch])
        repeats = np.array([3, 3, 0, n - 1, 3])
        assert np.array_equal(source.read(split, repeats)[0], whole[repeats])
        batches = np.array_split(rng.permutation(n), 8)  # batches in flight at once, as a provider's requests
        with ThreadPoolExecutor(4) as pool:
            for batch, got in zip(batches, pool.map(lambda b, split=split: source.read(split, b)[0], batches)):
                assert np.array_equal(got, whole[batch])
    train = source.read("train", np.arange(source.num_samples("train")))[0]
    source.close()
    again, _ = joined(tmp_path, f"parquet://{root}?encoded=1", 10)  # same files, tokens kept: same samples
    assert np.array_equal(again.read("train", np.arange(len(train)))[0], train)
    again.close()


def test_a_tokenizer_saved_with_padding_pads_nothing_inside_the_stream(tmp_path):
    root = write_text(tmp_path / "text", train=20, test=9)
    source, tokenizer = joined(tmp_path, f"file://{root}?encoded=1&val_fraction=0", 6, keep_mb=0)
    tokenizer.enable_padding(pad_id=0, pad_token="<pad>")  # documents of different lengths in one batch
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    padded = open_source(source.uri)
    tokenizer.no_padding()
    ref = reference(tokenizer, [document(100_000 + k) for k in range(9)], 6)
    assert np.array_equal(padded.read("test", np.arange(len(ref)))[0], ref) and not (ref == 0).any()
    source.close()
    padded.close()


@pytest.mark.parametrize(
    "change, message",
    [
        (("length = 8", "length = 4096"), "join makes no train sample: its 3 documents hold [0-9]+ tokens, fewer than"),
        (("join = true", 'join = "yes"'), "join must be true or false, got 'yes'"),
        (("length = 8", 'length = "8"'), "length must be a positive number of tokens"),
        (("join = true", "join = true, keep_mb = -1"), "keep_mb must be a number of megabytes"),
        (("join = true", "keep_mb = 10"), "keep_mb goes with join = true"),
        (("join = true", 'join = true, index_cache = "/tmp"'), "index_cache goes with join = true and keep_mb = 0"),
        (("join = true", 'join = true, keep_mb = 0, index_cache = "/nonexistent"'), "must name an existing directory"),
    ],
)
def test_careless_joins_are_refused_at_open_with_the_reason(tmp_path, change, message):
    root = write_text(tmp_path / "text", train=3)
    path = tmp_path / "p.toml"
    uri = text_pipeline(path, f"file://{root}?encoded=1&val_fraction=0", write_tokenizer(tmp_path / "t.json"), 8, True)
    path.write_text(path.read_text().replace(*change))
    with pytest.raises(ConfigError, match=message):
        open_source(uri)


def test_join_needs_token_lists_per_sample_and_a_document_changed_after_open_fails_its_batch(tmp_path):
    fixed = tmp_path / "fixed.toml"
    fixed.write_text(
        '[[stages]]\nname = "s"\nsource = { uri = "mock://tokens" }\n[[stages]]\nname = "p"\n'
        'input = "s"\npack = { length = 8, join = true }\n'
    )
    with pytest.raises(ConfigError, match="needs token ids \\(after tokenize\\), got tokens samples"):
        open_source(f"pipeline://{fixed}")
    tok_path = write_tokenizer(tmp_path / "t.json")
    fields = tmp_path / "f.toml"
    text_pipeline(fields, "mock://fields", tok_path, 8, join=True)
    fields.write_text(fields.read_text().replace('input = "text"', 'input = "text"\nfield = "text"'))
    fields.write_text(fields.read_text().replace('input = "tok"', 'input = "tok"\nfield = "text"'))
    with pytest.raises(ConfigError, match="makes each sample from several of its input's, and a source of named"):
        open_source(f"pipeline://{fields}")
    root = tmp_path / "text"
    root.mkdir()
    (root / "train.txt").write_text("one two three\nfour five\nsix seven eight nine\n")
    source, tokenizer = joined(tmp_path, f"file://{root}?encoded=1&val_fraction=0", 2, keep_mb=0)
    assert source.num_samples("train") == 4  # 4 + 3 + 5 tokens
    (root / "train.txt").write_text("one two three\nfour f iv\nsix seven eight nine\n")  # same bytes, more tokens
    with pytest.raises(DatasetError, match="document 1 has 4 tokens, 3 when the dataset was opened"):
        source.read("train", np.arange(4))
    intact = [tokenizer.token_to_id(word) for word in ("one", "two", "three")]
    assert source.read("train", np.array([0]))[0].tolist() == [intact]  # a sample of intact documents still reads
    source.close()


def test_a_job_trains_tiny_lm_on_joined_text_and_its_loss_falls(
    tmp_path, router, start_provider, trainer, client_for, state_dir
):
    root = write_text(tmp_path / "text", train=256, test=64)
    admin = client_for(router.endpoint, role="admin")
    result = train_tiny_lm(tmp_path, f"file://{root}?encoded=1", start_provider, admin, epochs=2, join=True)
    # the operator sees the packing: documents and tokens per split, and how many samples they make
    env = {"BATCHBUS_ROUTER": router.endpoint, "BATCHBUS_STATE_DIR": str(state_dir)}
    code, out, err = busctl_in_process("datasets", env=env)
    assert code == 0, err
    found = re.search(
        r"packing    documents joined into samples of 25 tokens: train ([\d,]+) documents, ([\d,]+) tokens -> ([\d,]+) samples",
        out,
    )
    assert found, out
    documents, tokens, samples = (int(g.replace(",", "")) for g in found.groups())
    assert samples == tokens // 25 and f"splits     train {samples}," in out and documents > 200, out
    history = result["history"]
    # untrained: about log(19) = 2.94 nats; only a document's first word and its end are not determined
    assert history[0]["train_loss"] > result["val_loss"] + 0.5
    assert history[-1]["val_loss"] < history[0]["val_loss"] and result["val_loss"] < 1.0
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))  # the samples of 25 tokens the test split makes
    assert result["test_n"] == len(reference(tokenizer, [document(100_000 + k) for k in range(64)], 24))


@pytest.mark.parametrize("keep", [False, True])
def test_the_index_finds_every_samples_documents_among_empty_and_long_ones(keep):
    rng = np.random.default_rng(3)
    counts = rng.choice([0, 0, 1, 2, 5, 30], 200)  # documents without tokens (no eos), shorter and longer than a row
    docs = [rng.integers(0, 60_000, c) for c in counts]
    stream = np.concatenate(docs)
    index = JoinIndex(counts, 7, stream.astype(np.uint16) if keep else None)
    assert index.num_samples == len(stream) // 7 and index.dropped == len(stream) % 7
    samples = rng.permutation(index.num_samples)[:50]
    needed = index.documents_of(samples)
    got = index.assemble(samples, needed, [docs[d] for d in needed], np.dtype(np.uint16), "train")
    assert np.array_equal(got, stream[: index.num_samples * 7].reshape(-1, 7)[samples])
    if keep:  # cut from the kept stream: nothing to read
        assert len(needed) == 0
    else:  # only documents that hold some of the samples' tokens (or empty ones between them) are read
        starts, ends = index.offsets[needed], index.offsets[needed + 1]
        rows = samples[:, None] * 7
        assert ((starts[None, :] < rows + 7) & (ends[None, :] > rows) | (starts == ends)).any(axis=0).all()


def test_the_index_cache_skips_the_pass_until_a_file_changes_and_trusts_no_corrupt_file_or_link(tmp_path):
    root = write_text(tmp_path / "text", train=30, test=12)
    cache = root / "cache"  # inside the dataset's directory: its own files are not part of the key
    cache.mkdir()
    first, _ = joined(tmp_path, f"file://{root}?encoded=1&val_fraction=0", 4, keep_mb=0)  # no cache yet
    path = tmp_path / "p.toml"
    path.write_text(path.read_text().replace("keep_mb = 0", f'keep_mb = 0, index_cache = "{cache}"'))
    built = open_source(first.uri)
    files = list(cache.glob("pack-*.npz"))
    again = open_source(first.uri)
    assert len(files) == 1 and not built.info()["pack"]["splits"]["train"]["cached"]
    assert again.info()["pack"]["splits"]["train"]["cached"]
    for split in ("train", "test"):
        n = first.num_samples(split)
        assert again.num_samples(split) == n
        assert np.array_equal(again.read(split, np.arange(n))[0], first.read(split, np.arange(n))[0])
    with open(root / "train.txt", "a") as f:  # a document added: another key, the pass runs again
        f.write(document(999) + "\n")
    grown = open_source(first.uri)
    assert not grown.info()["pack"]["splits"]["train"]["cached"] and len(list(cache.glob("pack-*.npz"))) == 2
    assert grown.num_samples("train") > first.num_samples("train")
    for file in cache.glob("pack-*.npz"):
        file.write_bytes(b"not an npz at all")  # a corrupt cache: ignored and written again, never trusted
    rebuilt = open_source(first.uri)
    assert not rebuilt.info()["pack"]["splits"]["train"]["cached"]
    assert np.array_equal(rebuilt.read("train", np.arange(5))[0], grown.read("train", np.arange(5))[0])
    cached = open_source(first.uri)
    assert cached.info()["pack"]["splits"]["train"]["cached"]
    for source in (first, built, again, grown, rebuilt, cached):
        source.close()
    for file in cache.glob("pack-*.npz"):
        file.unlink()
    open_source(first.uri).close()  # writes the current key's file alone
    (file,) = cache.glob("pack-*.npz")
    victim = tmp_path / "victim"  # a link planted where the cache file goes: the link is replaced, not followed
    victim.write_bytes(b"precious")
    file.unlink()
    file.symlink_to(victim)
    planted = open_source(first.uri)
    assert not planted.info()["pack"]["splits"]["train"]["cached"]
    planted.close()
    assert victim.read_bytes() == b"precious" and not any(f.is_symlink() for f in cache.glob("pack-*.npz"))


def test_the_index_cache_is_refused_for_files_behind_http(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "train-0000.tar").write_bytes(tar_bytes(shard_members("train", 0, 5, text=document)))
    server = RangeServer(tmp_path / "w")
    try:
        path = tmp_path / "p.toml"
        shards = f"{server.url}/train-{{0000..0000}}.tar?encoded=1&val_fraction=0"
        uri = text_pipeline(path, shards, write_tokenizer(tmp_path / "t.json"), 4, join=True)
        joined_shards = open_source(uri)
        assert joined_shards.num_samples("train") > 0  # joined shards over HTTP work, without a cache
        joined_shards.close()
        path.write_text(
            path.read_text().replace("join = true", f'join = true, keep_mb = 0, index_cache = "{tmp_path}"')
        )
        with pytest.raises(ConfigError, match="index_cache needs a local source .*http:// files could outlive"):
            open_source(uri)
    finally:
        server.close()

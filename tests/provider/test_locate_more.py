"""Where each sample lives, for the sources tests/provider/test_locate.py leaves out: files of text lines,
pipelines (the source's place of the same index, or of every line a packed token window was cut from),
``weighted://`` mixes (the member and its own place), and the same layouts in an object store or behind
HTTP (the object's address, read back by range). Each location is checked by fetching the bytes it
names and comparing them with the sample the provider serves (or, for joins, with the lines' tokens)."""

from __future__ import annotations

import re
import tarfile
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from libbus.errors import TooLarge
from libbus.wire.messages import BatchRequest, DatasetInfoRequest, LocateSamples, frame_buffer
from services.provider.sources import open_source
from services.provider.sources.base import MAX_LOCATION_CHARS
from tests.support.httpd import RangeServer
from tests.support.images import tar_bytes, write_shards
from tests.support.s3server import s3_in_env
from tests.support.text import WORDS, document, text_pipeline, write_text, write_tokenizer

LINE = re.compile(r"^(?P<file>[^ @]+) line (?P<line>\d+) @(?P<offset>\d+)\+(?P<length>\d+)$")
RANGE = re.compile(r"^(?P<where>[^@]+)@(?P<offset>\d+)\+(?P<length>\d+)$")


def _locate(client, dataset: str, split: str, indices: list[int]) -> list[str]:
    return client.request(LocateSamples(dataset=dataset, split=split, indices=indices)).locations


def _served(client, dataset: str, split: str, indices: list[int]) -> np.ndarray:
    reply = client.request(BatchRequest.for_indices(np.array(indices), dataset=dataset, split=split))
    return np.frombuffer(frame_buffer(reply.frames[0]), np.dtype(reply.dtypes[0])).reshape(reply.shapes[0])


def _line(root: Path, where: str) -> bytes:
    """The bytes a ``FILE line N @OFFSET+LENGTH`` location names, checked against line N of FILE."""
    m = LINE.match(where)
    assert m, f"not FILE line N @OFFSET+LENGTH: {where!r}"
    assert not Path(m["file"]).is_absolute(), where
    data = (root / m["file"]).read_bytes()
    got = data[int(m["offset"]) : int(m["offset"]) + int(m["length"])]
    assert data.split(b"\n")[int(m["line"]) - 1] == got, where  # the line number an editor shows
    return got


def _npy(root: Path, n: int, first: float = 0.0) -> np.ndarray:
    root.mkdir(parents=True, exist_ok=True)
    x = first + np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3)  # every sample's bytes differ
    np.save(root / "train_x.npy", x)
    np.save(root / "train_y.npy", (np.arange(n) % 3).astype(np.int64))
    return x


def _tokens(tokenizer: Tokenizer, text: bytes) -> list[int]:
    return tokenizer.encode(text.decode()).ids + [tokenizer.token_to_id("</s>")]


def test_text_lines_name_the_file_line_and_bytes(tmp_path, start_provider, client_for):
    root = tmp_path / "text"
    root.mkdir()
    # an empty line (skipped as a sample, counted as a line) and a CRLF line
    lines = [b"one two", b"", b"three\r", b"four five six", *(" ".join(WORDS[k % 16 :]).encode() for k in range(40))]
    (root / "train.txt").write_bytes(b"\n".join(lines) + b"\n")
    tok_path = write_tokenizer(tmp_path / "tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tok_path))
    # text is served through a pipeline (alone it has no fixed shape); val carved from train's lines
    provider = start_provider(f"txt={text_pipeline(tmp_path / 'p.toml', f'file://{root}?encoded=1', tok_path, 20)}")
    client = client_for(provider.endpoint)
    splits = client.request(DatasetInfoRequest(dataset="txt")).info["splits"]
    assert (splits["train"]["num_samples"], splits["val"]["num_samples"]) == (39, 4)  # round(43 * 0.1) carved
    seen = []
    for split in ("train", "val"):
        indices = list(range(splits[split]["num_samples"]))
        for where, sample in zip(_locate(client, "txt", split, indices), _served(client, "txt", split, indices)):
            assert where.startswith("train.txt line "), where
            text = _line(root, where)
            ids = _tokens(tokenizer, text.rstrip(b"\r"))[:21]
            assert sample[: len(ids)].tolist() == ids, where  # the line the sample was tokenized from
            seen.append(text)
    assert sorted(seen) == sorted(t for t in lines if t)  # every non-empty line, each once across the splits
    assert b"three\r" in seen  # a CRLF line's bytes as stored (its text is served without the CR)


def test_a_pipeline_names_its_sources_place_of_each_sample(tmp_path, start_provider, client_for):
    root = write_text(tmp_path / "text", train=30)
    tok_path = write_tokenizer(tmp_path / "tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tok_path))
    uri = text_pipeline(tmp_path / "p.toml", f"file://{root}?encoded=1&val_fraction=0", tok_path, 48)
    provider = start_provider(f"lm={uri}")
    client = client_for(provider.endpoint)
    indices = [0, 17, 29, 5]
    served = _served(client, "lm", "train", indices)
    for i, where, sample in zip(indices, _locate(client, "lm", "train", indices), served):
        text = _line(root, where)
        assert text == document(i).encode()
        ids = _tokens(tokenizer, text)[:49]
        assert sample[: len(ids)].tolist() == ids and not sample[len(ids) :].any()  # padded after the line


def test_a_packed_window_names_every_line_it_was_cut_from(tmp_path, start_provider, client_for):
    root = write_text(tmp_path / "text", train=40)
    tok_path = write_tokenizer(tmp_path / "tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tok_path))
    uri = text_pipeline(tmp_path / "p.toml", f"file://{root}?encoded=1&val_fraction=0", tok_path, 30, join=True)
    provider = start_provider(f"packed={uri}")
    client = client_for(provider.endpoint)
    indices = [0, 3, 11, 7]
    served = _served(client, "packed", "train", indices)
    several = 0
    for where, sample in zip(_locate(client, "packed", "train", indices), served):
        parts = where.split("; ")
        several += len(parts) > 1
        lines = [_line(root, part) for part in parts]  # every part a whole line's place
        numbers = [int(LINE.match(part)["line"]) for part in parts]  # type: ignore[index]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # a run of lines, in order
        stream = np.concatenate([_tokens(tokenizer, text) for text in lines]).astype(np.uint16)
        # the window lies in these lines' tokens, starting in the first and ending in the last
        first = len(_tokens(tokenizer, lines[0]))
        starts = [s for s in range(first) if np.array_equal(stream[s : s + len(sample)], sample)]
        assert starts and starts[0] + len(sample) > len(stream) - len(_tokens(tokenizer, lines[-1])), where
    assert several  # windows of 31 tokens over lines of 7..41: some cross a line's end


def test_a_huge_join_stays_bounded(tmp_path):
    root = write_text(tmp_path / "text", train=400)
    tok_path = write_tokenizer(tmp_path / "tokenizer.json")
    uri = text_pipeline(tmp_path / "p.toml", f"file://{root}?encoded=1&val_fraction=0", tok_path, 3000, join=True)
    source = open_source(uri)
    try:
        index = source.regroup.indexes["train"]  # type: ignore[attr-defined]
        samples = np.arange(source.num_samples("train"))
        first, stop = index.spans(samples)
        found = source.locate("train", samples)
        for where, a, b in zip(found, first.tolist(), stop.tolist()):
            assert b - a > 60 and len(where) <= MAX_LOCATION_CHARS, where  # hundreds of lines, a few shown
            *shown, more = where.split("; ")
            m = re.fullmatch(r"… and (\d+) more", more)
            assert m and len(shown) + int(m[1]) == b - a, where
            assert [int(LINE.match(s)["line"]) for s in shown] == list(range(a + 1, a + 1 + len(shown)))  # type: ignore[index]
            for part in shown:
                _line(root, part)
    finally:
        source.close()


def test_a_mix_names_the_member_and_its_place(tmp_path, start_provider, client_for):
    for name, n, first in (("a", 30, 0.0), ("b", 20, 1e6), ("c", 10, 2e6)):  # no two samples alike
        _npy(tmp_path / name, n, first)
    (tmp_path / "mix.toml").write_text(
        f'[[sources]]\nuri = "file://{tmp_path / "a"}?val_fraction=0"\n'
        f'[[sources]]\ndataset = "bee"\n'
        f'[[sources]]\nuri = "file://{tmp_path / "c"}?val_fraction=0"\n'
    )
    provider = start_provider(f"bee=file://{tmp_path / 'b'}?val_fraction=0", f"mix=weighted://{tmp_path / 'mix.toml'}")
    client = client_for(provider.endpoint)
    indices = list(range(60))
    served = _served(client, "mix", "train", indices)
    members = {"source 1": "a", "bee": "b", "source 3": "c"}
    counts = dict.fromkeys(members, 0)
    for where, sample in zip(_locate(client, "mix", "train", indices), served):
        label, _, place = where.partition(": ")
        assert label in members and str(tmp_path) not in where, where  # never the provider's own paths
        m = RANGE.match(place)
        assert m and m["where"] == "train_x.npy", where
        with open(tmp_path / members[label] / m["where"], "rb") as f:
            f.seek(int(m["offset"]))
            assert f.read(int(m["length"])) == sample.tobytes(), where
        counts[label] += 1
    assert counts == {"source 1": 30, "bee": 20, "source 3": 10}  # an epoch: every member's every sample


def test_a_mix_of_sources_that_do_not_know_names_the_members_index(tmp_path, start_provider, client_for):
    (tmp_path / "mix.toml").write_text(
        '[[sources]]\nuri = "mock://mnist?n=600"\nweight = 1\n[[sources]]\ndataset = "digits"\nweight = 1\n'
    )
    provider = start_provider("digits=mock://mnist?n=300", f"mix=weighted://{tmp_path / 'mix.toml'}")
    client = client_for(provider.endpoint)
    found = _locate(client, "mix", "train", list(range(8)))
    # equal weights: the members take turns, each from its own sample 0 on
    assert found == [f"{member}: sample {k // 2}" for k, member in zip(range(8), ["source 1", "digits"] * 4)]


@pytest.fixture(scope="module")
def s3():
    with s3_in_env() as server:
        yield server


def test_object_store_locations_name_the_object_and_its_range(s3, tmp_path, start_provider, client_for):
    import pyarrow as pa
    import pyarrow.parquet as pq

    x = _npy(tmp_path / "arrays", 40)
    s3.put_dir("locs", "arrays/v1", tmp_path / "arrays")
    write_shards(tmp_path / "shards", "train", shards=2, per_shard=5)
    s3.put_dir("locs", "shards", tmp_path / "shards")
    (tmp_path / "pq" / "data").mkdir(parents=True)
    for f in range(2):  # ids 0..9 in the first file, 10..19 in the second; row groups of 3
        ids = list(range(f * 10, f * 10 + 10))
        table = pa.table({"x": pa.array([[float(i)] * 3 for i in ids]), "label": pa.array([i % 3 for i in ids])})
        pq.write_table(table, tmp_path / "pq" / "data" / f"train-{f:05d}-of-00002.parquet", row_group_size=3)
    s3.put_dir("locs", "pq", tmp_path / "pq")
    fast = "val_fraction=0&retries=3&backoff=0.01&deadline=20&cache=off"
    provider = start_provider(
        f"arr=s3://locs/arrays/v1?{fast}", f"wds=s3://locs/shards?size=8&{fast}", f"pq=s3://locs/pq?{fast}"
    )
    client = client_for(provider.endpoint)

    def fetch(where: str) -> bytes:
        m = re.match(r"^s3://(?P<bucket>[^/]+)/(?P<key>[^@]+)@(?P<offset>\d+)\+(?P<length>\d+)$", where)
        assert m, f"not s3://BUCKET/KEY@OFFSET+LENGTH: {where!r}"
        end = int(m["offset"]) + int(m["length"]) - 1
        body = s3.s3.get_object(Bucket=m["bucket"], Key=m["key"], Range=f"bytes={m['offset']}-{end}")["Body"]
        return body.read()

    indices = [0, 39, 17]
    for i, where in zip(indices, _locate(client, "arr", "train", indices)):
        assert where.startswith("s3://locs/arrays/v1/train_x.npy@"), where
        assert fetch(where) == x[i].tobytes()
    for where in _locate(client, "wds", "train", [0, 6, 9]):
        m = re.match(r"^(?P<shard>s3://locs/shards/train-000\d\.tar):(?P<member>[^@]+)(?P<range>@\d+\+\d+)$", where)
        assert m, where
        with tarfile.open(tmp_path / "shards" / m["shard"].rsplit("/", 1)[-1]) as tar:
            expected = tar.extractfile(m["member"]).read()  # type: ignore[union-attr]
        assert fetch(m["shard"] + m["range"]) == expected
    indices = [0, 4, 11, 19]
    for where, sample in zip(_locate(client, "pq", "train", indices), _served(client, "pq", "train", indices)):
        m = re.match(r"^s3://locs/(?P<key>pq/data/train-\d{5}-of-00002\.parquet) row (?P<row>\d+)$", where)
        assert m, where  # Parquet: the object and the row
        body = s3.s3.get_object(Bucket="locs", Key=m["key"])["Body"].read()
        row = pq.read_table(pa.BufferReader(body)).slice(int(m["row"]), 1).to_pylist()[0]
        assert row["x"] == sample.tolist()
    # no endpoint, no credential: what a location says is the object's address and no more
    found = [
        w for name, n in (("arr", 40), ("wds", 10), ("pq", 20)) for w in _locate(client, name, "train", list(range(n)))
    ]
    assert all("127.0.0.1" not in w and s3.access_key not in w and s3.secret_key not in w for w in found)


def test_http_locations_name_the_url_and_its_range(tmp_path, start_provider, client_for):
    x = _npy(tmp_path / "arrays", 20)
    server = RangeServer(tmp_path / "arrays")
    try:
        provider = start_provider(f"arr={server.url}/?files=train_x.npy,train_y.npy&val_fraction=0")
        client = client_for(provider.endpoint)
        for i, where in zip([0, 19, 7], _locate(client, "arr", "train", [0, 19, 7])):
            m = RANGE.match(where)
            assert m and m["where"] == f"{server.url}/train_x.npy", where
            end = int(m["offset"]) + int(m["length"]) - 1
            req = urllib.request.Request(m["where"], headers={"Range": f"bytes={m['offset']}-{end}"})
            with urllib.request.urlopen(req, timeout=10) as reply:
                assert reply.read() == x[i].tobytes()
    finally:
        server.close()


def test_busctl_asks_in_parts_when_long_locations_do_not_fit_one_reply(
    tmp_path, start_provider, client_for, make_settings, router
):
    from cli.jobs import locate_samples

    root = write_text(tmp_path / "text", train=200)
    tok_path = write_tokenizer(tmp_path / "tokenizer.json")
    uri = text_pipeline(tmp_path / "p.toml", f"file://{root}?encoded=1&val_fraction=0", tok_path, 400, join=True)
    provider = start_provider(f"packed={uri}")
    reader = client_for(provider.endpoint)
    n = reader.request(DatasetInfoRequest(dataset="packed")).info["splits"]["train"]["num_samples"]
    one = _locate(reader, "packed", "train", list(range(n)))
    assert min(map(len, one)) > 200  # windows of 401 tokens over lines of 7..41: long, bounded locations
    indices = [k % n for k in range(3000)]  # a step of 3000 such windows: more than one reply carries
    with pytest.raises(TooLarge, match="do not fit one reply"):
        _locate(reader, "packed", "train", indices)
    admin = client_for(router.endpoint, "admin")
    assert locate_samples(make_settings(), admin, "packed", "train", indices) == {k: one[k] for k in range(n)}


def test_text_in_webdataset_shards_names_each_txt_member(tmp_path, start_provider, client_for):
    root = tmp_path / "w"
    root.mkdir()
    members = [
        (f"train/s{n:06d}.{ext}", data)
        for n in range(12)
        for ext, data in (("cls", b"0"), ("txt", document(n).encode()))
    ]
    (root / "train-0000.tar").write_bytes(tar_bytes(members))
    tok_path = write_tokenizer(tmp_path / "tokenizer.json")
    uri = text_pipeline(tmp_path / "p.toml", f"file://{root}?encoded=1&val_fraction=0", tok_path, 20, join=True)
    provider = start_provider(f"wtext={uri}")
    client = client_for(provider.endpoint)
    data = (root / "train-0000.tar").read_bytes()
    for where in _locate(client, "wtext", "train", [0, 4]):
        for part in where.split("; "):
            m = re.match(r"^train-0000\.tar:train/s(?P<n>\d{6})\.txt@(?P<offset>\d+)\+(?P<length>\d+)$", part)
            assert m, where  # the text member, not the class id beside it
            assert data[int(m["offset"]) : int(m["offset"]) + int(m["length"])] == document(int(m["n"])).encode()

"""weighted:// mixes: the schedule's proportions are exact for every prefix (property tests), a
length-weighted epoch reads every sample of every source exactly once, reads return the sources'
own bytes with one read per source, bad mix files are refused naming the entry, and a provider
serves a mix through the real services."""

from __future__ import annotations

import textwrap
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libbus.errors import DatasetError
from libbus.wire.messages import BatchRequest, DatasetInfoRequest
from services.provider.sources import Source, open_source
from services.provider.sources.weighted import Mix, Schedule, integer_weights


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(1, 3))
def test_every_prefix_holds_each_source_within_one_of_its_share(weights, laps):
    schedule = Schedule(weights)
    total = sum(weights)
    src, _ = schedule.locate(np.arange(laps * schedule.period + 7))
    prefix = np.arange(1, len(src) + 1)
    for j, w in enumerate(weights):
        counts = np.cumsum(src == j)
        assert np.all(np.abs(counts - prefix * w / total) < 1), (weights, j)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=5), st.integers(1, 4))
def test_length_weights_read_each_sample_of_each_source_once_per_epoch(lengths, scale):
    lengths = [n * scale for n in lengths]  # common factors make the schedule repeat within the epoch
    schedule = Schedule(integer_weights(lengths))
    src, k = schedule.locate(np.arange(sum(lengths)))
    for j, n in enumerate(lengths):
        assert sorted(k[src == j].tolist()) == list(range(n))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=4), st.lists(st.integers(0, 500), max_size=30))
def test_locating_any_position_agrees_with_walking_the_schedule(weights, positions):
    schedule = Schedule(weights)
    src, k = schedule.locate(np.arange(501))
    seen = [0] * len(weights)
    for i, s in enumerate(src.tolist()):  # k is how many times the source came before
        assert k[i] == seen[s]
        seen[s] += 1
    one_src, one_k = schedule.locate(np.array(positions, np.int64))
    assert one_src.tolist() == src[positions].tolist() and one_k.tolist() == k[positions].tolist()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=8))
def test_the_fast_construction_is_the_quota_method_step_by_step(weights):
    counts, want = [0] * len(weights), []
    for t in range(1, sum(weights) + 1):  # the method as its definition reads, one position at a time
        under = [j for j, (c, w) in enumerate(zip(counts, weights)) if c * sum(weights) < t * w]
        pick = min(under, key=lambda j: (Fraction(counts[j] + 1, weights[j]), j))
        want.append(pick)
        counts[pick] += 1
    assert Schedule(weights).ids.tolist() == want


def test_large_batches_are_located_in_chunks():
    schedule = Schedule([3, 5, 2])
    positions = np.random.default_rng(0).integers(0, 10**9, 50_000)
    src, k = schedule.locate(positions)
    one = [schedule.locate(positions[i : i + 1]) for i in (0, 20_000, 49_999)]
    assert [(int(s[0]), int(kk[0])) for s, kk in one] == [(int(src[i]), int(k[i])) for i in (0, 20_000, 49_999)]


def test_float_weights_are_read_as_written():
    assert integer_weights([0.3, 0.7]) == [3, 7]
    assert integer_weights([2, 0.5]) == [4, 1]
    assert integer_weights([6, 9]) == [2, 3]


class Counting(Source):
    """A source whose sample k is filled with ``tag * 1000 + k``, counting its read calls."""

    def __init__(self, tag: int, n: int):
        self.uri, self.tag, self.n = f"count://{tag}", tag, n
        self.sample_shape, self.dtype = (2,), np.dtype(np.float32)
        self.num_classes = 10
        self.calls: list[list[int]] = []

    def num_samples(self, split: str) -> int:
        return self.n if split == "train" else 0

    def read(self, split, indices):
        self.calls.append(list(indices))
        x = np.repeat((self.tag * 1000 + np.asarray(indices, np.float32))[:, None], 2, axis=1)
        return x, np.full(len(indices), self.tag, np.int64)


def write_mix(path: Path, body: str) -> str:
    path.write_text(textwrap.dedent(body))
    return f"weighted://{path}"


def test_a_batch_reads_each_source_once_and_returns_its_samples(tmp_path):
    a, b = Counting(1, 30), Counting(2, 10)
    mix = open_source(
        write_mix(
            tmp_path / "mix.toml",
            """
        [[sources]]
        dataset = "a"
        [[sources]]
        dataset = "b"
    """,
        ),
        {"a": a, "b": b},
    )
    assert mix.num_samples("train") == 40 and mix.num_samples("test") == 0
    idx = np.array([39, 0, 1, 2, 3, 17, 17, 5], np.int64)
    x, y = mix.read("train", idx)
    assert len(a.calls) == 1 and len(b.calls) == 1  # one read per source, whatever the batch's order
    src, k = mix._splits["train"][2].locate(idx)
    want = np.where(src == 0, 1000 + k, 2000 + k)
    assert x[:, 0].tolist() == want.tolist() and y.tolist() == np.where(src == 0, 1, 2).tolist()
    # a whole epoch in order: three samples of a to one of b, each sample once
    x, _ = mix.read("train", np.arange(40))
    assert sorted(x[:, 0].tolist()) == sorted([1000.0 + i for i in range(30)] + [2000.0 + i for i in range(10)])
    assert np.sum(x[:8, 0] >= 2000) == 2


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=4))
def test_a_length_weighted_mix_serves_every_sample_once_per_epoch(lengths):
    sources = {f"s{i}": Counting(i + 1, n) for i, n in enumerate(lengths)}
    mix = Mix("weighted://test", list(sources), list(sources.values()), None)
    x, _ = mix.read("train", np.random.default_rng(0).permutation(sum(lengths)))
    served = sorted(x[:, 0].tolist())
    assert served == sorted(float(1000 * (i + 1) + k) for i, n in enumerate(lengths) for k in range(n))
    assert all(len(s.calls) <= 1 for s in sources.values())


def test_explicit_weights_repeat_a_short_source(tmp_path):
    a, b = Counting(1, 30), Counting(2, 4)
    mix = open_source(
        write_mix(
            tmp_path / "mix.toml",
            """
        [[sources]]
        dataset = "a"
        weight = 0.5
        [[sources]]
        dataset = "b"
        weight = 0.5
    """,
        ),
        {"a": a, "b": b},
    )
    x, _ = mix.read("train", np.arange(34))
    from_b = x[x[:, 0] >= 2000, 0]
    assert len(from_b) == 17 and set(from_b.tolist()) == {2000.0, 2001.0, 2002.0, 2003.0}
    assert mix.info()["sources"][1]["train_share"] == 0.5


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "[[sources]]\nuri = 'mock://mnist?n=60'\n[[sources]]\nuri = 'mock://cifar10?n=60'\n",
            r"source 2 \(mock://cifar10\?n=60\) has sample_shape \(3, 32, 32\)",
        ),
        (
            "[[sources]]\nuri = 'mock://mnist?n=60'\nweight = 2\n[[sources]]\nuri = 'mock://mnist?n=30'\n",
            "give every source a weight, or none",
        ),
        ("[[sources]]\ndataset = 'nope'\n", r"dataset 'nope' is not served by this provider before the mix"),
        ("[[sources]]\nuri = 'mock://mnist'\nweight = -1\n", "source 1: weight must be a positive number"),
        ("[[sources]]\nuri = 'mock://mnist'\ndataset = 'x'\n", "give either uri"),
        ("[[sources]]\nuri = 'mock://mnist'\nweigth = 1\n", r"source 1: unknown key\(s\) weigth"),
        ("[[sources]]\nuri = 'mock://nope'\n", "source 1: mock://nope: unknown mock dataset"),
        ("[[sources]]\nuri = 'weighted:///x.toml'\n", "to nest a mix, serve it under a name"),
        ("sources = []\n", "a mix needs at least one source"),
        ("[[sources]\n", "not valid TOML"),
    ],
)
def test_bad_mix_files_name_the_entry(tmp_path, body, message):
    uri = write_mix(tmp_path / "mix.toml", body)
    with pytest.raises(DatasetError, match=message):
        open_source(uri, {})


def test_a_missing_mix_file_is_named(tmp_path):
    with pytest.raises(DatasetError, match="cannot read .*missing.toml"):
        open_source(f"weighted://{tmp_path}/missing.toml")


def test_the_provider_serves_a_mix(tmp_path, start_provider, client_for):
    uri = write_mix(
        tmp_path / "mix.toml",
        """
        [[sources]]
        uri = "mock://mnist?n=300&seed=1"
        weight = 1
        [[sources]]
        dataset = "digits"
        weight = 2
    """,
    )
    provider = start_provider("digits=mock://mnist?n=600&seed=2", f"mix={uri}")
    client = client_for(provider.endpoint)
    info = client.request(DatasetInfoRequest(dataset="mix")).info
    assert info["format"] == "weighted" and info["splits"]["train"]["num_samples"] == 900
    assert [s["train_share"] for s in info["sources"]] == pytest.approx([1 / 3, 2 / 3])
    idx = np.array([0, 1, 2, 899, 450], "<i8")
    reply = client.request(BatchRequest(dataset="mix", split="train", frames=[idx.tobytes()]))
    x = np.frombuffer(reply.frames[0].buffer, reply.dtypes[0]).reshape(reply.shapes[0])
    mix = open_source(uri, {"digits": open_source("mock://mnist?n=600&seed=2")})
    assert np.array_equal(x, mix.read("train", idx)[0])

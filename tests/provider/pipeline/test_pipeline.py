"""Pipeline datasets (``pipeline://FILE.toml``): each transform on small arrays, determinism per (seed, epoch,
split, index), stage metrics and queues, stage control, deadlines and shutdown. The factory's refusals are in
tests/provider/pipeline/test_pipeline_factory.py."""

from __future__ import annotations

import threading
import time
from typing import ClassVar

import numpy as np
import pytest

from libbus.errors import BadRequest, DatasetError, Forbidden, NotFound, Timeout
from services.provider.sources import open_source
from services.provider.sources.pipeline import Pipeline, find_stage, pipeline_stats, stage_control
from services.provider.sources.pipeline.stages import Chunk, SourceStage, Spec, Stage
from services.provider.sources.pipeline.transforms import Cast, Flip, Normalize, OneHot, RandomCrop
from tests.support.pipeline import (
    SOURCE,
    open_pipeline_fixture,  # noqa: F401 - the `open_pipeline` fixture
    read,
)

AUGMENT = (
    SOURCE
    + """
[[stages]]
name = "norm"
input = "images"
normalize = { mean = 0.0, std = [2.0, 2.0, 2.0] }
[[stages]]
name = "crop"
input = "norm"
random_crop = { padding = 4 }
[[stages]]
name = "flip"
input = "crop"
flip = {}
"""
)


# -- each transform on small arrays ---------------------------------------------------------------


def spec(shape=(3, 4, 5), dtype=np.float32, label_shape=(), label_dtype=np.int64, classes=4) -> Spec:
    return Spec(tuple(shape), np.dtype(dtype), tuple(label_shape), np.dtype(label_dtype), classes, "image")


def chunk(x, y=None, split="train", epoch=0, indices=None) -> Chunk:
    indices = np.arange(len(x)) if indices is None else np.asarray(indices)
    return Chunk(None, 0, indices, split, epoch, x, np.zeros(len(x), np.int64) if y is None else y)


def test_normalize_gives_each_channel_mean_0_and_std_1():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 3, 4, 4)) * [[[5]], [[0.5]], [[2]]] + [[[10]], [[-3]], [[0]]]
    mean, std = x.mean(axis=(0, 2, 3)), x.std(axis=(0, 2, 3))
    stage = Normalize("n", {"mean": mean.tolist(), "std": std.tolist()}, spec(dtype=np.float64, shape=(3, 4, 4)))
    c = chunk(x)
    stage.run(c)
    assert c.x.dtype == np.float32
    np.testing.assert_allclose(c.x.mean(axis=(0, 2, 3)), 0, atol=1e-4)
    np.testing.assert_allclose(c.x.std(axis=(0, 2, 3)), 1, atol=1e-4)
    # uint8 in, float out: (x - mean) / std exactly
    u = np.arange(2 * 3 * 4 * 5, dtype=np.uint8).reshape(2, 3, 4, 5)
    stage = Normalize("n", {"mean": 10, "std": [1, 2, 4]}, spec(dtype=np.uint8))
    c = chunk(u)
    stage.run(c)
    np.testing.assert_allclose(c.x, (u - 10.0) / np.array([1, 2, 4])[None, :, None, None], rtol=1e-6)


def test_one_hot_rows_sum_to_one_at_the_label():
    y = np.array([0, 3, 1, 3, 2])
    stage = OneHot("h", {}, spec(classes=4))
    c = chunk(np.zeros((5, 3, 4, 5), np.float32), y)
    stage.run(c)
    assert c.y.shape == (5, 4) and c.y.dtype == np.float32
    np.testing.assert_array_equal(c.y.sum(1), 1)
    np.testing.assert_array_equal(c.y.argmax(1), y)
    with pytest.raises(DatasetError, match=r"stage 'h' \(one_hot\): label 4 is outside the 4 classes"):
        stage.run(chunk(np.zeros((1, 3, 4, 5), np.float32), np.array([4])))
    assert stage.errors == 1 and stage.items_in == 6 and stage.items_out == 5


def test_cast_converts_samples_and_labels():
    stage = Cast("c", {"dtype": "uint8", "label_dtype": "int16"}, spec())
    c = chunk(np.full((2, 3, 4, 5), 7.9, np.float32), np.array([1, 2]))
    stage.run(c)
    assert (c.x.dtype, c.y.dtype) == (np.uint8, np.int16) and c.x.max() == 7
    assert Cast("c", {"label_dtype": "float32"}, spec()).spec.dtype == np.float32  # samples untouched


def test_flip_is_an_involution_and_mirrors_the_last_axis():
    x = np.random.default_rng(1).standard_normal((8, 3, 4, 5)).astype(np.float32)
    always = Flip("f", {"p": 1.0}, spec(), seed=0)
    once = chunk(x.copy())
    always.run(once)
    np.testing.assert_array_equal(once.x, x[..., ::-1])
    twice = chunk(once.x)
    always.run(twice)
    np.testing.assert_array_equal(twice.x, x)
    never = chunk(x.copy())
    Flip("f", {"p": 0.0}, spec(), seed=0).run(never)
    np.testing.assert_array_equal(never.x, x)
    half = Flip("f", {}, spec(), seed=0)
    c = chunk(np.repeat(x[:1], 400, axis=0))
    half.run(c)
    flipped = (c.x == x[0][..., ::-1]).all(axis=(1, 2, 3)).sum()
    assert 150 < flipped < 250  # p = 0.5: a binomial(400, 0.5) count, 5 standard deviations wide
    val = chunk(x.copy(), split="val")
    always.run(val)
    np.testing.assert_array_equal(val.x, x)  # train only, by default


def test_random_crop_cuts_a_window_of_the_padded_sample():
    x = np.arange(50 * 2 * 6 * 6, dtype=np.float32).reshape(50, 2, 6, 6)
    stage = RandomCrop("c", {"padding": 2, "size": [6, 6], "fill": -1}, spec(shape=(2, 6, 6)), seed=0)
    c = chunk(x.copy())
    stage.run(c)
    padded = np.pad(x, [(0, 0), (0, 0), (2, 2), (2, 2)], constant_values=-1)
    offsets = set()
    for row in range(50):
        matches = [
            (t, left)
            for t in range(5)
            for left in range(5)
            if np.array_equal(c.x[row], padded[row, :, t : t + 6, left : left + 6])
        ]
        assert matches, f"row {row} is not a window of its padded sample"
        offsets.update(matches)
    assert len(offsets) > 5  # the place varies from sample to sample
    center = chunk(x.copy(), split="val")
    stage.run(center)
    np.testing.assert_array_equal(center.x, x)  # val: the centre of the padded sample, i.e. the sample
    small = RandomCrop("c", {"size": 4}, spec(shape=(2, 6, 6)), seed=0)
    assert small.spec.sample_shape == (2, 4, 4)
    c = chunk(x[:1].copy(), split="val")
    small.run(c)
    np.testing.assert_array_equal(c.x, x[:1, :, 1:5, 1:5])


# -- determinism ----------------------------------------------------------------------------------


def test_the_same_request_gives_the_same_bytes_and_another_epoch_other_crops(open_pipeline):
    p = open_pipeline(AUGMENT)
    x1, y1 = read(p, "train", range(40, 104), epoch=3)
    x2, y2 = read(p, "train", range(40, 104), epoch=3)
    assert x1.tobytes() == x2.tobytes() and y1.tobytes() == y2.tobytes()
    # the same samples in other batches (other chunk boundaries, shuffled order) are the same bytes
    order = np.random.default_rng(0).permutation(np.arange(40, 104))
    x3, _ = read(p, "train", order, epoch=3)
    np.testing.assert_array_equal(x3, x1[order - 40])
    x4, y4 = read(p, "train", range(40, 104), epoch=4)
    assert np.array_equal(y4, y1)
    differ = (x4 != x1).any(axis=(1, 2, 3)).mean()
    assert differ > 0.8, f"only {differ:.0%} of the samples changed with the epoch"
    # a new pipeline from the same file reproduces it: nothing depends on process state
    again = open_pipeline(AUGMENT, name="copy.toml")
    x5, _ = read(again, "train", range(40, 104), epoch=3)
    assert x5.tobytes() == x1.tobytes()
    # val is not augmented: the same every epoch, and equal to the normalized source
    v0, _ = read(p, "val", range(20), epoch=0)
    v1, _ = read(p, "val", range(20), epoch=7)
    src, _ = p.source.read("val", np.arange(20))
    assert v0.tobytes() == v1.tobytes()
    np.testing.assert_allclose(v0, src / 2, rtol=1e-6)


# -- metrics and queues ---------------------------------------------------------------------------


def test_every_stage_counts_its_items_and_its_queue(open_pipeline):
    p = open_pipeline("chunk = 10\nqueue_capacity = 2\n" + AUGMENT)
    read(p, "train", range(64))
    read(p, "val", range(5))
    m = pipeline_stats({"aug": p, "other": open_source("mock://mnist?n=10")})["pipelines"]["aug"]
    assert [s["name"] for s in m["stages"]] == ["images", "norm", "crop", "flip"]
    chunks = 7 + 1
    assert m["requests"] | {"size": 0} == {
        "name": "requests",
        "size": 0,
        "capacity": 2,
        "put": chunks,
        "get": chunks,
        "drop": 0,
        "closed": False,
    }
    for s in m["stages"]:
        assert (s["items_in"], s["items_out"], s["errors"]) == (69, 69, 0), s
        assert s["busy_s"] > 0
        assert (s["queue"]["capacity"], s["queue"]["put"], s["queue"]["get"]) == (2, chunks, chunks)
    assert m["stages"][2]["items_since_anchor"] == 64  # only train samples draw random numbers
    assert pipeline_stats({"plain": open_source("mock://mnist?n=10")}) == {}


def test_a_failing_stage_fails_the_batch_with_its_name_and_the_pipeline_goes_on(open_pipeline):
    p = open_pipeline(
        "chunk = 4\n" + SOURCE + '[[stages]]\nname = "hot"\ninput = "images"\none_hot = { num_classes = 3 }\n'
    )
    with pytest.raises(DatasetError, match=r"stage 'hot' \(one_hot\): label \d is outside the 3 classes"):
        read(p, "train", range(40))
    labels = p.source.labels("train", np.arange(200))
    ok = np.flatnonzero(labels < 3)[:8]
    _, y = read(p, "train", ok)  # queues are FIFOs: this batch comes out after the failed one's leftovers
    np.testing.assert_array_equal(y.argmax(1), labels[ok])
    m = p.metrics()
    source, hot = m["stages"]
    assert hot["errors"] == 1  # the failed batch's later chunks were dropped, not processed
    # every chunk taken from a queue was either processed by its consumer or dropped: none went missing
    assert m["requests"]["get"] == source["items_in"] // 4 + m["requests"]["drop"]
    assert source["queue"]["get"] == hot["items_in"] // 4 + source["queue"]["drop"]
    assert hot["queue"]["put"] == hot["items_out"] // 4 == 2 and hot["queue"]["drop"] == 0


# -- control --------------------------------------------------------------------------------------


def test_set_seed_changes_the_bytes_and_reset_restores_them(open_pipeline):
    p = open_pipeline(AUGMENT)
    datasets = {"aug": p}
    before, _ = read(p, "train", range(32), epoch=1)
    dataset, crop = find_stage(datasets, "", "crop")
    assert dataset == "aug"
    assert crop.control("get", {}) == {"seed": 0, "epoch": "request", "items_since_anchor": 32}
    assert crop.control("set", {"seed": 9}) == {"seed": 9, "epoch": "request", "items_since_anchor": 0}
    reseeded, _ = read(p, "train", range(32), epoch=1)
    assert (reseeded != before).any(axis=(1, 2, 3)).mean() > 0.8
    # a pinned epoch overrides the requests': epoch 1 is now served whatever they ask for
    crop.control("set", {"seed": 0, "epoch": 1})
    find_stage(datasets, "aug", "flip")[1].control("set", {"epoch": 1})
    pinned, _ = read(p, "train", range(32), epoch=5)
    assert pinned.tobytes() == before.tobytes()
    assert crop.control("reset", {}) == {"seed": 0, "epoch": "request", "items_since_anchor": 0}
    find_stage(datasets, "aug", "flip")[1].control("reset", {})
    again, _ = read(p, "train", range(32), epoch=1)
    assert again.tobytes() == before.tobytes()
    assert crop.control("stats", {})["items_in"] == 128


def test_control_errors_name_the_stage_and_what_it_knows(open_pipeline):
    p = open_pipeline(AUGMENT)
    datasets = {"aug": p, "b": open_pipeline(SOURCE, name="b.toml"), "plain": open_source("mock://mnist?n=10")}
    with pytest.raises(BadRequest, match=r"stage 'norm' \(normalize\) has no command 'reset'; it answers stats"):
        find_stage(datasets, "", "norm")[1].control("reset", {})
    with pytest.raises(BadRequest, match="stage 'crop': set takes seed=N and/or epoch=N .* got speed"):
        find_stage(datasets, "", "crop")[1].control("set", {"speed": 1})
    with pytest.raises(BadRequest, match="stage 'crop': seed must be a non-negative integer, got 'x'"):
        find_stage(datasets, "", "crop")[1].control("set", {"seed": "x"})
    with pytest.raises(NotFound, match="has no stage 'crops'; its stages are images, norm, crop, flip"):
        find_stage(datasets, "aug", "crops")
    with pytest.raises(NotFound, match="no pipeline here has a stage 'nope'; stages: aug/images"):
        find_stage(datasets, "", "nope")
    with pytest.raises(BadRequest, match=r"stage 'images' is in several pipelines \(aug, b\)"):
        find_stage(datasets, "", "images")
    with pytest.raises(NotFound, match="'plain' is not a pipeline dataset here; pipelines: aug, b"):
        find_stage(datasets, "plain", "images")
    with pytest.raises(NotFound, match="serves no pipeline dataset"):
        find_stage({"plain": datasets["plain"]}, "", "images")


def test_stage_star_sends_a_command_to_every_stage_that_answers_it_after_the_scope_check(open_pipeline):
    p = open_pipeline(AUGMENT)
    datasets = {"aug": p, "plain": open_source("mock://mnist?n=10")}
    allowed: list[str] = []
    detail = stage_control(datasets, "", "*", "set", {"seed": 4}, allowed.append)
    assert allowed == ["aug"] and (detail["dataset"], detail["stage"]) == ("aug", "*")
    assert detail["result"] == {
        "crop": {"seed": 4, "epoch": "request", "items_since_anchor": 0},
        "flip": {"seed": 4, "epoch": "request", "items_since_anchor": 0},
    }
    assert set(stage_control(datasets, "aug", "*", "stats", {}, allowed.append)["result"]) == {
        "images",
        "norm",
        "crop",
        "flip",
    }

    def refuse(dataset: str) -> None:
        raise Forbidden(f"not {dataset}")

    with pytest.raises(Forbidden, match="not aug"):
        stage_control(datasets, "", "*", "reset", {}, refuse)
    with pytest.raises(Forbidden, match="not aug"):
        stage_control(datasets, "", "crop", "reset", {}, refuse)
    assert p.stage("crop").seed == 4  # refused before anything ran
    stage_control(datasets, "", "*", "reset", {}, allowed.append)
    assert p.stage("crop").seed == p.stage("flip").seed == 0
    with pytest.raises(BadRequest, match="no stage of 'aug' answers 'rewind'"):
        stage_control(datasets, "", "*", "rewind", {}, allowed.append)
    datasets["b"] = open_pipeline(SOURCE, name="b.toml")
    with pytest.raises(BadRequest, match=r"stage '\*' needs the dataset: this provider serves 2 pipelines \(aug, b\)"):
        stage_control(datasets, "", "*", "reset", {}, allowed.append)
    with pytest.raises(NotFound, match="'plain' is not a pipeline dataset here"):
        stage_control(datasets, "plain", "*", "reset", {}, allowed.append)


# -- deadlines and shutdown -----------------------------------------------------------------------


class Slow(Stage):
    """A transform that takes its time: a stand-in for a stalled disk or a heavy decode."""

    type = "slow"
    params: ClassVar[dict] = {"seconds": 0.0}

    def check(self, spec: Spec) -> Spec:
        return spec

    def apply(self, chunk: Chunk) -> None:
        time.sleep(self.config["seconds"])


def slow_pipeline(seconds: float, timeout_s: float) -> Pipeline:
    source = SourceStage("images", {"uri": "mock://mnist?n=50"}, None, open_source=open_source)
    return Pipeline(
        "test://slow",
        [source, Slow("slow", {"seconds": seconds}, source.spec)],
        chunk=2,
        queue_capacity=2,
        timeout_s=timeout_s,
    )


def test_a_batch_not_through_in_time_fails_and_its_late_chunks_are_never_written():
    p = slow_pipeline(0.2, timeout_s=0.7)
    try:
        x = np.zeros((12, 1, 28, 28), np.float32)
        y = np.full(12, -1)
        started = time.monotonic()
        with pytest.raises(Timeout, match="test://slow: batch of 12 samples not through the pipeline within 0.7 s"):
            p.serve_into("train", np.arange(12), x, y)
        assert time.monotonic() - started < 5
        # wait until every chunk put in has been taken out again: processed and written, or dropped
        deadline = time.monotonic() + 10
        while True:
            m = p.metrics()
            queues = [m["requests"], *(s["queue"] for s in m["stages"])]
            if all(q["put"] == q["get"] for q in queues) and m["stages"][1]["items_in"] == m["stages"][1]["items_out"]:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.1)
        assert (y[-2:] == -1).all() and not x[-2:].any(), "a chunk finished after the deadline was written"
        # the chunks after the deadline were dropped (by the slow stage, or by the sink after it)
        assert sum(q["drop"] for q in queues) >= 1
        _, y2 = read(p, "train", [0, 1])  # and the pipeline still serves
        assert (y2 >= 0).all()
    finally:
        p.close()


def test_close_stops_the_threads_and_fails_a_read_in_flight():
    p = slow_pipeline(0.2, timeout_s=30)
    read(p, "train", [0])
    closer = threading.Timer(0.3, p.close)
    closer.start()
    started = time.monotonic()
    with pytest.raises(DatasetError, match="test://slow: pipeline closed while reading"):
        read(p, "train", range(20))
    assert time.monotonic() - started < 5
    closer.join()
    assert not any(t.is_alive() for t in p._threads)
    with pytest.raises(DatasetError, match="pipeline is closed"):
        read(p, "train", [0])

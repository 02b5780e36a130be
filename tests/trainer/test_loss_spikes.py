"""Loss spikes skipped by the trainer itself (the job's ``spike`` option): the detector's rule,
the option's refusals, and real jobs on a dataset whose known stretch of samples yields a huge loss."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from libbus.errors import BadRequest, Forbidden
from libbus.jobs.spec import JobSpec, SpikeSpec
from libbus.wire.messages import GetJob, GetTask, SkipJob, SubmitJob
from services.trainer.attempt.audit import effective_epochs
from services.trainer.attempt.spike import SpikeDetector
from tests.support.jobs import SPEC, EntryCluster

#: Train samples of the test dataset, and the batches (of 16, in file order) whose samples are x 1e5.
N = 480
BATCH = 16


# -- the rule -------------------------------------------------------------------------------------
def _detector(**rule) -> SpikeDetector:
    return SpikeDetector(SpikeSpec(**{"factor": 3.0, "window": 4, "warmup": 3, **rule}))


def test_a_loss_above_factor_times_the_median_of_the_window_is_a_spike_after_the_warmup():
    d = _detector()
    assert d.observe(1, 100.0) is None  # in the warmup: nothing to compare with yet
    assert d.observe(2, 1.0) is None
    assert d.observe(3, 1.0) is None
    spike = d.observe(4, 3.5)  # median of [100, 1, 1] is 1: one high loss before does not hide it
    assert spike is not None and (spike.step, spike.loss, spike.median, spike.window) == (4, 3.5, 1.0, 3)
    assert d.observe(5, 2.9) is None  # within 3 x 1; the spike did not join the window
    assert list(d.losses) == [100.0, 1.0, 1.0, 2.9]
    for k in range(6, 10):  # the window slides: the old losses are forgotten
        assert d.observe(k, 2.0) is None
    assert list(d.losses) == [2.0, 2.0, 2.0, 2.0]
    assert d.observe(10, 5.9) is None and d.observe(11, 6.1) is not None
    # a loss that stays high stays a spike: it never joins the window (max_skips ends such a job)
    assert all(d.observe(k, 50.0) is not None for k in range(12, 20))


def test_a_loss_that_is_not_finite_is_a_spike_at_any_step():
    d = _detector(warmup=100)
    for bad in (math.nan, math.inf, -math.inf):
        spike = d.observe(1, bad)
        assert spike is not None and not math.isfinite(spike.loss) and math.isnan(spike.median)
    assert d.observe(1, 50.0) is None  # a finite loss in the warmup is not
    assert "not finite" in _detector().observe(7, math.nan).describe(3.0)


def test_a_window_whose_median_is_not_positive_flags_no_finite_loss():
    d = _detector(warmup=0)
    for k in range(1, 4):
        assert d.observe(k, -2.0) is None
    assert d.observe(4, 1e9) is None  # a ratio to a negative median says nothing
    assert d.observe(5, math.nan) is not None


# -- the option -----------------------------------------------------------------------------------
def test_the_option_is_off_unless_given_and_stored_whole_when_given():
    off = JobSpec.from_dict({"dataset": "mnist"})
    assert off.spike == {} and "spike" not in off.to_dict()
    # off stays off through the router's store and the task a trainer gets (both are to_dict / from_dict)
    assert JobSpec.from_dict(off.to_dict()).spike == {}
    on = JobSpec.from_dict({"dataset": "mnist", "spike": {}}).spike
    assert on == {"factor": 3.0, "window": 50, "warmup": 20, "skip_before": 2, "max_skips": 3}
    again = JobSpec.from_dict({"dataset": "mnist", "spike": {"factor": 8, "max_skips": 0}})
    assert again.spike["factor"] == 8.0 and again.spike["max_skips"] == 0 and again.spike["window"] == 50
    assert JobSpec.from_dict(again.to_dict()).spike == again.spike


@pytest.mark.parametrize(
    ("spike", "says"),
    [
        ({"factor": 1}, "spike.factor must be above 1"),
        ({"factor": 0.5}, r"spike.factor must be a number in \[1, 1e\+06\]"),
        ({"factor": "3"}, "spike.factor must be a number"),
        ({"factor": math.inf}, "spike.factor must be a number"),
        ({"window": 0}, r"spike.window must be an integer in \[1, 10000\]"),
        ({"window": 2.5}, "spike.window must be an integer"),
        ({"warmup": -1}, "spike.warmup must be an integer"),
        ({"skip_before": 5000}, r"spike.skip_before must be an integer in \[0, 1000\]"),
        ({"max_skips": True}, "spike.max_skips must be an integer"),
        ({"max_skips": 101}, r"spike.max_skips must be an integer in \[0, 100\]"),
        ({"threshold": 0.25}, "unknown spike key"),
        (True, "job field 'spike' must be dict"),
    ],
)
def test_bad_spike_values_are_refused_by_the_router_naming_the_key(router, client_for, spike, says):
    admin = client_for(router.endpoint, role="admin")
    with pytest.raises(BadRequest, match=says):
        admin.request(SubmitJob(spec={**SPEC, "spike": spike}))


def test_a_trainer_may_skip_only_a_spike_of_a_job_it_holds(router, client_for):
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={**SPEC, "spike": {}})).job
    trainer = client_for(router.endpoint, role="trainer")
    with pytest.raises(Forbidden, match="only a loss spike's stretch"):
        trainer.request(SkipJob(job=job, steps=[[1, 3]]))
    with pytest.raises(Forbidden, match="is not running on"):
        trainer.request(SkipJob(job=job, steps=[[1, 3]], spike={"step": 2, "loss": "nan", "median": 1.0, "window": 1}))
    assert admin.request(GetJob(job=job)).job["spec"]["spikes"] == []


def test_a_trainer_holding_the_job_skips_no_more_than_the_spike_option_allows(router, provider, client_for, make_token):
    """A trainer token is not an admin: what it may skip is bounded by the router, not by the trainer's code."""
    admin = client_for(router.endpoint, role="admin")
    spike = {"step": 4, "loss": "nan", "median": 1.0, "window": 3}
    rule = {"factor": 3.0, "window": 3, "warmup": 0, "skip_before": 2, "max_skips": 1}
    plain = admin.request(SubmitJob(spec=SPEC)).job
    holder = client_for(router.endpoint, role="trainer", token=make_token("trainer", sub="holder-a"))
    assert holder.request(GetTask(key="k1")).job == plain
    with pytest.raises(Forbidden, match="no spike option"):
        holder.request(SkipJob(job=plain, steps=[[2, 5]], spike=spike))
    job = admin.request(SubmitJob(spec={**SPEC, "spike": rule})).job
    trainer = client_for(router.endpoint, role="trainer", token=make_token("trainer", sub="holder-b"))
    assert trainer.request(GetTask(key="k2")).job == job
    for steps, samples in (([[1, 5]], []), ([[2, 3], [4, 5]], []), ([[2, 5]], [[0, 8]])):
        with pytest.raises(BadRequest, match="one stretch of at most skip_before"):
            trainer.request(SkipJob(job=job, steps=steps, samples=samples, spike=spike))
    trainer.request(SkipJob(job=job, steps=[[2, 5]], spike=spike))
    assert len(admin.request(GetJob(job=job)).job["spec"]["spikes"]) == 1
    assert trainer.request(GetTask(key="k3")).job == job
    with pytest.raises(Forbidden, match="max_skips"):
        trainer.request(SkipJob(job=job, steps=[[6, 7]], spike={**spike, "step": 6}))


# -- real jobs ------------------------------------------------------------------------------------
def _dataset(directory: Path, bad_batches: tuple[int, ...]) -> None:
    """A learnable float dataset of ``N`` train samples (784 features in [0, 1], a pattern per class
    plus noise, all distinct) whose samples of ``bad_batches`` (in file order) are scaled by 1e5."""
    rng = np.random.default_rng(0)
    patterns = rng.random((10, 784), dtype=np.float32)
    for split, n in (("train", N), ("val", 64)):
        y = rng.integers(0, 10, n).astype(np.int64)
        x = (0.5 * patterns[y] + 0.5 * rng.random((n, 784), dtype=np.float32)).astype(np.float32)
        if split == "train":
            for b in bad_batches:
                x[b * BATCH : (b + 1) * BATCH] *= 1e5
        np.save(directory / f"{split}_x.npy", x)
        np.save(directory / f"{split}_y.npy", y)


#: The datasets of the real jobs, by the batches (of 16, in file order) whose samples are x 1e5.
BAD = {"spike12": (12,), "spike12_20": (12, 20), "spike22": (22,)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One router, one provider of every :data:`BAD` dataset and two trainers (t1, t2) for the real jobs: they
    stop nothing and kill nothing, so one cluster serves them all; its trainers allow the tests' entrypoints."""
    root = tmp_path_factory.mktemp("spike")
    flags = []
    for name, bad_batches in BAD.items():
        (root / name).mkdir()
        _dataset(root / name, bad_batches)
        flags += ["--dataset", f"{name}=file://{root / name}"]
    cluster = EntryCluster(root / "bus")
    try:
        cluster.start_router()
        cluster.start("provider", "provider", "--bind", "tcp://127.0.0.1:0", *flags, ready=True)
        cluster.endpoint_of("provider")
        cluster.start_trainer("t1")
        cluster.start_trainer("t2")
        yield cluster
    finally:
        cluster.close()


#: Sequential order, a checkpoint every 5 steps; a spike is a loss 10 x the median of the last 10.
SPIKY = {
    **SPEC,
    "shuffle": "none",
    "epochs": 2,
    "checkpoint_every": 5,
    "spike": {"factor": 10.0, "window": 10, "warmup": 5, "skip_before": 2, "max_skips": 3},
}


def _events(info: dict) -> str:
    return "\n".join(str(e) for e in info["events"])


def test_a_spike_is_skipped_by_itself_and_the_job_trains_on_without_its_stretch(cluster):
    # spike12: step 13 is samples 192..207
    by_digest = cluster.index_of_digest("spike12")
    job = cluster.submit_spec({**SPIKY, "dataset": "spike12"})
    info = cluster.wait_end(job, timeout=60)
    assert info["state"] == "succeeded", f"{info['error']}\n{_events(info)}\n{cluster.logs()}"
    # steps 11..13 (skip_before 2): samples 160..207, skipped from the checkpoint of step 10 on
    [spike] = info["spec"]["spikes"]
    assert spike["step"] == 13 and spike["steps"] == [11, 14] and spike["loss"] > 10 * spike["median"]
    assert info["spec"]["skip"] == [[[160, 208]]]
    events = _events(info)
    assert "spike: step 13 loss" in events and "(1 of at most 3 spikes skipped)" in events, events
    assert "rewinds to the checkpoint of step 10" in events, events
    stretch = set(range(160, 208))
    epochs = effective_epochs(cluster.audit, job)
    assert sorted(epochs) == [0, 1]
    for e, digests in epochs.items():  # every other sample of each epoch once, none of the stretch
        seen = Counter(by_digest[d] for d in digests)
        want = Counter(set(range(N)) - stretch)
        assert seen == want, (
            f"epoch {e}: {sorted((seen - want).elements())[:10]} extra, {sorted((want - seen).elements())[:10]} missing"
        )
    shown = cluster.busctl("job", "show", job).stdout
    assert "spike: step 13" in shown, shown
    logs = cluster.busctl("job", "logs", job, "--attempt", "0").stdout
    assert "spike: step 13: loss" in logs and "asking the router to skip steps 11:14" in logs, logs


def test_a_spike_past_max_skips_fails_the_job_saying_so(cluster):
    # step 13 (192..207) is skipped with steps 11..13; then 320..335 is at step 18 of the order without them
    spike = {**SPIKY["spike"], "max_skips": 1}
    job = cluster.submit_spec({**SPIKY, "dataset": "spike12_20", "epochs": 1, "spike": spike})
    info = cluster.wait_end(job, timeout=60)
    assert info["state"] == "failed", f"{info['state']}\n{_events(info)}"
    assert "TooManySpikes: loss spike at step 18" in info["error"], info["error"]
    assert "spike.max_skips = 1" in info["error"] and f"busctl job skip {job} --steps 16:19" in info["error"]
    assert [s["step"] for s in info["spec"]["spikes"]] == [13]
    assert "spike: step 13" in _events(info)


def test_an_entrypoint_job_s_spike_is_skipped_at_its_step_call(cluster):
    spec = {
        **{k: v for k, v in SPIKY.items() if k not in ("model", "model_kwargs", "optimizer", "lr")},
        "dataset": "spike12",
        "entrypoint": "tests.support.entrypoints:custom_loss",
        "params": {"lr": 0.05, "epochs": 1},
    }
    job = cluster.submit_spec(spec)
    info = cluster.wait_end(job, timeout=60)
    assert info["state"] == "succeeded", f"{info['error']}\n{_events(info)}\n{cluster.logs()}"
    [spike] = info["spec"]["spikes"]
    assert spike["step"] == 13 and info["spec"]["skip"] == [[[160, 208]]]
    assert "spike: step 13" in _events(info)
    logs = cluster.busctl("job", "logs", job, "--attempt", "0").stdout
    assert "spike: step 13" in logs, logs


def test_a_gang_judges_the_largest_loss_of_its_ranks_and_skips_a_stretch_of_rank_1_s_shard(cluster):
    # two ranks, shards 0..239 and 240..479 in file order: rank 1's step 8 reads 352..367 (spike22)
    cluster.wait_connected(("t1", "t2"))
    by_digest = cluster.index_of_digest("spike22")
    job = cluster.submit_spec({**SPIKY, "dataset": "spike22", "world_size": 2})
    info = cluster.wait_end(job, timeout=90)
    assert info["state"] == "succeeded", f"{info['error']}\n{_events(info)}\n{cluster.logs()}"
    [spike] = info["spec"]["spikes"]
    assert spike["step"] == 8 and spike["steps"] == [6, 9], spike
    # steps 6..8 of both ranks, from the checkpoint of step 5
    stretch = set(range(80, 128)) | set(range(320, 368))
    assert info["spec"]["skip"] == [[[80, 128], [320, 368]]]
    assert "rewinds to the checkpoint of step 5" in _events(info)
    for e, digests in effective_epochs(cluster.audit, job).items():
        seen = Counter(by_digest[d] for d in digests)
        want = Counter(set(range(N)) - stretch)
        assert seen == want, (
            f"epoch {e}: {sorted((seen - want).elements())[:10]} extra, {sorted((want - seen).elements())[:10]} missing"
        )

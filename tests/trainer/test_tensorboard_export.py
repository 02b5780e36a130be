"""A job's metrics where people already look: TensorBoard event files, written live by the trainer's
attempts (``tensorboard_dir``) and after the fact by ``busctl job metrics JOB --tensorboard DIR`` from
what the router keeps; read back with TensorBoard's own reader (``EventAccumulator``). Against a real
router, provider and trainer processes; busctl as a user runs it."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from libbus.jobs.tensorboard_events import EVENT_FILE_PREFIX, run_dir
from libbus.wire.messages import GetJob
from tests.support.jobs import EntryCluster

KNOWN = "tests.support.entrypoints:known_losses"


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of a run folder as TensorBoard reads it: (step, value) pairs in file order."""
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def event_files(run: Path) -> list[Path]:
    return sorted(p for p in run.iterdir() if p.name.startswith(EVENT_FILE_PREFIX)) if run.is_dir() else []


@pytest.fixture
def cluster(tmp_path):
    cluster = EntryCluster(tmp_path / "state")
    cluster.env["BATCHBUS_TENSORBOARD_DIR"] = str(tmp_path / "live")
    try:
        cluster.start_router()
        cluster.start_provider()
        cluster.endpoint_of("provider")
        cluster.start_trainer("trainer-tb")
        yield cluster
    finally:
        cluster.close()


@pytest.mark.timeout(300)
def test_a_jobs_losses_reach_tensorboard_live_and_after_the_fact(cluster, tmp_path):
    job = cluster.submit_spec({"dataset": "mnist", "entrypoint": KNOWN, "max_attempts": 1})
    info = cluster.wait_end(job, timeout=180)
    assert info["state"] == "succeeded", f"{info.get('error')}\n{cluster.logs()}"
    steps = info["result"]["step"]
    assert steps >= 4, info["result"]

    # live: the attempt wrote every step's loss at its step, and each epoch's record at its number
    live = scalars(tmp_path / "live" / job)
    assert [s for s, _ in live["train/loss"]] == list(range(1, steps + 1))
    for step, value in live["train/loss"]:
        assert math.isclose(value, 1.0 / step, rel_tol=1e-6), (step, value)
    assert [(s, round(v, 6)) for s, v in live["epoch/val_loss"]] == [(1, 0.5), (2, 0.25)]
    assert live["progress/loss"] and all(0 < s <= steps for s, _ in live["progress/loss"])
    parts = set((info["result"].get("data_wait_split") or {}).get("parts") or {})
    assert {t.removeprefix("data_wait/") for t in live if t.startswith("data_wait/")} == parts

    # after the fact: what the router keeps, each progress report's running loss at its step
    out = tmp_path / "exported"
    done = cluster.busctl("job", "metrics", job, "--tensorboard", str(out))
    assert "val loss 0.2500" in done.stdout and f"TensorBoard events: {out / job}" in done.stdout, done.stdout
    kept = cluster.admin.request(GetJob(job=job, progress=1000, events=0)).job["progress_history"]
    expected = [(p["step"], p["loss"]) for p in kept if isinstance(p.get("loss"), (int, float))]
    assert len(expected) >= 3, kept
    exported = scalars(out / job)
    assert [s for s, _ in exported["progress/loss"]] == [s for s, _ in expected]
    for (_, got), (_, want) in zip(exported["progress/loss"], expected):
        assert math.isclose(got, want, rel_tol=1e-6)
    assert [(s, round(v, 6)) for s, v in exported["epoch/val_loss"]] == [(1, 0.5), (2, 0.25)]
    assert "train/loss" not in exported  # the router keeps no per-step figures: none are made up

    # a second export into the same folder would show every point twice: refused, nothing written
    again = cluster.busctl("job", "metrics", job, "--tensorboard", str(out), check=False)
    assert again.returncode == 2 and "already holds event files" in again.stderr, again.stderr
    assert "Traceback" not in again.stderr and len(event_files(out / job)) == 1
    unknown = cluster.busctl("job", "metrics", "j0000000000", "--tensorboard", str(out), check=False)
    assert unknown.returncode != 0 and "Traceback" not in unknown.stderr + unknown.stdout, unknown.stderr

    # the trainer service wrote nothing itself: it still holds no torch (its attempts write the events)
    maps = Path(f"/proc/{cluster.procs['trainer-tb'].pid}/maps").read_text()
    assert "libtorch" not in maps


@pytest.mark.timeout(300)
def test_events_are_on_disk_while_the_job_runs(cluster, tmp_path):
    spec = {"dataset": "mnist", "entrypoint": "tests.support.entrypoints:counter", "max_attempts": 1}
    job = cluster.submit_spec({**spec, "params": {"steps": 1_000_000, "delta": 0.5}})
    cluster.wait(job, lambda i: (i.get("progress") or {}).get("step", 0) >= 20, timeout=180)
    run = tmp_path / "live" / job
    points: list = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # flushed at each progress report; a record may be half written
        points = scalars(run).get("train/loss", []) if event_files(run) else []
        if len(points) >= 10:
            break
        time.sleep(0.1)
    assert len(points) >= 10 and all(v == 0.5 for _, v in points), points
    assert cluster.job(job)["state"] == "running"
    cluster.control(job, "stop")
    assert cluster.wait_end(job, timeout=120)["state"] == "stopped"


@pytest.mark.timeout(300)
def test_an_unwritable_tensorboard_dir_costs_the_job_nothing(tmp_path):
    """A careless operator's tensorboard_dir (a file): the job trains all the same, the trainer says why
    there are no events."""
    cluster = EntryCluster(tmp_path / "state")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    cluster.env["BATCHBUS_TENSORBOARD_DIR"] = str(blocker)
    try:
        cluster.start_router()
        cluster.start_provider()
        cluster.endpoint_of("provider")
        cluster.start_trainer("trainer-tb")
        job = cluster.submit_spec({"dataset": "mnist", "entrypoint": KNOWN, "max_attempts": 1})
        info = cluster.wait_end(job, timeout=180)
        assert info["state"] == "succeeded", info.get("error")
        log = (cluster.state / "trainer-tb.log").read_text()
        assert f"job {job}: no TensorBoard events under tensorboard_dir {blocker}" in log, log[-3000:]
    finally:
        cluster.close()


def test_run_folders_name_jobs_and_trials_and_nothing_else(tmp_path):
    """One run folder per job, a study's trial under its study; a job's name never reaches the path
    unless it is a trial's name exactly (a name such as ../../x is a job's run folder)."""
    assert run_dir(tmp_path, "j0123456789") == tmp_path / "j0123456789"
    assert run_dir(tmp_path, "j0123456789", "s0123abcd/7") == tmp_path / "s0123abcd" / "trial-7"
    for name in ("../../etc", "s0123abcd/../../x", "/abs", "s0123abcd/7/..", "mine"):
        assert run_dir(tmp_path, "j0123456789", name) == tmp_path / "j0123456789", name
    for bad in ("../j0123456789", "j01234567", ""):
        with pytest.raises(ValueError):
            run_dir(tmp_path, bad)

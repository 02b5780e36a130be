"""Bounded storage: the router's events, checkpoint records and progress history are retained to
per-job limits (the result, model hash and last checkpoint always kept), job lists and job events come in
pages, and a trainer's checkpoint files stay bounded while the router is away. Real SQLite files."""

from __future__ import annotations

import torch

from libbus.jobs.spec import JobSpec
from libbus.wire.messages import GetJob, ListJobs, SubmitJob
from services.router import store as store_module
from services.router.store import JobStore
from services.trainer.attempt.checkpoint import KEEP, prune, save_state


def _record(step: int) -> dict:
    return {"path": f"/ckpt/step-{step}.safetensors", "sha256": "0" * 64, "step": step, "epoch": 0, "cursor": {}}


def test_events_checkpoints_and_progress_are_retained_to_limits(tmp_path):
    store = JobStore(str(tmp_path / "router.db"))
    job = store.submit(JobSpec.from_dict({"dataset": "mnist"}))
    store.claim("t1", 10)
    for i in range(3000):
        store.event(job, f"command {i}")
    for step in range(1, 301):
        store.add_checkpoint(job, "t1", _record(step))
    for i in range(1200):
        store.set_progress(job, {"step": i}, 10)
    count = lambda table: store.db.execute(f"SELECT COUNT(*) FROM {table} WHERE job = ?", (job,)).fetchone()[0]  # noqa: E731
    limit = store_module.EVENTS_KEPT_FIRST + store_module.EVENTS_KEPT + store_module.EVENTS_KEPT // 10 + 1
    assert count("events") <= limit
    assert count("checkpoints") == store_module.CHECKPOINTS_KEPT
    assert count("progress") == store_module.PROGRESS_KEPT
    info = store.get(job, limit=10000)
    assert info["events"][0]["reason"] == "submitted" and info["events"][-1]["reason"] == "command 2999"
    assert info["checkpoint"]["step"] == 300
    store.finish(job, "succeeded", "finished on t1", result={"model": {"sha256": "ab" * 32}})
    assert count("checkpoints") == store_module.CHECKPOINTS_KEPT
    info = store.get(job)
    assert info["checkpoints"][-1]["step"] == 300 == info["checkpoint"]["step"]
    assert info["result"]["model"]["sha256"] == "ab" * 32


def test_job_events_come_in_pages(tmp_path):
    store = JobStore(str(tmp_path / "router.db"))
    job = store.submit(JobSpec.from_dict({"dataset": "mnist"}))
    for i in range(30):
        store.event(job, f"e{i}")
    page = store.get(job, limit=10)
    assert [e["reason"] for e in page["events"]] == [f"e{i}" for i in range(20, 30)]
    assert page["events_total"] == 31
    older = store.get(job, limit=10, offset=10)
    assert [e["reason"] for e in older["events"]] == [f"e{i}" for i in range(10, 20)]


def test_busctl_jobs_pages_through_the_router(router, client_for):
    admin = client_for(router.endpoint, role="admin")
    jobs = [admin.request(SubmitJob(spec={"dataset": "mnist", "name": f"n{i}"})).job for i in range(7)]
    first = [j["id"] for j in admin.request(ListJobs(limit=3)).jobs]
    second = [j["id"] for j in admin.request(ListJobs(limit=3, offset=3)).jobs]
    rest = [j["id"] for j in admin.request(ListJobs(limit=3, offset=6)).jobs]
    assert first + second + rest == jobs[::-1]
    info = admin.request(GetJob(job=jobs[0], events=1)).job
    assert len(info["events"]) == 1 and info["events_total"] == 1


def test_checkpoint_files_stay_bounded_while_the_router_is_away(tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 21):  # the router heard of step 3 only; the rest wait for it
        save_state(tmp_path, step=step, epoch=0, state={"model": model, "optimizer": optimizer}, cursors={}, extra={})
        prune(tmp_path, {3})
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert names == ["step-000000003.safetensors", "step-000000019.safetensors", "step-000000020.safetensors"]
    assert len(names) == KEEP + 1

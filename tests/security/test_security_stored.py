"""What peers store is bounded, admin replies always arrive, sessions do not pile up. Real router, real sockets, real busctl processes."""

from __future__ import annotations

import io
import json
import subprocess
import time

import pytest
from rich.console import Console

from cli.top import render
from libbus.connect.client import Client, Identity
from libbus.errors import BadRequest, RateLimited
from libbus.wire.messages import GetJob, GetTask, Heartbeat, ListJobs, Progress, PushResult, Stats, SubmitJob
from services import views
from tests.support.busctl import busctl


def nested(depth: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(depth):
        value = {"n": value}
    return value


def admin_busctl(router, state_dir, *args: str) -> subprocess.CompletedProcess:
    return busctl(*args, env={"BATCHBUS_STATE_DIR": str(state_dir), "BATCHBUS_ROUTER": router.endpoint})


def test_deeply_nested_stats_do_not_break_the_admin_tools(router, client_for, make_token, state_dir):
    peer = client_for(router.endpoint, role="trainer", token=make_token("trainer", sub="noisy"))
    peer.identity.caps = {"heartbeat": True}
    peer.hello()
    peer.send(Heartbeat(stats=nested(25)))  # within the wire's 32 levels, not within what is stored
    deadline = time.monotonic() + 5
    admin = client_for(router.endpoint, role="admin")
    while "refused" not in admin.request(Stats()).services.get("noisy", {}):  # rows keyed by token subject
        assert time.monotonic() < deadline, "heartbeat never arrived"
        time.sleep(0.05)
    services = admin.request(Stats()).services
    assert "nests deeper than" in services["noisy"]["refused"]
    out = admin_busctl(router, state_dir, "queues", "--json")  # what failed for everyone before
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert json.loads(out.stdout)


def test_a_nested_or_huge_result_is_refused_at_the_door(router, client_for, make_token, state_dir):
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={"dataset": "mnist"})).job
    t = client_for(router.endpoint, role="trainer")
    assert t.request(GetTask()).job == job
    with pytest.raises(BadRequest, match="PushResult.result nests deeper"):
        t.request(PushResult(job=job, state="succeeded", result=nested(25)))
    with pytest.raises(BadRequest, match="Progress.progress nests deeper"):
        t.request(Progress(job=job, progress=nested(25)))
    with pytest.raises(Exception, match="at most 262144 are stored"):
        t.request(PushResult(job=job, state="succeeded", result={"blob": "x" * 300_000}))
    assert admin.request(GetJob(job=job)).job["state"] == "running"
    out = admin_busctl(router, state_dir, "jobs", "--json")
    assert out.returncode == 0 and job in [j["id"] for j in json.loads(out.stdout)], out.stderr


def test_admin_replies_over_the_client_limit_are_cut_with_a_note(router, client_for, make_token, state_dir):
    admin = client_for(router.endpoint, role="admin")
    blob = "x" * 200_000
    jobs = []
    for i in range(6):  # six results of 200 kB: each within bounds, together over one reply's 1 MiB
        job = admin.request(SubmitJob(spec={"dataset": "mnist"})).job
        t = client_for(router.endpoint, role="trainer", token=make_token("trainer", sub=f"t{i}"))
        assert t.request(GetTask()).job == job
        for _ in range(6):
            t.request(Progress(job=job, progress={"step": 1, "blob": blob}))
        t.request(PushResult(job=job, state="succeeded", result={"blob": blob}))
        jobs.append(job)
    listed = admin.request(ListJobs())
    assert 0 < len(listed.jobs) < 6 and "left out to fit one reply" in listed.note
    info = admin.request(GetJob(job=jobs[0], progress=6))
    assert "cut to fit one reply" in info.note and len(info.job["progress_history"]) < 6
    out = admin_busctl(router, state_dir, "jobs")
    assert out.returncode == 0 and "note:" in out.stderr and "left out" in out.stderr, out.stderr


def test_a_thousand_sequential_clients_leave_no_sessions_behind(router, make_token, state_dir):
    server = router.service.server
    base = len(server.sessions)
    token = make_token("admin", sub="poller")
    for _ in range(1000):  # what a script polling `busctl job show` does, in-process
        with Client(router.endpoint, Identity(role="admin", name="poller", token=token), timeout_s=5) as c:
            c.request(ListJobs(limit=1))
    deadline = time.monotonic() + 5
    while len(server.sessions) > base and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(server.sessions) == base, f"{len(server.sessions) - base} sessions left behind"
    for _ in range(3):  # and the real command line, process by process
        assert admin_busctl(router, state_dir, "jobs").returncode == 0
    deadline = time.monotonic() + 5
    while len(server.sessions) > base and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(server.sessions) == base
    assert server.counters["sessions_opened"] - server.counters["sessions_closed"] == base


def test_sessions_per_subject_are_capped(router, make_token):
    cap = router.service.server.config.sessions_per_subject
    token = make_token("admin", sub="leaky")
    open_clients = []
    try:
        for _ in range(cap):  # a script that never closes its clients
            c = Client(router.endpoint, Identity(role="admin", name="leaky", token=token), timeout_s=5, retries=0)
            c.hello()
            open_clients.append(c)
        extra = Client(router.endpoint, Identity(role="admin", name="leaky", token=token), timeout_s=5, retries=0)
        open_clients.append(extra)
        with pytest.raises(RateLimited, match=f"'leaky' already has {cap} sessions open here"):
            extra.hello()
        other = Client(
            router.endpoint,
            Identity(role="admin", name="ok", token=make_token("admin", sub="other")),
            timeout_s=5,
            retries=0,
        )
        open_clients.append(other)
        assert other.hello().session  # other subjects are not affected
    finally:
        for c in open_clients:
            c.close()


def test_a_provider_whose_stats_were_refused_is_still_drawn_by_top(router, client_for, make_token):
    """A provider's refused heartbeat leaves in its row a string saying why, where its refusals by cause
    would be: busctl top's frame shows the provider (no refusals of its own counted) and draws."""
    peer = client_for(router.endpoint, role="provider", token=make_token("provider", sub="loud"))
    peer.identity.caps = {"heartbeat": True, "datasets": {}, "endpoint": "tcp://127.0.0.1:9"}
    peer.hello()
    peer.send(Heartbeat(stats=nested(25)))
    deadline = time.monotonic() + 5
    admin = client_for(router.endpoint, role="admin")
    while "refused" not in admin.request(Stats()).services.get("loud", {}):
        assert time.monotonic() < deadline, "heartbeat never arrived"
        time.sleep(0.05)
    taken = views.snapshot(admin)  # at once: a peer that beat once is dropped once it is silent too long
    shown = views.frame(taken, taken)
    (provider,) = [p for p in shown["providers"] if p["name"] == peer.identity.name]
    assert provider["refused"] == {} and provider["samples"] == 0
    console = Console(file=io.StringIO(), width=200)
    console.print(render(taken, taken))
    assert peer.identity.name in console.file.getvalue()

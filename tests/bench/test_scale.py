"""The router at scale (benchmarks/scale.py), small: simulated trainers and providers on the wire run
every job to its end; and what the scale work changed in the router, shown on a real socket."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from libbus.connect.client import Client, Identity
from libbus.errors import NotFound, Unavailable
from libbus.jobs.spec import JobSpec
from libbus.wire.messages import Entitlements, GetTask, Resolve, SubmitJob, Task
from services.router.early_stop import EarlyStopping
from services.router.store import JobStore
from tests.support.busctl import REPO


def scale(*args: str, timeout: float = 100) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.scale", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_scale_runs_every_job_through_simulated_trainers_and_providers(tmp_path):
    out = tmp_path / "scale.json"
    run = scale(
        *("--trainers", "12", "--providers", "3", "--jobs", "30", "--progress", "2", "--step-ms", "20"),
        *("--procs", "2", "--timeout", "60", "--jitter", "0.5", "--pin", "--json", str(out)),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["finished"] == 30 and r["job_states"] == {"succeeded": 30}
    assert r["trainers"] == 12 and r["providers"] == 3 and r["pinned"]
    lat = r["latency"]
    assert lat["PushResult"]["count"] == 30 and lat["Progress"]["count"] == 60
    assert lat["Resolve"]["count"] >= 12 and lat["GetTask"]["count"] >= 30
    assert not [k for k in r["counts"] if k.startswith("error")], r["counts"]
    assert r["counts"].get("push Entitlements", 0) >= 3  # every provider heard from the router
    assert r["router_cpu_s"] > 0 and r["router_rss_mib"] > 0 and r["db_mib"] > 0
    assert "GetTask" in run.stdout and "of a core" in run.stdout
    settled = r["latency_settled"]  # the same, for requests sent after the start (--settle-s)
    assert r["settle_s"] == 10 and set(settled) == set(lat)
    assert all(settled[k]["count"] <= lat[k]["count"] for k in lat)


def test_scale_refuses_an_empty_cluster():
    run = scale("--trainers", "0")
    assert run.returncode == 2 and "must be at least 1" in run.stderr and "Traceback" not in run.stderr
    run = scale("--jitter", "1.5")
    assert run.returncode == 2 and "--jitter is a fraction" in run.stderr and "Traceback" not in run.stderr


def provider(router, make_token, dataset: str) -> Client:
    caps = {"endpoint": "tcp://127.0.0.1:1", "datasets": {dataset: {"name": dataset}}}
    token = make_token("provider", sub=f"p-{dataset}")
    c = Client(router.endpoint, Identity(role="provider", name=f"p-{dataset}", token=token, caps=caps), timeout_s=3)
    c.hello()
    return c


def assignments(c: Client, seconds: float) -> list[dict]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        c.recv(0.05)
    return [m.assigned for m in c.pushes if isinstance(m, Entitlements)]


def test_a_provider_is_told_the_assignments_of_its_own_datasets_only(router, make_token, client_for):
    """A job taken on one dataset is news to that dataset's providers only (and each is sent its
    own datasets' lists, not every dataset's), so a thousand trainers taking jobs do not flood a
    hundred providers."""
    alpha, beta = provider(router, make_token, "alpha"), provider(router, make_token, "beta")
    try:
        admin = client_for(router.endpoint, role="admin", token=make_token("admin", sub="root"))
        admin.request(SubmitJob(spec={"dataset": "alpha", "model": "mlp", "epochs": 1}))
        trainer = client_for(router.endpoint, role="trainer", token=make_token("trainer", sub="t1"))
        assert isinstance(trainer.request(GetTask(key="1")), Task)
        assert {"alpha": ["t1"]} in assignments(alpha, 0.3)
        seen = assignments(beta, 0.6)  # a few periodic checks
        assert seen and all("alpha" not in a for a in seen), seen
        assert router.service.handler.entitlements().assigned == {"alpha": ["t1"]}  # the router's whole view
    finally:
        alpha.close()
        beta.close()


def test_the_router_raises_its_open_file_limit_within_the_hard_one():
    """A thousand trainers are a thousand open sockets: a soft limit of 1,024 would refuse the rest."""
    code = (
        "import resource; from services.router.app import raise_open_files\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "got = raise_open_files(100_000_000)\n"
        "assert got == resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 256, got\n"
        "assert got <= hard or hard == resource.RLIM_INFINITY\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 300))\n"
        "assert raise_open_files() == 300  # never past the hard limit: that is the operator's\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]


def test_fairness_bench_serves_every_loader_of_one_provider(tmp_path):
    out = tmp_path / "fair.json"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.fairness", "--loaders", "3", "--samples", "1024", "--seconds", "2"]
        + ["--warmup", "0.5", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["loaders"] == 3 and len(r["rates"]) == 3 and all(rate > 0 for rate in r["rates"])
    assert abs(r["total_samples_per_s"] - sum(r["rates"])) < 1e-6 and 0 < r["slowest_over_fastest"] <= 1
    assert "samples/s in all" in run.stdout


def test_resolve_names_the_providers_serving_now_as_they_come_and_go(router, make_token):
    """Resolve reads the router's index of providers by dataset: a provider that leaves is no longer named."""
    names = ("pa", "pb")
    providers = [
        Client(
            router.endpoint,
            Identity(
                role="provider",
                name=n,
                token=make_token("provider", sub=n),
                caps={"endpoint": f"tcp://127.0.0.1:{port}", "datasets": {"alpha": {"name": "alpha"}}},
            ),
        )
        for port, n in enumerate(names, 1)
    ]
    admin = Client(router.endpoint, Identity(role="admin", name="a", token=make_token("admin", sub="a")))
    try:
        for p in providers:
            p.hello()
        assert sorted(p["name"] for p in admin.request(Resolve(dataset="alpha")).providers) == ["pa", "pb"]
        providers[0].close()  # says Goodbye
        deadline = time.monotonic() + 5
        while [p["name"] for p in admin.request(Resolve(dataset="alpha")).providers] != ["pb"]:
            assert time.monotonic() < deadline, "a provider that left is still named"
            time.sleep(0.05)
        providers[1].close()
        deadline = time.monotonic() + 5
        while True:
            try:
                admin.request(Resolve(dataset="alpha"))
            except NotFound as err:
                assert "no providers" in str(err)
                break
            assert time.monotonic() < deadline, "a dataset nobody serves still resolves"
            time.sleep(0.05)
    finally:
        for p in providers:
            p.close()
        admin.close()


def test_early_stopping_decides_at_the_epoch_report_and_again_when_the_stop_could_not_be_sent(tmp_path):
    store = JobStore(str(tmp_path / "router.db"))
    patient = store.submit(JobSpec.from_dict({"dataset": "d", "model": "mlp", "patience": 2}))
    plain = store.submit(JobSpec.from_dict({"dataset": "d", "model": "mlp"}))
    store.claim("t1", 10.0)
    store.claim("t2", 10.0)
    stalled = [{"epoch": e, "val_loss": 1.0} for e in range(1, 6)]
    sent, away, stopping_now = [], [True], set()

    def control(by, job, command, args):
        if away[0]:
            raise Unavailable("trainer t1 is not connected now")
        sent.append((by, job, command))
        stopping_now.add(job)

    stopping = EarlyStopping(store, control, stopping_now)
    stopping.on_report(plain, stalled)  # no patience: never stopped
    stopping.on_report(patient, stalled[:2])  # epoch 2: one epoch without improvement, patience left
    assert sent == []
    # epochs 3 and 4 in one report (one was lost while the router was away): epoch 3 decides, but
    # its trainer is away and the stop is not sent
    stopping.on_report(patient, stalled[:4])
    assert sent == []
    away[0] = False
    stopping.on_report(patient, stalled[:4])  # the next report (within epoch 5): decided again, sent
    assert sent == [("early stopping", patient, "stop")]
    stopping.on_report(patient, stalled)
    assert len(sent) == 1  # decided once while its stop is under way
    events = [e["reason"] for e in store.get(patient)["events"]]
    assert [r for r in events if r.startswith("early stopping")] == [
        "early stopping on val_loss at epoch 3: no improvement by more than 0 for 2 epoch(s) (patience 2); "
        "best 1.0000 at epoch 1"
    ]
    # a job resumed after its stop is judged on its whole history again, by its first report
    stopping_now.clear()
    stopping.on_report(patient, stalled)
    assert sent == [("early stopping", patient, "stop")] * 2
    # the cache of ended jobs is dropped through the index of held jobs with patience
    assert store.held_watched().keys() == {patient}
    plan = store.db.execute(
        "EXPLAIN QUERY PLAN SELECT id FROM jobs WHERE state IN (?, ?) AND trainer IS NOT NULL"
        " AND json_extract(spec, '$.patience') > 0",
        ("running", "paused"),
    ).fetchall()
    assert "jobs_watched" in str([tuple(row) for row in plan])


def test_router_messages_bench_times_each_message_of_the_job_path(tmp_path):
    out = tmp_path / "router_messages.json"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.router_messages", "--trainers", "20", "--providers", "10"]
        + ["--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    us = json.loads(out.read_text())["us"]
    counts = {kind: v["count"] for kind, v in us.items()}
    assert counts == {"Resolve": 20, "GetTask": 40, "Progress": 120, "PushResult": 40, "turn: timers + flush": 2}
    assert all(v["mean"] > 0 for v in us.values()) and "GetTask" in run.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "benchmarks.router_messages", "--providers", "3"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "one per dataset" in bad.stderr and "Traceback" not in bad.stderr

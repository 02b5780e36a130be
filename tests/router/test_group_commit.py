"""Group commit (services/router/store_db.py, libbus/serve/server.py ``_release``): the router acknowledges a
transition only once it is on disk, with one fsync for all the transitions of a loop turn.

A real router process killed with SIGKILL right after its replies still has every claim and result
it acknowledged; a server holds a turn's replies until its handler's ``flush`` returns, and answers
UNAVAILABLE when the flush fails; a grouped store fsyncs its WAL for transitions, not for progress.
"""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from libbus.connect.client import Client, Identity
from libbus.errors import NotFound, Unavailable
from libbus.jobs.spec import JobSpec
from libbus.security.auth import ensure_secret, issue_token
from libbus.serve.handler import Handler, ServerConfig
from libbus.serve.server import Server
from libbus.wire.messages import GetTask, Ok, PushResult, Stats, SubmitJob, Task
from services.router.store import JobStore
from tests.support import Cluster

TRAINERS = 6


def _trainer(cluster: Cluster, name: str, acked: list, stop: threading.Event) -> None:
    """Claim and finish jobs until ``stop``, noting each acknowledged claim and result."""
    token = issue_token(ensure_secret(cluster.state / "secret"), sub=name, role="trainer", audience="batchbus")
    with Client(cluster.endpoint, Identity(role="trainer", name=name, token=token), timeout_s=2, retries=0) as c:
        while not stop.is_set():
            try:
                task = c.request(GetTask(key=f"{name}-{time.monotonic()}"))
            except Exception:  # noqa: BLE001 - the router was killed: this trainer is done
                return
            if not isinstance(task, Task):
                continue
            acked.append(("claim", task.job, name))
            try:
                c.request(PushResult(job=task.job, state="succeeded", result={"val_accuracy": 1.0}))
            except Exception:  # noqa: BLE001
                return
            acked.append(("result", task.job, name))


def test_a_router_killed_right_after_its_replies_has_every_acknowledged_claim_and_result(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        cluster.start_router()
        admin = cluster.admin
        for i in range(200):
            admin.request(SubmitJob(spec={"dataset": f"d{i % 3}", "model": "mlp", "epochs": 1}))
        acked: list[tuple[str, str, str]] = []
        stop = threading.Event()
        with ThreadPoolExecutor(TRAINERS) as pool:
            for i in range(TRAINERS):
                pool.submit(_trainer, cluster, f"t{i}", acked, stop)
            deadline = time.monotonic() + 30
            while len(acked) < 60:  # several trainers claiming and finishing in the same turns
                assert time.monotonic() < deadline, cluster.logs()
                time.sleep(0.005)
            cluster.procs["router"].send_signal(signal.SIGKILL)  # right after its latest replies
            stop.set()
        cluster.procs["router"].wait(10)
        seen = list(acked)  # every reply that got out before the kill
    finally:
        cluster.close()
    db = sqlite3.connect(tmp_path / "router.db")
    rows = {job: (state, trainer) for job, state, trainer in db.execute("SELECT id, state, trainer FROM jobs")}
    finished = {job for kind, job, _ in seen if kind == "result"}
    assert finished and all(rows[job][0] == "succeeded" for job in finished)
    for kind, job, trainer in seen:
        if kind == "claim" and job not in finished:  # claimed, result not acknowledged: still its
            assert rows[job][0] in ("running", "succeeded") and rows[job][1] == trainer, (job, rows[job])
    assert db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 200


class _Gated(Handler):
    """Answers Stats with Ok; the flush of a turn that handled one waits for ``gate`` (or fails when
    ``fail`` is set). The server also flushes its idle turns (every poll period): those never wait, or
    one that began between the test's ``gate.clear()`` and its request would hold the loop."""

    roles = {"Stats": ("trainer",)}
    group_commit = True

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.flushing = threading.Event()
        self.fail = False
        self.handled = False

    def handle(self, session, msg):
        self.handled = True
        return Ok()

    def flush(self) -> None:
        handled, self.handled = self.handled, False
        if not handled:
            return
        if self.fail:
            raise OSError(5, "Input/output error")
        if not self.gate.is_set():
            self.flushing.set()
            self.gate.wait(10)


@pytest.fixture
def gated(secret, make_token):
    handler = _Gated()
    server = Server(handler, ServerConfig(bind="tcp://127.0.0.1:0", secret=secret, audience="batchbus", name="gated"))
    endpoint = server.bind()
    stop = threading.Event()
    thread = threading.Thread(target=server.run, args=(stop,), daemon=True)
    thread.start()
    client = Client(endpoint, Identity(role="trainer", name="t", token=make_token()), timeout_s=5, retries=0)
    try:
        client.hello()
        yield handler, client
    finally:
        handler.gate.set()
        client.close()
        stop.set()
        thread.join(10)


def test_replies_wait_for_the_handlers_flush(gated):
    handler, client = gated
    handler.gate.clear()
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(client.request, Stats())
        assert handler.flushing.wait(5)  # the request was handled; its turn is flushing
        time.sleep(0.3)
        assert not asked.done(), "the reply went out before the flush made it durable"
        handler.gate.set()
        assert isinstance(asked.result(5), Ok)


def test_a_service_without_group_commit_answers_at_once(gated):
    """A provider's batches are not held for a flush it has nothing to do in."""
    handler, client = gated
    handler.group_commit = False
    handler.gate.clear()
    assert isinstance(client.request(Stats()), Ok)  # answered though its turn's flush still waits


def test_a_failed_flush_acknowledges_nothing(gated):
    handler, client = gated
    handler.fail = True
    with pytest.raises(Unavailable, match="could not store this request's effect.*send it again"):
        client.request(Stats())
    handler.fail = False
    assert isinstance(client.request(Stats()), Ok)  # the server goes on


def test_a_grouped_store_fsyncs_for_transitions_and_not_for_progress(tmp_path):
    store = JobStore(str(tmp_path / "router.db"))
    store.durability.group()
    syncs = store.durability.syncs
    other = sqlite3.connect(tmp_path / "router.db")
    job = store.submit(JobSpec.from_dict({"dataset": "d", "model": "mlp"}))
    assert store.claim("t1", 10.0)["state"] == "running"  # the turn reads its own writes
    assert store.durability.pending and other.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0
    with pytest.raises(NotFound):  # a refused write undoes itself only, not the turn's others
        store.set_state("jnothere", "paused", "no such job")
    store.durability.sync()  # the turn's end: one transaction, one fsync
    assert store.durability.syncs == syncs + 1 and not store.durability.pending
    assert other.execute("SELECT state, trainer FROM jobs").fetchone() == ("running", "t1")
    store.set_progress(job, {"step": 1}, 10.0)
    store.renew_many([job], 10.0)
    assert not store.durability.pending  # progress and renewals need no fsync of their own
    store.finish(job, "succeeded", "done")
    store.set_progress(job, {"step": 2}, 10.0)
    assert store.durability.pending  # a progress report does not hide a transition's pending sync
    store.close()  # syncs what is pending
    assert store.durability.syncs == syncs + 2
    assert sqlite3.connect(tmp_path / "router.db").execute("SELECT state FROM jobs").fetchone()[0] == "succeeded"


def test_the_router_answers_a_claim_only_once_its_turn_is_on_disk(router, client_for):
    """The router's turn syncs (a slow disk, held here by a gate) before its Task reply leaves."""
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={"dataset": "mnist"})).job
    durability = router.service.store.durability
    gate, syncing, real_sync = threading.Event(), threading.Event(), durability.sync

    def slow_sync() -> None:
        if durability.pending:  # the claim's turn (renewals and Hellos need no fsync)
            syncing.set()
            gate.wait(10)
        real_sync()

    durability.sync = slow_sync
    trainer = client_for(router.endpoint, role="trainer")
    try:
        with ThreadPoolExecutor(1) as pool:
            asked = pool.submit(trainer.request, GetTask(key="k1"))
            assert syncing.wait(5)
            time.sleep(0.3)
            assert not asked.done(), "the Task left before its claim was on disk"
            gate.set()
            assert asked.result(5).job == job
    finally:
        gate.set()
    other = sqlite3.connect(router.settings.db)
    assert other.execute("SELECT state, trainer FROM jobs WHERE id = ?", (job,)).fetchone() == ("running", "test")

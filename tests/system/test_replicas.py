"""Replicas: several providers of one dataset, providers that die or restart, a router that dies.

Providers that get killed run as real ``busctl start provider`` processes; every epoch is checked
byte for byte against the dataset in the loader's order, so a sample lost, duplicated or moved by a
failover fails the test.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from libbus.connect.client import Client, Identity
from libbus.errors import BadRequest, NotFound, PeerTimeout
from libbus.loader.deliveries import SocketDelivery
from libbus.loader.remote import RemoteLoader
from libbus.loader.replica import Replica, pick
from libbus.wire.messages import Resolve, Stats, SubmitJob
from libbus.wire.msg_data import info_mismatch
from services.provider.sources import open_source
from services.trainer.attempt.audit import digest, effective_epochs
from tests.support import Cluster, run_service, wait_job
from tests.support.epochs import SOURCE, URI, assert_exact_epoch, read_epoch


class Spawner:
    """``busctl start ROLE`` processes sharing the test's state directory (the shared launcher,
    :class:`tests.support.Cluster`), killed at teardown."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.cluster = Cluster(state_dir)
        self.count = 0

    def start(self, role: str, *args: str, bind: str = "tcp://127.0.0.1:0") -> tuple[subprocess.Popen, str]:
        self.count += 1
        name = f"{role}-{self.count}"
        proc = self.cluster.start(name, role, "--bind", bind, "--heartbeat-ms", "200", *args, ready=True, named=False)
        return proc, name

    def provider(self, router: str, name: str) -> tuple[subprocess.Popen, str]:
        return self.start("provider", "--router", router, "--name", name, "--dataset", f"mnist={URI}")

    def endpoint(self, proc: subprocess.Popen, name: str, timeout: float = 60) -> str:
        return self.cluster.endpoint_of(name, timeout)

    def close(self) -> None:
        self.cluster.close(sig=signal.SIGKILL)


@pytest.fixture
def spawn(state_dir):
    spawner = Spawner(state_dir)
    yield spawner
    spawner.close()


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def wait_replicas(router: str, token: str, count: int, including: str = "", timeout: float = 30) -> list[dict]:
    """The router's providers of mnist, once ``count`` have registered (``including`` this endpoint)."""
    deadline = time.monotonic() + timeout
    with Client(router, Identity(role="trainer", name="test-resolve", token=token), timeout_s=5) as client:
        while True:
            try:
                providers = client.request(Resolve(dataset="mnist")).providers
            except NotFound:  # none registered yet
                providers = []
            if len(providers) >= count and (not including or including in {p["endpoint"] for p in providers}):
                return providers
            assert time.monotonic() < deadline, f"{len(providers)} of {count} providers registered"
            time.sleep(0.1)


def served_batches(endpoint: str, token: str) -> int:
    """Batches of mnist a provider has served, from its own Stats."""
    with Client(endpoint, Identity(role="trainer", name="test-stats", token=token), timeout_s=5) as client:
        stats = client.request(Stats()).services["provider"]
    return stats["datasets"].get("mnist", {}).get("batches", 0)


# -- agreement ------------------------------------------------------------------------------------


def test_info_mismatch_names_the_field_replicas_disagree_on():
    info = SOURCE.info()
    assert info_mismatch(info, {**open_source("mock://mnist?n=600").info(), "uri": "file:///elsewhere"}) is None
    assert (
        info_mismatch(info, open_source("mock://mnist?n=500").info(), "on a", "on b")
        == "splits.train.num_samples is 600 on a, 500 on b"
    )
    assert (
        info_mismatch(info, open_source("mock://cifar10?n=600").info())
        == "sample_shape is [1, 28, 28] here, [3, 32, 32] there"
    )


def test_requests_go_to_the_fewest_outstanding_same_host_first():
    def replica(name: str, local: bool, pending: int) -> Replica:
        client = Client(f"tcp://127.0.0.1:9/{name}", Identity(role="trainer", name="t", token="x"))
        r = Replica(
            name=name,
            endpoint=client.endpoint,
            client=client,
            delivery=SocketDelivery(torch.device("cpu")),
            local=local,
        )
        r.pending = {i: i for i in range(pending)}
        return r

    remote, local = replica("remote", False, 0), replica("local", True, 0)
    assert pick([remote, local], 0) is local  # a tie: same host first
    local.pending = {1: 1}
    assert pick([remote, local], 0) is remote  # else the fewest outstanding
    remote.pending = {1: 1, 2: 2}
    assert pick([remote, local], 0) is local
    local.up = False
    assert pick([remote, local], 0) is remote and pick([local], 0) is None  # only live ones


def test_router_refuses_a_replica_whose_info_disagrees(router, start_provider, client_for, make_token):
    first = start_provider(f"mnist={URI}")
    second = start_provider(f"mnist={URI}", name="provider-twin")
    providers = client_for(router.endpoint).request(Resolve(dataset="mnist")).providers
    assert {p["endpoint"] for p in providers} == {first.endpoint, second.endpoint}
    bad = open_source("mock://mnist?n=500").info()
    client = client_for(router.endpoint, role="provider", token=make_token("provider", sub="provider-bad"))
    client.identity.caps = {"endpoint": "tcp://127.0.0.1:9", "datasets": {"mnist": bad}}
    with pytest.raises(
        BadRequest,
        match=r"dataset 'mnist' differs from the replica provider-[\w-]+ serves: "
        r"splits.train.num_samples is 500 on test-provider, 600 on provider-",
    ):
        client.hello()
    providers = client_for(router.endpoint).request(Resolve(dataset="mnist")).providers
    assert len(providers) == 2  # the disagreeing provider is not among them
    first.shutdown()
    second.shutdown()
    deadline = time.monotonic() + 20
    while True:  # once the replicas it disagreed with are gone, it may define the name
        try:
            client.hello()
            break
        except BadRequest:
            assert time.monotonic() < deadline, "the router still refuses the provider"
            time.sleep(0.2)
    providers = client_for(router.endpoint).request(Resolve(dataset="mnist")).providers
    assert [p["endpoint"] for p in providers] == ["tcp://127.0.0.1:9"]


def test_a_loader_leaves_out_a_replica_that_serves_other_data(start_provider, make_settings, make_token, caplog):
    from services.provider.app import ProviderService

    good = start_provider(f"mnist={URI}", name="provider-good")
    # Not registered anywhere (the router would refuse it): a script can still name its endpoint.
    settings = make_settings(
        datasets=["mnist=mock://mnist?n=500"], router="tcp://127.0.0.1:9", assigned_only=False, name="provider-other"
    )
    other = run_service(ProviderService(settings), settings)
    try:
        with RemoteLoader(
            "mnist",
            provider=[other.endpoint, good.endpoint],
            token=make_token(),
            batch_size=50,
            seed=2,
            host_id="another-host",
        ) as loader:
            # the first to answer defines the data; the one that differs from it is left out
            assert [r.endpoint for r in loader.replicas] == [other.endpoint] and loader.num_samples == 500
        with RemoteLoader(
            "mnist", provider=[good.endpoint, other.endpoint], token=make_token(), batch_size=50, seed=2
        ) as loader:
            assert [r.endpoint for r in loader.replicas] == [good.endpoint]
            x, y = read_epoch(loader)
            assert_exact_epoch(loader, 0, x, y)
    finally:
        other.shutdown()
    why = f"splits.train.num_samples is 600 in this loader, 500 on {other.endpoint}"
    assert any("left out" in r.message and why in r.message for r in caplog.records)


# -- spreading ------------------------------------------------------------------------------------


@pytest.mark.parametrize("host_id", [None, "another-host"], ids=["shm", "socket"])
def test_an_epoch_is_spread_over_both_replicas_in_order(router, start_provider, make_token, host_id):
    a = start_provider(f"mnist={URI}", name="provider-a")
    b = start_provider(f"mnist={URI}", name="provider-b")
    with RemoteLoader(
        "mnist", router=router.endpoint, token=make_token(), batch_size=20, seed=3, inflight=4, host_id=host_id
    ) as loader:
        assert len(loader.replicas) == 2
        assert loader.transport == ("shm" if host_id is None else "socket")
        x, y = read_epoch(loader)
        assert_exact_epoch(loader, 0, x, y)
        state = loader.state_dict()
    assert state == {**state, "epoch": 1, "position": 0}
    served = [p.service.handler.served["mnist"] for p in (a, b)]
    # 30 batches, and at most inflight - 1 asked ahead of epoch 1 by the pass taken to its end
    assert all(s["batches"] > 0 for s in served) and 30 <= sum(s["batches"] for s in served) <= 33
    if host_id is None:  # both replicas wrote into the loader's one ring
        assert all(s["shm_batches"] == s["batches"] for s in served)


def test_a_provider_with_a_lingering_old_session_is_one_replica(router, start_provider, make_token, client_for):
    """A provider whose router link reconnected has two sessions at the router until the old one
    expires: Resolve lists it once (the newest), and a loader given one endpoint twice opens one
    replica, so the loader's ring is not attached twice on one provider (CI saw a job fail so)."""
    provider = start_provider(f"mnist={URI}", name="provider-a")
    (session,) = router.service.handler.sessions_of("provider")
    token = make_token("provider", sub="provider-a")
    # what the same provider says again after a reconnect
    echo = Client(
        router.endpoint,
        Identity(
            role="provider", name="provider-a", token=token, host_id=session.hello.host_id, caps=session.hello.caps
        ),
    )
    echo.hello()
    assert len(router.service.handler.sessions_of("provider")) == 2
    asker = client_for(router.endpoint, token=make_token(sub="asker"))
    resolved = asker.request(Resolve(dataset="mnist")).providers
    assert [p["endpoint"] for p in resolved] == [provider.endpoint]
    for where in (dict(router=router.endpoint), dict(provider=[provider.endpoint, provider.endpoint])):
        with RemoteLoader("mnist", token=make_token(), batch_size=20, seed=3, **where) as loader:
            assert len(loader.replicas) == 1 and loader.transport == "shm"
            x, y = read_epoch(loader)
            assert_exact_epoch(loader, 0, x, y)
    echo.close()


# -- failures -------------------------------------------------------------------------------------


def test_a_replica_killed_mid_epoch_and_the_router_killed_cost_no_sample(spawn, make_token, caplog):
    token = make_token(datasets=["mnist"])  # providers serve it without the router's assignments
    router = f"ipc://{spawn.state_dir}/router.sock"  # known before it binds: all three start at once
    router_proc, router_ready = spawn.start("router", bind=router)
    procs = [spawn.provider(router, "provider-a"), spawn.provider(router, "provider-b")]
    spawn.endpoint(router_proc, router_ready)
    endpoints = [spawn.endpoint(*p) for p in procs]
    wait_replicas(router, token, 2)
    with RemoteLoader(
        "mnist",
        router=router,
        token=token,
        batch_size=20,
        seed=11,
        inflight=4,
        timeout_s=1.0,
        retries=1,
        provider_wait_s=10,
    ) as loader:
        assert {r.endpoint for r in loader.replicas} == set(endpoints)

        def kill_a(i: int) -> None:
            if i == 5:  # provider-a goes with requests outstanding: they go to provider-b
                assert served_batches(endpoints[0], token) > 0
                kill(procs[0][0])

        x, y = read_epoch(loader, on_batch=kill_a)
        assert_exact_epoch(loader, 0, x, y)
        assert any("provider provider-a" in r.message and "dropped" in r.message for r in caplog.records)
        assert [r.endpoint for r in loader.replicas if r.up] == [endpoints[1]]

        # provider-a restarts on a new port: the next pass takes it back...
        restarted = spawn.endpoint(*spawn.provider(router, "provider-a"))
        wait_replicas(router, token, 2, including=restarted)

        def kill_router(i: int) -> None:
            if i == 5:  # ...and the router goes: data keeps coming straight from the providers
                kill(router_proc)

        x, y = read_epoch(loader, on_batch=kill_router)
        assert_exact_epoch(loader, 1, x, y)
        assert {r.endpoint for r in loader.replicas if r.up} == {restarted, endpoints[1]}
        x, y = read_epoch(loader)  # a whole epoch more without a router
        assert_exact_epoch(loader, 2, x, y)
    assert served_batches(restarted, token) > 0 and served_batches(endpoints[1], token) > 0


@pytest.mark.parametrize("slots", [0, 2], ids=["ring", "ring-too-small-after"])
def test_a_hung_replica_is_dropped_after_its_timeouts(router, spawn, make_token, caplog, slots):
    token = make_token(datasets=["mnist"])
    procs = {name: spawn.provider(router.endpoint, name) for name in ("provider-a", "provider-b")}
    endpoints = {name: spawn.endpoint(*p) for name, p in procs.items()}
    wait_replicas(router.endpoint, token, 2)
    with RemoteLoader(
        "mnist",
        router=router.endpoint,
        token=token,
        batch_size=20,
        seed=4,
        inflight=4,
        shm_slots=slots,
        timeout_s=1.0,
        retries=1,
    ) as loader:
        # the first replica gets requests whatever the depth (ties go to it); it is the one to hang
        name, kept = loader.replicas[0].name, loader.replicas[1].endpoint
        hung = procs[name][0]

        def hang(i: int) -> None:
            if i == 5:  # stopped, not killed: its connections stay open, its replies never come
                hung.send_signal(signal.SIGSTOP)
            if i == 12:  # dropped by now; it resumes and finishes what it was writing
                hung.send_signal(signal.SIGCONT)

        try:
            x, y = read_epoch(loader, on_batch=hang)
        finally:
            hung.send_signal(signal.SIGCONT)
        assert_exact_epoch(loader, 0, x, y)
        assert [r.endpoint for r in loader.replicas if r.up] == [kept]
        # the ring slots it had requests for are out of use: a late write cannot land in a batch
        ring = loader._ring
        assert ring.quarantined
        if slots:  # one slot left cannot hold a batch in use and one in flight: the socket it is
            assert loader.transport == "socket" and loader.inflight == 4
        else:
            assert loader.transport == "shm" and loader.inflight == ring.usable - 1
        x, y = read_epoch(loader)
        assert_exact_epoch(loader, 1, x, y)
    messages = [r.message for r in caplog.records]
    assert any("no reply within 1.0 s" in m and "reconnecting" in m for m in messages)
    assert any(f"provider {name}" in m and "dropped" in m for m in messages)
    assert endpoints[name] != kept


def test_the_only_replica_restarted_on_a_new_port_costs_no_sample(router, spawn, make_token):
    token = make_token(datasets=["mnist"])
    first = spawn.provider(router.endpoint, "provider-a")
    old = spawn.endpoint(*first)
    wait_replicas(router.endpoint, token, 1)
    restarted = []

    def restart(i: int) -> None:
        if i == 5:
            kill(first[0])
            restarted.append(spawn.provider(router.endpoint, "provider-a"))

    with RemoteLoader(
        "mnist",
        router=router.endpoint,
        token=token,
        batch_size=20,
        seed=5,
        inflight=3,
        timeout_s=1.0,
        retries=1,
        provider_wait_s=45,
    ) as loader:
        x, y = read_epoch(loader, on_batch=restart)
        assert_exact_epoch(loader, 0, x, y)
        new = spawn.endpoint(*restarted[0])
        assert new != old and [r.endpoint for r in loader.replicas] == [new]
        assert served_batches(new, token) > 0

        # and when nothing comes back, the wait is bounded and says what it waited for
        loader.provider_wait_s = 2.0
        it = iter(loader)
        next(it)
        kill(restarted[0][0])
        started = time.monotonic()
        with pytest.raises(PeerTimeout, match=r"no provider of mnist/train answered for 2 s \(provider_wait_s\)"):
            for _ in it:
                pass
        # a timeout and a failed reconnect (1 s each), then the 2 s wait; never a hang
        assert time.monotonic() - started < 15


def test_a_job_keeps_training_through_a_killed_replica(router, spawn, trainer, client_for, make_token, caplog):
    token = make_token(datasets=["mnist"])
    procs = {name: spawn.provider(router.endpoint, name) for name in ("provider-a", "provider-b")}
    endpoints = {name: spawn.endpoint(*p) for name, p in procs.items()}
    # The trainer resolves as we do, and names the first (same-host) provider in its result: that
    # one dies, so the job must also find the other to score the model on at the end.
    first, other = (p["name"] for p in wait_replicas(router.endpoint, token, 2))
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={"dataset": "mnist", "model": "mlp", "epochs": 2, "batch_size": 20})).job
    deadline = time.monotonic() + 60
    while served_batches(endpoints[first], token) == 0:  # the trainer reads from both...
        assert time.monotonic() < deadline, f"{first} served nothing"
        time.sleep(0.05)
    kill(procs[first][0])  # ...until the first dies mid-epoch
    info = wait_job(admin, job, 90)
    assert info["state"] == "succeeded", info.get("error")
    assert info["result"]["provider"] == first
    assert served_batches(endpoints[other], token) > 0
    assert [h["epoch"] for h in info["result"]["history"]] == [1, 2]
    assert info["result"]["test_n"] == 120  # scored on the replica left
    # every epoch trained on every sample exactly once, the kill notwithstanding
    x, y = open_source(URI).read("train", np.arange(open_source(URI).num_samples("train")))
    dataset = Counter(digest(x[i].tobytes(), y[i].tobytes()) for i in range(len(x)))
    epochs = effective_epochs(trainer.settings.audit_dir, job)
    assert sorted(epochs) == [0, 1] and all(seen == dataset for seen in epochs.values())
    assert any(f"provider {first}" in r.message and "dropped" in r.message for r in caplog.records)

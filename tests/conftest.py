"""Fixtures: real services on real sockets (loopback TCP, random ports), real SQLite files."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import zmq

from libbus.config import Settings, load_settings
from libbus.connect.client import Client, Identity
from libbus.security.admission import admit_client
from libbus.security.auth import ensure_secret, issue_token
from tests.support import CLUSTER, Running, run_service
from tests.support.schedule import longest_first


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # the longest files start first (tests/support/schedule.py; the Makefile keeps this order under xdist)
    items[:] = longest_first(items)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    ensure_secret(tmp_path / "secret")
    return tmp_path


@pytest.fixture
def secret(state_dir: Path) -> bytes:
    return (state_dir / "secret").read_bytes().strip()


@pytest.fixture
def make_token(secret: bytes):
    def make(
        role: str = "trainer",
        sub: str = "test",
        ttl_s: float = 600.0,
        key: bytes | None = None,
        audience: str = CLUSTER,
        datasets: list[str] | None = None,
        jobs: list[str] | None = None,
    ) -> str:
        return issue_token(
            key or secret, sub=sub, role=role, audience=audience, ttl_s=ttl_s, datasets=datasets, jobs=jobs
        )

    return make


@pytest.fixture
def make_settings(state_dir: Path):
    def make(**flags) -> Settings:
        flags.setdefault("heartbeat_ms", 100)
        # 10 silent intervals (1 s) before a peer counts as gone: on a loaded CI machine the threads of
        # one test process can miss the GIL for longer than 5 intervals of 100 ms
        flags.setdefault("heartbeat_liveness", 10)
        flags.setdefault("request_timeout_s", 3.0)
        flags.setdefault("request_retries", 1)
        # Heartbeats at 100 ms find a dead peer fast; a job's lease is longer than the default of two
        # liveness periods (2 s here), because on a loaded CI machine the router, provider and trainer
        # threads of one test process can all miss the GIL for a second, and a lapsed lease requeues a live job.
        flags.setdefault("lease_s", 4.0)
        # Test splits here hold a few hundred samples, on which the privacy noise of released test
        # scores is large (docs/security.md): tests of learning read exact scores; the tests of the
        # release (tests/evaluation/test_evaluators.py) run providers at the product's defaults.
        flags.setdefault("eval_epsilon", 0.0)
        # One torch thread per attempt, as tests/support/cluster.py gives its processes: many run at once here.
        flags.setdefault("torch_threads", 1)
        settings, _ = load_settings(env={}, flags={"state_dir": str(state_dir), **flags})
        return settings

    return make


@pytest.fixture
def router(make_settings):
    from services.router.app import RouterService

    settings = make_settings(bind="tcp://127.0.0.1:0")
    running = run_service(RouterService(settings), settings)
    yield running
    running.shutdown()


@pytest.fixture
def start_provider(make_settings, router):
    from services.provider.app import ProviderService

    started = []

    def start(*datasets: str, **flags) -> Running:
        # Most tests read data straight from a provider with a plain trainer token, as a script
        # would with a dataset-scoped one. The product default (serve trainers only the datasets
        # of their job) is on in the job tests, which pass assigned_only=True, and in test_security.
        flags.setdefault("assigned_only", False)
        flags.setdefault("router", router.endpoint)
        settings = make_settings(datasets=list(datasets), **flags)
        running = run_service(ProviderService(settings), settings)
        started.append(running)
        assert running.service.link.wait_connected(10), "provider did not register with the router"
        return running

    yield start
    for running in started:
        running.shutdown()


@pytest.fixture
def provider(start_provider):
    return start_provider("mnist=mock://mnist?n=600", "zeros=dummy://?shape=2,3&n=100&classes=4")


@pytest.fixture
def client_for(make_token):
    """A connected-on-demand Client for an endpoint, closed after the test."""
    clients = []

    def make(endpoint: str, role: str = "trainer", token: str | None = None, host_id: str = "", **kw) -> Client:
        kw.setdefault("timeout_s", 3.0)
        kw.setdefault("retries", 0)
        c = Client(
            endpoint, Identity(role=role, name=f"test-{role}", token=token or make_token(role), host_id=host_id), **kw
        )
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def raw_dealer(make_token):
    """A bare DEALER socket for sending hand-made frames (past the handshake: it presents a valid
    token there, as every client must; what it sends after is up to the test)."""
    ctx = zmq.Context.instance()
    socks = []

    def make(endpoint: str) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        admit_client(s, make_token("trainer"))
        s.connect(endpoint)
        socks.append(s)
        return s

    yield make
    for s in socks:
        s.close(0)


@pytest.fixture
def trainer(make_settings, router, state_dir):
    """A trainer service on its own thread, registered with the router, stopped after the test."""
    from services.trainer.service.app import TrainerService

    # audit_dir: every sample it trains on is logged, so a test can check each epoch saw the dataset once
    service = TrainerService(
        make_settings(router=router.endpoint, name="trainer-test", audit_dir=str(state_dir / "audit"))
    )
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    yield service
    stop.set()
    thread.join(15)
    assert not thread.is_alive(), "trainer did not stop within 15 s"


@pytest.fixture
def entry_trainer(make_settings, router):
    """A trainer service (on its own thread) whose operator allows the tests' entrypoints
    (tests/support/entrypoints.py): each attempt runs in a child process of this test's process."""
    from services.trainer.service.app import TrainerService

    service = TrainerService(
        make_settings(router=router.endpoint, name="trainer-entry", job_modules=["tests.support.entrypoints"])
    )
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    yield service
    stop.set()
    thread.join(30)
    assert not thread.is_alive(), "trainer did not stop within 30 s"


@pytest.fixture(scope="module")
def train_digests(cluster):
    """The multiset of every train sample's digest, read straight from the provider of the module's
    ``cluster`` (a :class:`tests.support.jobs.JobCluster`): what every epoch's audit must equal."""
    return cluster.train_digests()

"""systemd's notify protocol, as a service manager sees it: real `busctl start` processes with
NOTIFY_SOCKET pointing at a datagram socket the test binds, and a serving loop that gets stuck."""

from __future__ import annotations

import itertools
import os
import re
import secrets
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import Future

import pytest
from safetensors.torch import save as save_safetensors

from libbus.errors import PeerTimeout, Unavailable
from libbus.loader.remote import RemoteLoader
from libbus.serve.server import Handler, Server, ServerConfig
from libbus.wire.messages import DatasetInfo, DatasetInfoRequest, Evaluate, SubmitJob
from services.models import build_model
from services.provider.evalgate import EvalGate
from services.provider.handler import ProviderHandler
from services.provider.score_release import EXACT
from services.provider.sources import open_source
from services.sdnotify import Notifier
from tests.support import REPO, Cluster


class Manager:
    """The service manager's end: an abstract-namespace datagram socket, messages timestamped."""

    def __init__(self):
        self.address = f"@batchbus-test-{secrets.token_hex(6)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.address[1:])
        self.messages: list[tuple[float, dict[str, str]]] = []

    def receive(self, timeout: float) -> dict[str, str] | None:
        self.sock.settimeout(max(timeout, 0.001))
        try:
            data = self.sock.recv(4096)
        except (TimeoutError, BlockingIOError):
            return None
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        self.messages.append((time.monotonic(), fields))
        return fields

    def wait_for(self, key: str, timeout: float, proc: subprocess.Popen | None = None) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert proc is None or proc.poll() is None, f"service exited {proc.returncode} before {key}"
            fields = self.receive(min(0.5, deadline - time.monotonic()))
            if fields is not None and key in fields:
                return fields
        raise AssertionError(f"no {key} within {timeout} s; got {[m for _, m in self.messages]}")

    def collect(self, seconds: float) -> list[tuple[float, dict[str, str]]]:
        start = len(self.messages)
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.receive(left)
        return self.messages[start:]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def manager():
    m = Manager()
    yield m
    m.close()


@pytest.fixture
def launcher(state_dir, manager):
    """The launcher for these tests' services: they notify ``manager``, as systemd's would."""
    cluster = Cluster(state_dir, {"NOTIFY_SOCKET": manager.address, "PYTHONPATH": str(REPO)})
    cluster.env.pop("WATCHDOG_PID", None)
    yield cluster
    cluster.close()


def start(launcher: Cluster, role: str, *args: str, watchdog_usec: int, **extra_env: str) -> subprocess.Popen:
    return launcher.start(role, role, *args, named=False, env={"WATCHDOG_USEC": str(watchdog_usec), **extra_env})


def watchdog_times(messages) -> list[float]:
    return [t for t, fields in messages if fields.get("WATCHDOG") == "1"]


def test_provider_is_ready_once_it_serves_feeds_the_watchdog_and_drains_on_sigterm(
    manager, state_dir, make_token, launcher
):
    # The secret comes as a systemd credential (LoadCredential=secret:...); the unit's fallback
    # path (BATCHBUS_SECRET_FILE) does not even exist.
    creds = state_dir / "credentials"
    creds.mkdir()
    (creds / "secret").write_bytes((state_dir / "secret").read_bytes())
    (creds / "secret").chmod(0o400)
    proc = start(
        launcher,
        "provider",
        "--bind",
        "tcp://127.0.0.1:0",
        "--router",
        "tcp://127.0.0.1:9",
        "--dataset",
        "mnist=mock://mnist?n=600",
        watchdog_usec=1_000_000,
        CREDENTIALS_DIRECTORY=str(creds),
        BATCHBUS_SECRET_FILE=str(state_dir / "absent"),
    )
    try:
        ready = manager.wait_for("READY", 90, proc)
        # READY=1 comes with where it serves, and that endpoint takes connections at once.
        endpoint = re.fullmatch(r"serving mnist on (tcp://127\.0\.0\.1:(\d+))", ready["STATUS"])
        assert endpoint, ready
        socket.create_connection(("127.0.0.1", int(endpoint[2])), timeout=5).close()
        token = make_token(datasets=["mnist"])
        loader = RemoteLoader(
            "mnist",
            provider=endpoint[1],
            token=token,
            batch_size=50,
            inflight=2,
            timeout_s=1.0,
            retries=1,
            shm=False,
            provider_wait_s=2.0,
        )
        assert loader.info["num_classes"] == 10  # it asked the provider for DatasetInfo as it opened

        # WATCHDOG=1 about every half interval (0.5 s), not every loop turn (0.1 s), never missing.
        beats = watchdog_times(manager.collect(3.0))
        gaps = [b - a for a, b in itertools.pairwise(beats)]
        assert 4 <= len(beats) <= 8, gaps
        assert min(gaps) > 0.35 and max(gaps) < 1.0, gaps

        # SIGTERM mid-epoch: STOPPING=1 at once, exit 0 within seconds, and the loader gets its
        # batches or a clean error (the service is gone), never a hang.
        it = iter(loader)
        got = [next(it) for _ in range(3)]
        proc.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        assert "STOPPING" in manager.wait_for("STOPPING", 10)
        assert proc.wait(15) == 0
        assert time.monotonic() - stopped_at < 15
        with pytest.raises(PeerTimeout):
            for x, y in it:
                got.append((x, y))
        assert time.monotonic() - stopped_at < 20
        assert all(x.shape == (50, 1, 28, 28) for x, _ in got)
        loader.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


class BlockingTick(Handler):
    """A handler whose timer can be made to hang, like a loop stuck on a lock or a slow disk."""

    def __init__(self):
        super().__init__()
        self.block = threading.Event()
        self.blocked = threading.Event()
        self.release = threading.Event()

    def tick(self, now: float) -> None:
        if self.block.is_set():
            self.blocked.set()
            self.release.wait(10)
            self.block.clear()


def test_a_stuck_serving_loop_stops_feeding_the_watchdog(manager, secret):
    notifier = Notifier(manager.address, watchdog_usec=200_000)
    handler = BlockingTick()
    server = Server(
        handler,
        ServerConfig(bind="tcp://127.0.0.1:0", secret=secret, audience="batchbus", name="stuck", heartbeat_ms=100),
    )
    stop = threading.Event()
    thread = threading.Thread(target=server.run, args=(stop, notifier.watchdog), daemon=True)
    thread.start()
    try:
        assert len(watchdog_times(manager.collect(1.0))) >= 5  # fed every ~0.1 s while it turns
        handler.block.set()
        assert handler.blocked.wait(5)
        manager.collect(0.05)  # one sent just before the block
        assert watchdog_times(manager.collect(1.0)) == []  # stuck: systemd would act now
        handler.release.set()
        assert watchdog_times(manager.collect(1.0))  # turning again: fed again
    finally:
        handler.release.set()
        stop.set()
        thread.join(10)
        notifier.close()
    assert not thread.is_alive()


def test_notifier_honours_the_environment(manager):
    assert not Notifier.from_env({}).send("READY=1")  # outside systemd: a no-op
    assert (
        Notifier.from_env(
            {"NOTIFY_SOCKET": manager.address, "WATCHDOG_USEC": "500000", "WATCHDOG_PID": str(os.getpid())}
        ).watchdog_s
        == 0.5
    )
    other = Notifier.from_env({"NOTIFY_SOCKET": manager.address, "WATCHDOG_USEC": "500000", "WATCHDOG_PID": "1"})
    assert other.watchdog_s == 0 and not other.watchdog()  # meant for another process
    clock = [100.0]
    n = Notifier(manager.address, watchdog_usec=2_000_000, clock=lambda: clock[0])
    assert n.ready("up") and manager.receive(1) == {"READY": "1", "STATUS": "up"}
    assert not n.watchdog()  # READY=1 just armed it
    clock[0] += 1.0
    assert n.watchdog() and not n.watchdog()  # at most every half interval
    assert n.status("busy") and not n.status("busy")  # unchanged status: not resent
    with n.extended(60):
        pass
    msgs = [manager.receive(1) for _ in range(4)]
    assert msgs[:2] == [{"WATCHDOG": "1"}, {"STATUS": "busy"}]
    assert msgs[2:] == [{"WATCHDOG_USEC": "62000000", "WATCHDOG": "1"}, {"WATCHDOG_USEC": "2000000", "WATCHDOG": "1"}]
    assert n.stopping() and not n.stopping()
    n.close()


class Deferred(Handler):
    """Answers DatasetInfoRequest later, from another thread (like an evaluation)."""

    roles = {"DatasetInfoRequest": ("trainer",)}

    def __init__(self):
        super().__init__()
        self.received = threading.Event()
        self.future: Future | None = None

    def handle(self, session, msg):
        self.future = Future()
        self.received.set()
        return self.future


@pytest.mark.parametrize("finishes", [True, False])
def test_a_stopping_server_finishes_deferred_work_or_says_it_gave_up(secret, client_for, finishes):
    handler = Deferred()
    server = Server(
        handler, ServerConfig(bind="tcp://127.0.0.1:0", secret=secret, audience="batchbus", name="drainer", drain_s=1.0)
    )
    endpoint = server.bind()
    stop = threading.Event()
    thread = threading.Thread(target=server.run, args=(stop,), daemon=True)
    thread.start()

    def stop_mid_request():
        assert handler.received.wait(10)
        stop.set()  # SIGTERM while the request is being worked on
        if finishes:
            time.sleep(0.3)
            handler.future.set_result(DatasetInfo(dataset="d", info={"late": True}))

    threading.Thread(target=stop_mid_request, daemon=True).start()
    client = client_for(endpoint, timeout_s=10.0)
    started = time.monotonic()
    if finishes:
        assert client.request(DatasetInfoRequest(dataset="d")).info == {"late": True}
    else:
        with pytest.raises(Unavailable, match="drainer is stopping"):
            client.request(DatasetInfoRequest(dataset="d"))
    assert time.monotonic() - started < 5  # an answer, not the client's 10 s timeout
    thread.join(5)
    assert not thread.is_alive()


def test_trainer_reports_its_job_feeds_the_watchdog_between_steps_and_stops_on_sigterm(
    manager, state_dir, router, start_provider, client_for, launcher
):
    start_provider("mnist=mock://mnist?n=600")
    proc = start(
        launcher,
        "trainer",
        "--router",
        router.endpoint,
        "--name",
        "trainer-sd",
        watchdog_usec=2_000_000,
        BATCHBUS_HEARTBEAT_MS="200",
        BATCHBUS_TORCH_THREADS="1",
    )
    try:
        # Ready once started, whether or not the router has answered yet; STATUS says which.
        ready = manager.wait_for("READY", 90, proc)
        assert ready["STATUS"] == f"waiting for the router at {router.endpoint}"
        admin = client_for(router.endpoint, role="admin")
        job = admin.request(
            SubmitJob(spec={"dataset": "mnist", "model": "mlp", "epochs": 200, "batch_size": 32, "evaluate": False})
        ).job
        running = f"running job {job} epoch "
        deadline = time.monotonic() + 60
        while not manager.messages[-1][1].get("STATUS", "").startswith(running + "3/200"):
            assert time.monotonic() < deadline, manager.messages[-5:]
            manager.wait_for("STATUS", 60, proc)
        # Fed between steps (every half interval, 1 s), never a gap the watchdog would act on.
        training = manager.collect(3.0)
        beats = [t for t, m in manager.messages if m.get("WATCHDOG") == "1"]
        gaps = [b - a for a, b in itertools.pairwise(beats[-4:])]
        assert len(watchdog_times(training)) >= 2 and max(gaps) < 2.0, gaps
        assert any(m.get("STATUS", "").startswith(running) for _, m in training)
        proc.send_signal(signal.SIGTERM)
        manager.wait_for("STOPPING", 15)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_stopping_a_provider_abandons_a_running_evaluation_instead_of_waiting_for_it():
    source = open_source("mock://cifar10?n=60000")  # a 12,000-sample test split
    # no router here: exact scores and no daily budget (nothing to charge there before scoring)
    handler = ProviderHandler(
        {"cifar": source}, assigned_only=False, evalgate=EvalGate(per_dataset_day=0), release=EXACT
    )
    info = handler.infos["cifar"]
    weights = save_safetensors(build_model("cnn", info).state_dict())
    future = handler.evaluate(Evaluate(dataset="cifar", job="j", model={"name": "cnn", "kwargs": {}}, frames=[weights]))
    time.sleep(0.3)
    started = time.monotonic()
    handler.close()  # what SIGTERM ends with
    with pytest.raises(Unavailable, match="provider is stopping"):
        future.result(timeout=30)
    assert time.monotonic() - started < 10
    for worker in [t for t in threading.enumerate() if t.name.startswith("evaluate")]:
        worker.join(10)  # nothing left for the interpreter to wait on
        assert not worker.is_alive()

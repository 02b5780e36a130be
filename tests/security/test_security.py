"""Who gets in and what they may read: CURVE with ZAP, token revocation, job assignment, limits.

Real services on loopback sockets, real key files, a real TCP relay that records what crosses the
wire. The multi-host run in network namespaces is tests/system/test_multihost.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from libbus.connect.client import Client, Identity
from libbus.errors import AuthInvalid, BadRequest, ConfigError, Forbidden, PeerTimeout, RateLimited, TooLarge
from libbus.security.auth import inspect_token, issue_token
from libbus.security.curve import KeyAuthenticator, generate_keys, load_keys, secure_client, secure_server
from libbus.wire.messages import (
    BatchRequest,
    DatasetInfoRequest,
    GetTask,
    Hello,
    ListPeers,
    PushResult,
    Resolve,
    SubmitJob,
    Task,
    decode,
    encode,
)
from services.provider.sources import open_source
from tests.support import CLUSTER, run_service

MNIST = "mock://mnist?n=600"
ROLES = ("router", "provider", "trainer", "admin")


# -- helpers ---------------------------------------------------------------------------------


@pytest.fixture
def curve_dir(state_dir: Path) -> Path:
    """Key pairs for every role in ``<state_dir>/curve`` (the defaults services look in); the
    clients' public keys in ``authorized/``."""
    keys = state_dir / "curve"
    (keys / "authorized").mkdir(parents=True)
    for role in ROLES:
        public, _ = generate_keys(keys, role)
        if role != "router":
            shutil.copy(public, keys / "authorized" / public.name)
    return keys


@pytest.fixture
def curve_services(make_settings, curve_dir):
    """Start a CURVE router, then CURVE providers attached to it; all stopped after the test."""
    from services.provider.app import ProviderService
    from services.router.app import RouterService

    running = []

    def router(**flags):
        settings = make_settings(bind="tcp://127.0.0.1:0", curve=True, **flags)
        r = run_service(RouterService(settings), settings)
        running.append(r)
        return r

    def provider(router_endpoint: str, *datasets: str, **flags):
        flags.setdefault("assigned_only", False)
        settings = make_settings(router=router_endpoint, datasets=list(datasets), curve=True, **flags)
        p = run_service(ProviderService(settings), settings)
        running.append(p)
        assert p.service.link.wait_connected(10), "CURVE provider did not register with the CURVE router"
        return p

    yield router, provider
    for r in reversed(running):
        r.shutdown()


def curve_client(
    endpoint: str,
    curve_dir: Path,
    secret: bytes,
    *,
    key: str = "trainer",
    sub: str | None = None,
    role: str = "trainer",
    server: str = "router",
    timeout_s: float = 3.0,
    server_key: bytes | None = None,
) -> Client:
    keys = load_keys(curve_dir / f"{key}.key_secret") if "/" not in key else load_keys(key)
    token = issue_token(secret, sub=sub or keys.name, role=role, audience=CLUSTER)
    if server_key is None:
        server_key = load_keys(curve_dir / f"{server}.key_secret").public
    return Client(
        endpoint,
        Identity(role=role, name=keys.name, token=token, curve=keys),
        timeout_s=timeout_s,
        retries=0,
        server_key=server_key,
    )


class Relay:
    """A TCP relay between a client and a server that records every byte it forwards."""

    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.seen = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def wait_for(predicate, timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- CURVE -----------------------------------------------------------------------------------


def test_keys_gen_writes_a_private_secret_whatever_the_umask(tmp_path):
    out = tmp_path / "keys"
    run = subprocess.run(
        ["sh", "-c", f"umask 000; {sys.executable} -m cli keys gen node-1 --dir {out}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    secret, public = out / "node-1.key_secret", out / "node-1.key"
    assert secret.stat().st_mode & 0o777 == 0o600
    keys = load_keys(secret)
    assert keys.name == "node-1" and len(keys.public) == 40 and keys.public.decode() in public.read_text()
    assert "secret-key" not in public.read_text()  # the public file holds no secret half
    again = subprocess.run(
        [sys.executable, "-m", "cli", "keys", "gen", "node-1", "--dir", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr
    os.chmod(secret, 0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        load_keys(secret)
    with pytest.raises(ConfigError, match="only a public key"):
        load_keys(public)


def test_a_curve_cluster_admits_listed_keys_whose_token_matches(curve_services, curve_dir, secret):
    start_router, start_provider = curve_services
    router = start_router()
    provider = start_provider(router.endpoint, "mnist=" + MNIST)  # provider → router over CURVE
    admin = curve_client(router.endpoint, curve_dir, secret, key="admin", role="admin")
    peers = {p["name"]: p for p in admin.request(ListPeers()).peers}
    assert peers["provider"]["key"] == "provider"  # the session knows its key's name
    resolved = admin.request(Resolve(dataset="mnist"))
    provider_key = load_keys(curve_dir / "provider.key_secret").public
    assert resolved.providers[0]["curve_key"] == provider_key.decode()

    trainer = curve_client(provider.endpoint, curve_dir, secret, server="provider")
    reply = trainer.request(BatchRequest(dataset="mnist", split="train", range=[0, 4]))
    want, _ = open_source(MNIST).read("train", np.arange(4))
    assert bytes(reply.frames[0]) == want.tobytes()

    # the right key with someone else's token
    thief = curve_client(provider.endpoint, curve_dir, secret, server="provider", sub="admin-bob")
    with pytest.raises(Forbidden, match="'admin-bob' does not own this connection's CURVE key 'trainer'"):
        thief.hello()
    # a key nobody listed, and no key at all: the handshake never completes, so nothing comes back
    # (the client sees the ZAP refusal on its socket's monitor and says so)
    outsider = generate_keys(curve_dir / "elsewhere", "outsider")[1]
    stranger = curve_client(provider.endpoint, curve_dir, secret, key=str(outsider), server="provider", timeout_s=1.5)
    with pytest.raises(AuthInvalid, match="refused this connection at the handshake"):
        stranger.hello()
    plain = Client(
        provider.endpoint,
        Identity(
            role="trainer", name="trainer", token=issue_token(secret, sub="trainer", role="trainer", audience=CLUSTER)
        ),
        timeout_s=1.5,
        retries=0,
    )
    with pytest.raises(PeerTimeout):
        plain.hello()
    # an operator lists the outsider's key: admitted from the next connection, no restart
    shutil.copy(curve_dir / "elsewhere" / "outsider.key", curve_dir / "authorized" / "outsider.key")
    stranger = curve_client(provider.endpoint, curve_dir, secret, key=str(outsider), server="provider")
    assert stranger.request(DatasetInfoRequest(dataset="mnist")).info["num_classes"] == 10
    for c in (admin, trainer, thief, stranger, plain):
        c.close()


def test_curve_hides_tokens_and_samples_from_the_wire(
    curve_services, curve_dir, secret, start_provider, client_for, make_token
):
    def captured(endpoint: str, make_client) -> tuple[bytes, str, bytes]:
        relay = Relay(endpoint)
        client = make_client(relay.endpoint)
        reply = client.request(BatchRequest(dataset="mnist", split="train", range=[0, 16]))
        client.close()
        relay.close()
        return bytes(relay.seen), client.identity.token, bytes(reply.frames[0])

    plain = start_provider("mnist=" + MNIST)
    wire, token, data = captured(plain.endpoint, lambda ep: client_for(ep, token=make_token()))
    assert token.encode() in wire and data[:4096] in wire  # without CURVE, both in clear

    start_router, start_provider_curve = curve_services
    provider = start_provider_curve(start_router().endpoint, "mnist=" + MNIST)
    wire, token, data = captured(provider.endpoint, lambda ep: curve_client(ep, curve_dir, secret, server="provider"))
    assert len(wire) > len(data)  # the batch did cross this relay
    assert token.encode() not in wire and token.split(".")[1].encode() not in wire
    assert data[:4096] not in wire and b"DatasetInfo" not in wire and b"BatchRequest" not in wire


def test_without_a_zap_handler_a_curve_server_admits_nobody(tmp_path):
    keys = load_keys(generate_keys(tmp_path, "server")[1])
    client_keys = load_keys(generate_keys(tmp_path / "authorized", "client")[1])

    def reaches(with_handler: bool) -> bytes | None:
        ctx = zmq.Context()
        auth = KeyAuthenticator(ctx, tmp_path / "authorized") if with_handler else None
        if auth:
            auth.start()
        server = ctx.socket(zmq.ROUTER)
        secure_server(server, keys)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client = ctx.socket(zmq.DEALER)
        secure_client(client, client_keys, keys.public)
        client.connect(f"tcp://127.0.0.1:{port}")
        client.send(b"hello")
        got = server.recv_multipart(copy=False) if server.poll(1500) else None
        user = got[1].get("User-Id") if got else None
        for s in (client, server):
            s.close(0)
        if auth:
            auth.terminate()  # terminates ctx, the handler answering until its last connection is gone
        else:
            ctx.term()
        return user

    assert reaches(with_handler=False) is None  # ZAP domain + ZAP_ENFORCE_DOMAIN: refused
    assert reaches(with_handler=True) == "client"  # the handler admits it and names it


# -- revocation ------------------------------------------------------------------------------


def test_a_revoked_token_is_refused_everywhere_and_stays_revoked(
    router, start_provider, client_for, make_token, make_settings, state_dir
):
    from services.router.app import RouterService

    provider = start_provider("mnist=" + MNIST)
    token = make_token("trainer", sub="laptop")
    jti = inspect_token(token)[1]["jti"]
    reader = client_for(provider.endpoint, token=token)
    reader.request(DatasetInfoRequest(dataset="mnist"))
    pserver = provider.service.server
    assert any(s.claims.jti == jti for s in pserver.sessions.values())

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "token",
            "revoke",
            token,
            "--reason",
            "laptop stolen",
            "--router",
            router.endpoint,
            "--state-dir",
            str(state_dir),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0 and f"revoked {jti}" in run.stdout, run.stderr
    # the provider heard of it from the router and closed the session
    wait_for(lambda: not any(s.claims.jti == jti for s in pserver.sessions.values()), what="session closed")
    with pytest.raises(AuthInvalid, match="revoked"):
        reader.request(DatasetInfoRequest(dataset="mnist"))
    with pytest.raises(AuthInvalid, match="revoked"):
        client_for(router.endpoint, token=token).hello()
    listed = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "token",
            "revoked",
            "--json",
            "--router",
            router.endpoint,
            "--state-dir",
            str(state_dir),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert jti in listed.stdout and "laptop stolen" in listed.stdout
    assert client_for(provider.endpoint).request(DatasetInfoRequest(dataset="mnist"))  # others unaffected

    # a router restarted on the same database still refuses it, and tells new providers
    router.shutdown()
    settings = make_settings(bind="tcp://127.0.0.1:0")
    again = run_service(RouterService(settings), settings)
    try:
        with pytest.raises(AuthInvalid, match="revoked"):
            client_for(again.endpoint, token=token).hello()
        fresh = start_provider("mnist=" + MNIST, router=again.endpoint)
        wait_for(lambda: jti in fresh.service.server.tokens.revoked, what="revocations pushed to a new provider")
        with pytest.raises(AuthInvalid, match="revoked"):
            client_for(fresh.endpoint, token=token).hello()
        fresh.shutdown()
    finally:
        again.shutdown()


# -- assignment ------------------------------------------------------------------------------


def test_a_provider_serves_trainers_only_the_dataset_of_their_job(router, start_provider, client_for, make_token):
    provider = start_provider("mnist=" + MNIST, "zeros=dummy://?shape=2&n=10", assigned_only=True)
    admin = client_for(router.endpoint, role="admin")
    job = admin.request(SubmitJob(spec={"dataset": "mnist", "epochs": 1})).job
    t1 = make_token("trainer", sub="t1")
    on_router = client_for(router.endpoint, token=t1)
    on_router.identity.name = "t1"
    reader = client_for(provider.endpoint, token=t1, timeout_s=8.0)  # outlives the grace wait
    with pytest.raises(Forbidden, match="'t1' is not assigned to a job on mnist"):
        reader.request(DatasetInfoRequest(dataset="mnist"))  # refused after the grace wait
    task = on_router.request(GetTask())
    assert isinstance(task, Task) and task.job == job
    assert reader.request(DatasetInfoRequest(dataset="mnist")).info["num_classes"] == 10
    with pytest.raises(Forbidden, match="not assigned to a job on zeros"):
        reader.request(DatasetInfoRequest(dataset="zeros"))  # only its job's dataset
    other = client_for(provider.endpoint, token=make_token("trainer", sub="t2"), timeout_s=8.0)
    with pytest.raises(Forbidden, match="'t2' is not assigned"):
        other.request(BatchRequest(dataset="mnist", split="train", range=[0, 2]))
    # a token the administrator scoped to the dataset is its own grant (scripts with RemoteLoader)
    scoped = client_for(provider.endpoint, token=make_token("trainer", sub="t3", datasets=["zeros"]))
    assert scoped.request(DatasetInfoRequest(dataset="zeros")).info["sample_shape"] == [2]
    # the job ends: the grant goes with it
    on_router.request(PushResult(job=job, state="succeeded", result={}))
    time.sleep(0.5)
    with pytest.raises(Forbidden, match="not assigned"):
        reader.request(DatasetInfoRequest(dataset="mnist"))
    assert provider.service.handler.refused["unassigned"] == 4


def test_get_task_respects_the_tokens_scopes(router, client_for, make_token):
    admin = client_for(router.endpoint, role="admin")
    first = admin.request(SubmitJob(spec={"dataset": "mnist", "priority": 9})).job
    mine = admin.request(SubmitJob(spec={"dataset": "mnist"})).job
    admin.request(SubmitJob(spec={"dataset": "zeros", "priority": 5}))
    scoped = client_for(router.endpoint, token=make_token("trainer", sub="s", jobs=[mine]))
    assert scoped.request(GetTask()).job == mine  # not the higher-priority one
    only_cifar = client_for(router.endpoint, token=make_token("trainer", sub="c", datasets=["cifar"]))
    assert only_cifar.request(GetTask()).type == "NoTask"
    anyone = client_for(router.endpoint, token=make_token("trainer", sub="a"))
    assert anyone.request(GetTask()).job == first


# -- limits ----------------------------------------------------------------------------------


def test_requests_in_flight_per_session_are_capped(start_provider, raw_dealer, make_token):
    provider = start_provider("mnist=" + MNIST, assigned_only=True, session_inflight=3)
    sock = raw_dealer(provider.endpoint)
    sock.send_multipart(encode(Hello(id=1, role="trainer", name="t", token=make_token(sub="t"))))
    assert sock.poll(3000) and decode(sock.recv_multipart()).type == "Welcome"
    for i in range(5):  # unassigned: each waits for the router's word, holding a slot meanwhile
        sock.send_multipart(encode(DatasetInfoRequest(id=10 + i, dataset="mnist")))
    replies = []
    while len(replies) < 5 and sock.poll(6000):
        replies.append(decode(sock.recv_multipart()))
    codes = {r.id: r.code for r in replies}
    assert codes == {10: "FORBIDDEN", 11: "FORBIDDEN", 12: "FORBIDDEN", 13: "RATE_LIMITED", 14: "RATE_LIMITED"}
    assert "3 requests of this session are in flight; at most 3" in next(r.message for r in replies if r.id == 13)


def test_a_session_over_its_rate_is_refused_counted_and_shown(router, start_provider, client_for, state_dir):
    provider = start_provider("mnist=" + MNIST, session_rate=10, session_burst=5)
    client = client_for(provider.endpoint)
    outcomes = []
    for _ in range(20):
        try:
            client.request(DatasetInfoRequest(dataset="mnist"))
            outcomes.append("ok")
        except RateLimited as err:
            assert "more than 10 requests/s (burst 5)" in str(err)
            outcomes.append("limited")
    # the burst, plus what 10/s refills while the 20 go out (a loaded machine is slower)
    assert 5 <= outcomes.count("ok") <= 12 and outcomes.count("limited") >= 8
    time.sleep(0.6)  # the bucket refills
    assert client.request(DatasetInfoRequest(dataset="mnist")).info["num_classes"] == 10
    limited = provider.service.server.counters["error_RATE_LIMITED"]
    assert limited == outcomes.count("limited")
    time.sleep(0.3)  # a heartbeat carries the counters to the router
    run = subprocess.run(
        [sys.executable, "-m", "cli", "queues", "--router", router.endpoint, "--state-dir", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert run.returncode == 0, run.stderr
    assert "refused" in run.stdout and f"RATE_LIMITED {limited}" in run.stdout


def test_a_message_over_the_total_size_cap_is_refused():
    from libbus.constants import MAX_MSG_BYTES

    big = np.zeros(MAX_MSG_BYTES // 8 + 1, np.uint8)  # calloc'd: no memory is touched
    frames = encode(BatchRequest(id=1, dataset="d", split="train", range=[0, 1])) + [memoryview(big)] * 8
    with pytest.raises(TooLarge, match="bytes in all"):
        decode(frames)


def test_revocations_outlive_a_restart_and_lapse_with_their_token(tmp_path):
    import sqlite3

    from services.router.grants import Revocations

    db = tmp_path / "router.db"
    now = time.time()
    revs = Revocations(sqlite3.connect(db, isolation_level=None))
    revs.revoke("live", now + 3600, "stolen")
    revs.revoke("lapsed", now - 60, "old")  # its token is dead anyway
    with pytest.raises(BadRequest, match="1 to 128 printable characters"):
        revs.revoke("x" * 500, now + 10, "")
    reopened = Revocations(sqlite3.connect(db, isolation_level=None))
    assert [r["jti"] for r in reopened.active()] == ["live"]
    assert reopened.jtis() == ["live"] and reopened.active(now + 3600 + 10) == []


def test_a_provider_that_has_not_heard_from_the_router_waits_instead_of_refusing(
    make_settings, client_for, make_token, tmp_path
):
    """A provider (re)started while its router link is still connecting knows no assignments yet: an assigned
    trainer's request must wait for the router's word, not be refused FORBIDDEN after ASSIGNMENT_WAIT_S (which
    failed a job whose provider was restarted on a loaded machine). Here the router is not even up yet."""
    from services.provider.admission import ASSIGNMENT_WAIT_S
    from services.provider.app import ProviderService
    from services.router.app import RouterService

    router_endpoint = f"ipc://{tmp_path}/router.sock"
    settings = make_settings(datasets=["mnist=" + MNIST], assigned_only=True, router=router_endpoint)
    provider = run_service(ProviderService(settings), settings)
    router = None
    try:
        t1 = make_token("trainer", sub="t1")
        reader = client_for(provider.endpoint, token=t1, timeout_s=60.0, retries=0)
        got: list = []
        asking = threading.Thread(target=lambda: got.append(reader.request(DatasetInfoRequest(dataset="mnist"))))
        asking.start()
        deadline = time.monotonic() + 30
        while not provider.service.handler.stats().get("waiting_assignment"):
            assert time.monotonic() < deadline, "the request never waited for an assignment"
            time.sleep(0.05)
        asking.join(ASSIGNMENT_WAIT_S + 2)  # past the wait a synced provider would give it
        assert asking.is_alive() and not got, "refused before the provider heard from the router"
        assert provider.service.handler.refused["unassigned"] == 0

        router_settings = make_settings(bind=router_endpoint)
        router = run_service(RouterService(router_settings), router_settings)
        admin = client_for(router.endpoint, role="admin")
        job = admin.request(SubmitJob(spec={"dataset": "mnist", "epochs": 1})).job
        on_router = client_for(router.endpoint, token=t1)
        on_router.identity.name = "t1"
        assert on_router.request(GetTask()).job == job
        asking.join(30)
        assert got and got[0].info["num_classes"] == 10  # served once the router's word came
    finally:
        provider.shutdown()
        if router is not None:
            router.shutdown()

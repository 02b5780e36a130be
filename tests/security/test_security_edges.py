"""Edges a security audit probed: each test does what the probe did, against real services, sockets,
shared memory and files, and shows the refusal.

- a token that has expired is refused at the connection handshake (before a frame is read);
- a loader that shrinks its ring after attaching it is refused, and the provider lives on;
- a batch of named fields beyond the byte limit is refused before it is read;
- peer strings reach an admin's terminal without their control characters;
- a hard link inside a ``file://`` dataset is refused.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import time
from pathlib import Path

import jwt
import numpy as np
import orjson
import pytest
import zmq

from libbus.config import host_id
from libbus.connect.client import Client, Identity
from libbus.connect.link import Link
from libbus.errors import AuthExpired, BadRequest, DatasetError, TooLarge
from libbus.loader.deliveries import ring_layout
from libbus.security.admission import admit_client
from libbus.security.auth import LEEWAY_S, ensure_secret, issue_token
from libbus.wire.messages import AttachRing, BatchRequest, DatasetInfoRequest, GetTask, ListPeers, PushResult
from services.provider.sources import open_source
from shm import Ring
from tests.support import CLUSTER, Cluster, busctl

# -- 13: expired tokens at the handshake --------------------------------------------------------


def _expired_token(secret: bytes, sub: str = "stale", ago_s: float = 3600) -> str:
    now = int(time.time())
    claims = {
        "sub": sub,
        "role": "trainer",
        "aud": CLUSTER,
        "iss": CLUSTER,
        "iat": now - int(ago_s) - 600,
        "nbf": now - int(ago_s) - 600,
        "exp": now - int(ago_s),
        "jti": f"jti-{sub}",
    }
    return jwt.encode(claims, secret, algorithm="HS256")


def _handshake_refused(sock: zmq.Socket, monitor: zmq.Socket, within_s: float = 20.0) -> bool:
    """Whether ``sock``'s handshake was refused by the server's ZAP handler within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if monitor.poll(100):
            event = zmq.utils.monitor.recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return True
    return False


@pytest.mark.parametrize("ago_s", [3600, 2 * LEEWAY_S])
def test_an_expired_token_is_refused_at_the_handshake_and_streams_nothing(router, provider, secret, ago_s):
    """The probe: a token that expired an hour ago passed the handshake and streamed 300 MiB into
    the router. Now the handshake refuses it (past the documented leeway), at the router and at a
    provider, so not one frame of what it sends is read; both services serve on."""
    for service in (router, provider):
        server = service.service.server
        refused = server.stats()["counters"].get("handshakes_refused", 0)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        admit_client(sock, _expired_token(secret, ago_s=ago_s))
        sock.connect(service.endpoint)
        try:
            for _ in range(64):  # what the probe streamed: nothing of it gets in
                try:
                    sock.send_multipart([b"\x00" * 65536] * 8, zmq.NOBLOCK)
                except zmq.Again:
                    break
            assert _handshake_refused(sock, monitor), "the expired token's handshake was not refused"
            assert not sock.poll(200), "an expired token got a reply"
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
        assert server.stats()["counters"]["handshakes_refused"] > refused
        assert not any(s.subject == "stale" for s in server.table.values())


def test_a_client_is_told_its_token_expired_and_a_minting_one_renews(router, client_for, secret, make_token):
    """A static expired token gets AUTH_EXPIRED (said at the handshake now, not at Hello); a client
    that mints its tokens, whose socket's token expired, says Hello again on a fresh socket."""
    with pytest.raises(AuthExpired, match="expired"):
        client_for(router.endpoint, token=_expired_token(secret, sub="static")).hello()
    tokens = [_expired_token(secret, sub="renewing"), make_token("trainer", sub="renewing")]
    renewing = Client(router.endpoint, Identity(role="trainer", name="renewing", token=lambda: tokens.pop(0)))
    try:
        assert renewing.hello().session
        assert tokens == []  # the expired one was refused, the fresh one admitted
    finally:
        renewing.close()


def test_a_service_whose_socket_token_expired_comes_back_to_a_restarted_router(tmp_path):
    """libzmq presents a socket's handshake token again at every reconnection: once it has expired
    the restarted router refuses it. A service that mints its tokens (here a provider with 1 s
    tokens) starts over on a fresh socket with a fresh token (its link's silence timeout, or its
    refused Hello: ``Link._renewable``), never giving up as it does on a token the router does not
    accept at all."""
    cluster = Cluster(tmp_path / "state")
    try:
        cluster.start_router()
        cluster.start(
            "provider", "provider", "--dataset", "m=mock://mnist?n=60", ready=True, env={"BATCHBUS_TOKEN_TTL_S": "1"}
        )
        cluster.endpoint_of("provider")

        def registered() -> bool:
            assert cluster.admin is not None
            return any(p["role"] == "provider" for p in cluster.admin.request(ListPeers()).peers)

        _wait_for(registered, 60, "the provider never registered")
        expired_at = time.time() + 1 + LEEWAY_S
        while time.time() <= expired_at:  # the token its link socket was made with has expired
            time.sleep(0.2)
        router = cluster.procs["router"]
        router.send_signal(signal.SIGKILL)
        router.wait(10)
        cluster.start_router(bind=cluster.endpoint)
        _wait_for(registered, 60, f"the provider did not come back\n{cluster.logs()}")
        assert cluster.procs["provider"].poll() is None
        assert "refused this service" not in (cluster.state / "provider.log").read_text()
    finally:
        cluster.close()


def test_a_router_link_refused_for_an_expired_token_renews_it(router, secret, make_token):
    """The router link of a service that mints its tokens, whose socket was made with a token that
    has expired (here the first two it mints), is refused at the handshake; it starts over on a fresh
    socket with a fresh token rather than stopping as on a token the router does not accept at all."""
    minted = [0]

    def token() -> str:
        minted[0] += 1
        return _expired_token(secret, sub="link") if minted[0] <= 2 else make_token("trainer", sub="link")

    link = Link(router.endpoint, Identity(role="trainer", name="link", token=token), heartbeat_ms=200).start()
    try:
        assert link.wait_connected(30), f"the link never connected: {link.fatal}"
        assert link.fatal is None and minted[0] > 2
    finally:
        link.close()


def test_a_hello_the_socket_cannot_queue_is_tried_again_not_fatal(router, make_token, monkeypatch):
    """A Hello that a fresh socket does not take ("send queue full", seen right after a renewal in a
    loaded run) is a lost Hello: the link starts over after the Hello timeout and connects, rather
    than stopping for good as on a token the router refuses."""
    import libbus.connect.client as client_module

    real, refused = client_module.send_message, [0]

    def first_hello_not_queued(sock, msg, *args, **kwargs):
        if type(msg).__name__ == "Hello" and not refused[0]:
            refused[0] += 1
            return False
        return real(sock, msg, *args, **kwargs)

    monkeypatch.setattr(client_module, "send_message", first_hello_not_queued)
    identity = Identity(role="trainer", name="queued", token=make_token("trainer", sub="queued"))
    link = Link(router.endpoint, identity, heartbeat_ms=200).start()
    try:
        assert link.wait_connected(30), f"the link never connected: {link.fatal}"
        assert link.fatal is None and refused[0] == 1
    finally:
        link.close()


def _wait_for(condition, timeout_s: float, why: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, why
        time.sleep(0.2)


def test_a_session_whose_token_expires_is_ended_at_its_next_message(provider, client_for, make_token):
    """A token that expires while its connection is open: the next request is AUTH_EXPIRED and the
    session is gone (``Server._on_frames``), within exp + the leeway."""
    client = client_for(provider.endpoint, token=make_token(ttl_s=1, sub="short"))
    assert client.request(DatasetInfoRequest(dataset="mnist")).info
    server = provider.service.server
    assert any(s.subject == "short" for s in server.table.values())
    claims_exp = next(s.claims.exp for s in server.table.values() if s.subject == "short")
    while time.time() <= claims_exp + LEEWAY_S:  # wait out exp and the leeway (a condition, not a timing)
        time.sleep(0.2)
    with pytest.raises(AuthExpired):
        client.request(DatasetInfoRequest(dataset="mnist"))
    assert not any(s.subject == "short" for s in server.table.values())


# -- 20: hard links in a file:// dataset ----------------------------------------------------------


def _npy_dataset(root: Path, n: int = 16) -> Path:
    root.mkdir(parents=True)
    np.save(root / "train_x.npy", np.arange(n * 4, dtype=np.float32).reshape(n, 4))
    np.save(root / "train_y.npy", np.arange(n, dtype=np.int64) % 2)
    return root


def test_a_hard_link_in_a_file_dataset_is_refused(tmp_path):
    """The probe: ``train_x.npy`` hard-linked to a file outside the directory was served, since a
    hard link's path really is under the directory. Now a file with more than one link is refused,
    by ``open_source`` and by ``busctl start provider`` (the reason, no traceback); the operator's
    ``?allow_hardlinks=1`` serves it."""
    outside = tmp_path / "private"
    outside.mkdir()
    secret = np.full((16, 4), 7.0, np.float32)
    np.save(outside / "secret.npy", secret)
    data = _npy_dataset(tmp_path / "data")
    (data / "train_x.npy").unlink()
    os.link(outside / "secret.npy", data / "train_x.npy")
    with pytest.raises(DatasetError, match=r"train_x.npy: is a hard link \(2 names"):
        open_source(f"file://{data}")
    out = busctl("start", "provider", "--dataset", f"d=file://{data}", "--state-dir", str(tmp_path / "st"), timeout=60)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "is a hard link" in out.stderr and "allow_hardlinks=1" in out.stderr
    allowed = open_source(f"file://{data}?allow_hardlinks=1")
    assert np.array_equal(allowed.read("train", np.arange(4))[0], secret[:4])
    # a dataset without links opens as before
    assert open_source(f"file://{_npy_dataset(tmp_path / 'plain')}").num_samples("train") > 0


def test_a_hard_link_made_after_the_check_is_refused_as_the_file_is_opened(tmp_path):
    """The check is on the file as opened (``fstat``), so a link made after a path was checked is
    caught when the provider opens it to read."""
    from services.provider.sources.storage.confine import Confinement

    data = _npy_dataset(tmp_path / "data")
    confinement = Confinement(data, (data,))
    confinement.check(data / "train_y.npy")  # one link: fine
    os.link(data / "train_y.npy", tmp_path / "elsewhere.npy")
    with pytest.raises(DatasetError, match="is a hard link"):
        confinement.open(data / "train_y.npy")


# -- 15: a batch of named fields is bounded before it is read -------------------------------------


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


@pytest.fixture
def fields_cluster(tmp_path):
    cluster = Cluster(tmp_path / "state")
    try:
        cluster.start_router()
        cluster.start("provider", "provider", "--dataset", "f=mock://fields?n=2000", ready=True)
        yield cluster
    finally:
        cluster.close()


def test_a_huge_batch_of_named_fields_is_refused_before_it_is_read(fields_cluster):
    """The probe: 2^18 indices of a named-field dataset were read whole on the serving loop (+566 MiB,
    9 s, another tenant's batch waiting) before the byte limit refused them. Now the request is
    refused from its index count and the fields' declared maxima before a sample is read: the
    provider's peak memory does not move, and another tenant's batch sent right after is served."""
    cluster = fields_cluster
    endpoint = cluster.endpoint_of("provider")
    pid = cluster.procs["provider"].pid
    secret = ensure_secret(cluster.state / "secret")

    def tenant(sub: str) -> Client:
        token = issue_token(secret, sub=sub, role="trainer", audience=CLUSTER, datasets=["f"])
        return Client(endpoint, Identity(role="trainer", name=sub, token=token), timeout_s=60, retries=0)

    mallory, alice = tenant("mallory"), tenant("alice")
    try:
        want = alice.request(BatchRequest(dataset="f", split="train", range=[0, 32]))  # warm: both sessions open
        mallory.hello()
        before = _peak_rss_mib(pid)
        huge = BatchRequest.for_indices(np.zeros(1 << 18, np.int64), dataset="f", split="train")
        mallory.send(huge)
        small = BatchRequest(dataset="f", split="train", range=[0, 32])
        alice.send(small)
        refusal = mallory.wait_for(huge.id, 60)
        served = alice.wait_for(small.id, 60)
        assert refusal is not None and served is not None
        with pytest.raises(TooLarge, match=r"262144 samples of \d+ bytes at most .* ask for at most \d+"):
            mallory.check(refusal)
        got = alice.check(served)
        assert got.names == want.names and [bytes(f) for f in got.frames] == [bytes(f) for f in want.frames]
        grown = _peak_rss_mib(pid) - before
        assert grown < 32, f"the provider's peak memory grew by {grown:.0f} MiB for a refused batch"
        assert cluster.procs["provider"].poll() is None
    finally:
        mallory.close()
        alice.close()


def test_the_bound_counts_declared_maxima_and_caps_undeclared_fields():
    """What check_batch_size allows: exact x/y sizes, the fields' declared maxima, and a sample cap
    where a variable field declares no maximum."""
    from libbus.constants import MAX_BATCH_BYTES, MAX_UNDECLARED_BATCH
    from libbus.wire.fields import Field
    from services.provider.destination import check_batch_size

    source = open_source("mock://fields?n=100")
    fields = source.fields
    per = 768 + 8 * 4 + 48 + 8 * 2 + 64 + 8 + 8  # image, tokens, text (max + index each), label
    check_batch_size(source, fields, MAX_BATCH_BYTES // per)
    with pytest.raises(TooLarge, match=f"ask for at most {MAX_BATCH_BYTES // per} samples"):
        check_batch_size(source, fields, MAX_BATCH_BYTES // per + 1)
    loose = [Field("text", "str", ()), Field("label", "int64", ())]
    check_batch_size(source, loose, MAX_UNDECLARED_BATCH)
    with pytest.raises(TooLarge, match="text declare no max_bytes"):
        check_batch_size(source, loose, MAX_UNDECLARED_BATCH + 1)


# -- 14: a ring shrunk after it was attached ------------------------------------------------------


@pytest.fixture
def mnist_cluster(tmp_path):
    cluster = Cluster(tmp_path / "state")
    try:
        cluster.start_router()
        cluster.start("provider", "provider", "--dataset", "mnist=mock://mnist?n=600", ready=True)
        yield cluster
    finally:
        cluster.close()


@pytest.mark.parametrize("keep", ["nothing", "the header only"])
def test_a_ring_shrunk_after_attaching_is_refused_and_the_provider_lives(mnist_cluster, keep):
    """The probe: a same-user loader attached its ring, then ``ftruncate``d it; the provider's next
    write into the slot died of SIGBUS. Now the provider checks the ring's size before it touches
    it: the request is refused (``batch not written: … was shrunk``), so is every later one naming
    that ring, and the provider (a real process) serves on."""
    cluster = mnist_cluster
    secret = ensure_secret(cluster.state / "secret")
    token = issue_token(secret, sub="loader", role="trainer", audience=CLUSTER, datasets=["mnist"])
    remote = Client(cluster.endpoint_of("provider"), Identity(role="trainer", name="l", token=token), timeout_s=30)
    ring = None
    try:
        info = remote.request(DatasetInfoRequest(dataset="mnist"))
        local = Client(
            info.local_endpoint,
            Identity(role="trainer", name="l", token=token, host_id=host_id()),
            timeout_s=30,
            retries=0,
        )
        ring = Ring.create(ring_layout(info.info, 16, 2))
        lay = ring.layout
        local.request(
            AttachRing(name=ring.name, slots=lay.slots, slot_bytes=lay.slot_bytes, label_offset=lay.label_offset)
        )
        seq = ring.request(0)
        assert local.request(BatchRequest(dataset="mnist", split="train", range=[0, 16], slot=0, seq=seq)).slot == 0
        ring.take(0, seq)
        ring.release(0)
        seq = ring.request(1)  # the next request is on its way: then the file shrinks
        with open(ring.segment.path, "r+b") as f:
            os.ftruncate(f.fileno(), 0 if keep == "nothing" else 4096)
        for slot in (1, 0):
            with pytest.raises(BadRequest, match="batch not written: .* was shrunk to"):
                local.request(BatchRequest(dataset="mnist", split="train", range=[0, 16], slot=slot, seq=seq))
        assert cluster.procs["provider"].poll() is None, "the provider died"
        x = remote.request(BatchRequest(dataset="mnist", split="train", range=[0, 16]))
        assert x.shapes[0] == [16, 1, 28, 28]
        local.close()
    finally:
        remote.close()
        if ring is not None:
            ring.close()


# -- 18: peer strings at an admin's terminal ------------------------------------------------------

#: What the probe's peers wrote: clear the screen, set the clipboard (OSC 52), overwrite the line,
#: reverse the text that follows (a bidi override).
HOSTILE = "\x1b[2J\x1b]52;c;ZWNobyBwd25lZA==\x07\rok \u202eevil"


def test_escape_sequences_from_peers_never_reach_the_admins_terminal(tmp_path):
    """The probe: a job named with escape sequences, and a trainer's error carrying more, were
    printed as they were by ``busctl job show``. Now every peer string is printed with its control
    characters escaped (``\\x1b[2J``): job show, jobs, the error line of a failed call; JSON output
    escapes them too."""
    cluster = Cluster(tmp_path / "state")
    try:
        cluster.start_router()
        job = cluster.submit_spec({"dataset": "mnist", "name": f"job{HOSTILE}", "epochs": 1})
        secret = ensure_secret(cluster.state / "secret")
        token = issue_token(secret, sub="t-evil", role="trainer", audience=CLUSTER)
        with Client(
            cluster.endpoint, Identity(role="trainer", name="t-evil", token=token, caps={"heartbeat": True})
        ) as t:
            task = t.request(GetTask(key="k1"))
            assert task.job == job
            t.request(PushResult(job=job, state="failed", error=f"boom{HOSTILE}"))
        cluster.wait_end(job)
        outputs = [
            cluster.busctl("job", "show", job),
            cluster.busctl("jobs"),
            cluster.busctl("job", "show", f"nosuch{HOSTILE}", check=False),  # the router's error quotes it
            cluster.busctl("job", "show", job, "--json"),
        ]
        for out in outputs:
            for stream in (out.stdout, out.stderr):
                assert not any(c in stream for c in "\x1b\x07\r\u202e"), f"raw control characters in {stream!r}"
        show, _, missing, as_json = outputs
        assert "job\\x1b[2J\\x1b]52;c;ZWNobyBwd25lZA==\\x07\\rok \\u202eevil" in show.stdout
        assert "boom\\x1b[2J" in show.stdout
        assert missing.returncode != 0 and "nosuch\\x1b[2J" in missing.stderr
        assert orjson.loads(as_json.stdout)["spec"]["name"] == f"job{HOSTILE}"  # JSON keeps the text, escaped
    finally:
        cluster.close()


def test_printable_escapes_what_a_terminal_acts_on():
    from cli.output import SafeConsole, print_json, printable

    assert printable("plain: ok [1/2] é 日本") == "plain: ok [1/2] é 日本"
    assert printable(HOSTILE) == "\\x1b[2J\\x1b]52;c;ZWNobyBwd25lZA==\\x07\\rok \\u202eevil"
    assert printable("two\nlines\tand tab") == "two\nlines\tand tab"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_json({"s": HOSTILE + "\U000e0001"})  # a tag character, beyond the BMP
    assert out.getvalue().isascii() and orjson.loads(out.getvalue()) == {"s": HOSTILE + "\U000e0001"}
    console = SafeConsole(file=io.StringIO(), color_system=None, width=200)
    console.print(f"job x[/bold]{HOSTILE}")  # a closing tag that opens nothing: printed, not an error
    text = console.file.getvalue()
    assert "\x1b" not in text and "x[/bold]\\x1b[2J" in text

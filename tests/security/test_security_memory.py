"""No peer exhausts a service: memory before authentication, the
evaluation oracle, and a flooding server against a client's deadline. Real processes and sockets;
resident memory is sampled from /proc."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zmq

from benchmarks.preauth_flood import run
from libbus.connect.client import Client, Identity
from libbus.connect.link import Link
from libbus.errors import BadRequest, PeerTimeout, RateLimited, TooLarge
from libbus.loader.remote import RemoteLoader
from libbus.security.admission import admit_client
from libbus.security.auth import ensure_secret, issue_token
from libbus.wire.messages import Evaluate, Stats
from tests.support import REPO

#: The bound: resident memory of the router and of a provider while a peer with no
#: token streams an endless multipart message (the 60 s run: python -m benchmarks.preauth_flood).
PREAUTH_BOUND_MIB = 64


def test_an_endless_multipart_message_without_a_token_leaves_memory_flat(tmp_path):
    out = run(tmp_path / "state", seconds=8.0)
    assert out["alive"], "a service died under the flood"
    for name in ("router", "provider"):
        r = out[name]
        assert r["sent_mib"] > PREAUTH_BOUND_MIB, f"the attack did not get going against the {name}: {r}"
        assert r["growth_mib"] <= PREAUTH_BOUND_MIB, f"{name} grew by {r['growth_mib']:.0f} MiB: {r}"


def test_a_wrong_token_is_refused_at_the_handshake_and_the_service_still_serves(
    router, client_for, make_token, tmp_path
):
    other_secret = ensure_secret(tmp_path / "elsewhere" / "secret")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    admit_client(sock, issue_token(other_secret, sub="mallory", role="admin", audience="batchbus"))
    sock.connect(router.endpoint)
    try:
        # whatever it sends goes nowhere: the connection never completes its handshake
        for _ in range(50):
            try:
                sock.send_multipart([b"\x00" * 65536] * 8, zmq.NOBLOCK)
            except zmq.Again:
                break
        assert not sock.poll(500)
    finally:
        sock.close(0)
    assert router.service.server.stats()["counters"]["handshakes_refused"] >= 1
    assert client_for(router.endpoint, role="admin").hello().session


def test_evaluations_are_capped_in_size_and_rate(start_provider, client_for, make_token):
    # so no token of the 2-per-minute buckets refills during the test
    from safetensors.torch import save as save_safetensors

    import services.provider.evaluator  # noqa: F401 - torch loaded up front: the evaluations below take no time,
    from services.models import build_model

    provider = start_provider("mnist=mock://mnist?n=600", eval_per_minute=2, eval_max_model_bytes=1 << 20)
    weights = save_safetensors(build_model("mlp", {"sample_shape": [1, 28, 28], "num_classes": 10}).state_dict())
    alice = client_for(provider.endpoint, token=make_token("trainer", sub="alice"), timeout_s=60)
    model = {"name": "mlp"}
    with pytest.raises(TooLarge, match=f"at most {1 << 20}"):
        alice.request(Evaluate(dataset="mnist", model=model, job="j1", frames=[b"\0" * ((1 << 20) + 1)]))
    # garbage naming a job is refused
    # on its weights and spends nothing
    for _ in range(5):
        with pytest.raises(BadRequest, match="not a valid safetensors"):
            alice.request(Evaluate(dataset="mnist", model=model, job="j1", frames=[b"not safetensors"]))
    outcomes = []
    for _ in range(3):  # valid weights: scored until the rate runs out
        try:
            outcomes.append(alice.request(Evaluate(dataset="mnist", model=model, job="j1", frames=[weights])).type)
        except RateLimited as err:
            outcomes.append(f"limited: {err}")
    assert outcomes[:2] == ["Evaluation", "Evaluation"] and "per minute for subject 'alice'" in outcomes[2]
    # another of alice's jobs: her subject's rate is spent too (refused before the weights are read)
    with pytest.raises(RateLimited, match="subject 'alice'"):
        alice.request(Evaluate(dataset="mnist", model=model, job="j2", frames=[b"x"]))
    # someone else on the same job: the job's rate is spent (once the weights proved valid)
    bob = client_for(provider.endpoint, token=make_token("trainer", sub="bob"), timeout_s=60)
    with pytest.raises(RateLimited, match="for job j1"):
        bob.request(Evaluate(dataset="mnist", model=model, job="j1", frames=[weights]))
    refused = provider.service.handler.stats()["refused"]
    assert refused["evaluate_rate"] == 3 and refused["evaluate_too_large"] == 1


def test_the_evaluation_queue_is_bounded(start_provider, client_for, make_token):
    provider = start_provider("mnist=mock://mnist?n=600", eval_queue=1)
    gate = provider.service.handler.evalgate
    c = client_for(provider.endpoint, token=make_token("trainer", sub="carol"), timeout_s=60)
    gate.admit("someone", 1)  # an evaluation holds the only place (as a slow one would)
    with pytest.raises(RateLimited, match="1 evaluations are queued or running here; at most 1"):
        c.request(Evaluate(dataset="mnist", model={"name": "mlp"}, job="b", frames=[b"x"]))
    gate.finished()  # it ends: the next one is admitted (and judged on its weights)
    with pytest.raises(BadRequest, match="not a valid safetensors"):
        c.request(Evaluate(dataset="mnist", model={"name": "mlp"}, job="b", frames=[b"x"]))
    stats = provider.service.handler.stats()
    assert stats["evaluations_queued"] == 0 and stats["refused"]["evaluate_queue_full"] == 1


#: A misbehaving service, run as a process of its own: it admits any token, welcomes, answers
#: DatasetInfo, then floods heartbeats and stale replies, never answering anything else. It prints its
#: endpoint, and writes how many messages it has flooded to the file named by its argument.
FLOODER = """
import os, sys, zmq
from libbus.security.admission import TokenAuthenticator, admit_server
from libbus.wire.messages import DatasetInfo, Heartbeat, Ok, Welcome, decode, encode
from services.provider.sources import open_source
from tests.support import REPO

count = sys.argv[1]
info = open_source("mock://mnist?n=600").info()
ctx = zmq.Context()
auth = TokenAuthenticator(ctx, lambda token: "anyone")
auth.start()
sock = ctx.socket(zmq.ROUTER)
sock.setsockopt(zmq.LINGER, 0)
admit_server(sock)
print(f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}", flush=True)
flood = (encode(Heartbeat(stats={})), encode(Ok(id=999_999)))
peer, sent, told = None, 0, 0
while True:
    if sock.poll(0 if peer is not None else 100):
        frames = sock.recv_multipart()
        peer, msg = frames[0], decode(frames[1:])
        if msg.type == "Hello":
            sock.send_multipart([peer, *encode(Welcome(id=msg.id, session="s", heartbeat_ms=1000))])
        elif msg.type == "DatasetInfoRequest":  # looks like a provider, until asked for data
            sock.send_multipart([peer, *encode(DatasetInfo(id=msg.id, dataset=msg.dataset, info=info))])
    if peer is not None:  # encoded once: the flood outpaces a client decoding each message
        for _ in range(500):
            try:
                sock.send_multipart([peer, *flood[sent % 2]], zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                break
        if sent - told >= 1000:
            with open(count + ".tmp", "w") as f:
                f.write(str(sent))
            os.replace(count + ".tmp", count)
            told = sent
"""


class FloodingServer:
    """:data:`FLOODER` in a process of its own, killed by :meth:`close`: a peer's process ends as it
    may, and its end (libzmq tearing down a ROUTER whose pipes it floods, which aborted a test worker
    under load when this server was a thread of it) is not the test's. ``sent``: messages flooded so far."""

    def __init__(self, folder: Path):
        self.count = folder / "flooded"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", FLOODER, str(self.count)], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        self.endpoint = self.proc.stdout.readline().strip() if self.proc.stdout else ""
        assert self.endpoint.startswith("tcp://"), f"the flooding server did not start ({self.proc.poll()})"

    @property
    def sent(self) -> int:
        try:
            return int(self.count.read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


def test_a_flooding_server_cannot_hold_a_client_past_its_deadline(make_token, tmp_path):
    server = FloodingServer(tmp_path)
    endpoint = server.endpoint
    outcome: list = []
    client = Client(endpoint, Identity(role="trainer", name="t", token=make_token("trainer")), timeout_s=1.0, retries=1)

    def ask() -> None:
        try:
            client.request(Stats())
            outcome.append("answered")
        except PeerTimeout as err:
            outcome.append(err)

    worker = threading.Thread(target=ask, daemon=True)
    try:
        worker.start()
        worker.join(60)  # far past 2 x 1 s: a client that ignored its deadline is still inside
        assert not worker.is_alive(), "the client ignored its deadline while the server flooded it"
        assert isinstance(outcome[0], PeerTimeout), outcome
        assert server.sent > 1000, "the server never got to flood"
    finally:
        worker.join(5)
        client.close()
        server.close()


def test_a_flooding_provider_cannot_hold_a_loader_past_its_deadline(make_token, tmp_path):
    server = FloodingServer(tmp_path)
    endpoint = server.endpoint
    outcome: list = []
    loaders: list = []

    def iterate() -> None:
        try:
            loader = RemoteLoader(
                "mnist",
                token=make_token("trainer"),
                provider=endpoint,
                batch_size=8,
                timeout_s=1.0,
                retries=0,
                provider_wait_s=0,
                shm=False,
            )
            loaders.append(loader)
            for _ in loader:
                outcome.append("a batch from nowhere")
                return
        except PeerTimeout as err:
            outcome.append(err)
        except Exception as err:  # noqa: BLE001 - recorded, asserted below
            outcome.append(err)

    worker = threading.Thread(target=iterate, daemon=True)
    try:
        worker.start()
        worker.join(90)
        assert not worker.is_alive(), "the loader ignored its deadline while the provider flooded it"
        assert isinstance(outcome[0], PeerTimeout), outcome
        assert server.sent > 1000, "the server never got to flood"
    finally:
        worker.join(5)
        for loader in loaders:
            loader.close()
        server.close()


def test_a_flooding_router_cannot_hold_a_service_link_past_its_deadline(make_token, tmp_path):
    server = FloodingServer(tmp_path)
    endpoint = server.endpoint
    link = Link(endpoint, Identity(role="trainer", name="t", token=make_token("trainer")), heartbeat_ms=100).start()
    outcome: list = []

    def ask() -> None:
        try:
            link.request(Stats(), timeout_s=1.0)
            outcome.append("answered")
        except PeerTimeout as err:
            outcome.append(err)

    worker = threading.Thread(target=ask, daemon=True)
    try:
        assert link.wait_connected(10)
        worker.start()
        worker.join(60)
        assert not worker.is_alive(), "the link ignored its request's deadline while the router flooded it"
        assert isinstance(outcome[0], PeerTimeout), outcome
        assert server.sent > 1000, "the server never got to flood"
    finally:
        worker.join(5)
        link.close()
        server.close()

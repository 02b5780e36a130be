"""A client of this wire version calling a service of the previous one gets a clear error at once,
naming both versions, instead of waiting out its timeout. The old service is a loopback ROUTER that
answers as a version-1 batchbus service did: an ``Error`` under its own tag ``BB1`` (no version-1
release is installed here to run)."""

from __future__ import annotations

import threading
import time

import orjson
import pytest
import zmq

from libbus import PROTOCOL, RemoteLoader
from libbus.connect.client import Client, Identity
from libbus.errors import BadRequest
from libbus.security.admission import TokenAuthenticator, admit_server


class OldService:
    """A version-1 service: every message refused under ``BB1``, as its decoder refused an unknown tag."""

    def __init__(self):
        self.ctx = zmq.Context()
        # the connection handshake is the same in both versions: admit any token, as that is not the point
        self.auth = TokenAuthenticator(self.ctx, verify=lambda token: "old")
        self.auth.start()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        admit_server(self.sock)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            routing, tag, head, *_ = self.sock.recv_multipart()
            refusal = {"type": "Error", "id": orjson.loads(head).get("id", 0), "code": "BAD_REQUEST"}
            refusal["message"] = f"unknown protocol tag {tag!r}; expected b'BB1'"
            self.sock.send_multipart([routing, b"BB1", orjson.dumps(refusal)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.sock.close()
        self.auth.terminate()  # terminates ctx, the handler answering until its last connection is gone


@pytest.fixture
def old_service():
    service = OldService()
    yield service
    service.close()


def test_a_client_calling_an_older_service_is_told_both_versions_at_once(old_service, make_token):
    client = Client(old_service.endpoint, Identity(role="trainer", name="new", token=make_token()), timeout_s=20)
    started = time.monotonic()
    try:
        with pytest.raises(BadRequest) as refused:
            client.hello(20)
    finally:
        client.close()
    assert time.monotonic() - started < 5, "the refusal is the answer: no waiting out the timeout"
    message = str(refused.value)
    assert f"{old_service.endpoint} speaks batchbus wire version 1 (b'BB1')" in message
    assert f"this client version 2 ({PROTOCOL!r})" in message and "same batchbus release" in message


def test_a_loader_pointed_at_an_older_provider_fails_clearly(old_service, make_token):
    started = time.monotonic()
    with pytest.raises(BadRequest, match=r"wire version mismatch: .* version 1 \(b'BB1'\), this client version 2"):
        with RemoteLoader("d", provider=old_service.endpoint, token=make_token(), batch_size=4) as loader:
            next(iter(loader))
    assert time.monotonic() - started < 10

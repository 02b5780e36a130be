"""What the seed corpus's lines may ask for beyond raw frames (tests/fuzz_corpus/README.md): sessions
of every token kind (scoped, reader, expired, revoked), weights of a built-in model, the expected
reply to a message, and a connection whose handshake must be refused.

Used by ``tests/security/test_fuzz.py::test_seed_corpus``; the world it acts on is :class:`tests.support.fuzz.World`.
"""

from __future__ import annotations

import re
import time

import jwt
import orjson
import zmq
import zmq.utils.monitor

from libbus import PROTOCOL
from libbus.security.admission import admit_client
from libbus.security.auth import inspect_token
from libbus.wire.messages import RevokeToken
from tests.support.fuzz import REPLY_TIMEOUT_S, Peer, World, head
from tests.support.services import CLUSTER

__all__ = ["assert_reply", "expect_handshake_refused", "say_hello", "session_token", "weights"]

#: ``role[ds1,ds2]``: a token of ``role`` whose datasets scope is those datasets.
SCOPED = re.compile(r"(trainer|reader|admin|provider)\[([^\]]*)\]")
#: How long before now an ``expired`` token expired: an hour, as the audit's probe (far past the leeway).
EXPIRED_AGO_S = 3600


def session_token(world: World, secret: bytes, kind: str) -> tuple[str, str, dict]:
    """``(role, token, default caps)`` of a corpus ``session`` kind (README.md lists them)."""
    if kind == "expired":
        now = int(time.time())
        claims = {
            "sub": "corpus-expired",
            "role": "trainer",
            "aud": CLUSTER,
            "iss": CLUSTER,
            "iat": now - EXPIRED_AGO_S - 600,
            "nbf": now - EXPIRED_AGO_S - 600,
            "exp": now - EXPIRED_AGO_S,
            "jti": "corpus-expired",
        }
        return "trainer", jwt.encode(claims, secret, algorithm="HS256"), {}
    if kind == "revoked":  # revoked by the world's admin before the line runs, expiry still ahead
        token = world.make_token("trainer", sub="corpus-revoked")
        jti = inspect_token(token)[1]["jti"]
        world.admin.request(RevokeToken(jti=jti, exp=time.time() + 600))
        # the router applies it at once; a provider when the router's next Entitlements push arrives
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while jti not in world.pserver.tokens.revoked:
            assert time.monotonic() < deadline, "the provider never heard of the revocation"
            time.sleep(0.02)
        return "trainer", token, {}
    scoped = SCOPED.fullmatch(kind)
    if scoped:
        role, datasets = scoped[1], [d for d in scoped[2].split(",") if d]
        token = world.make_token(role, sub=f"corpus-{role}", datasets=datasets)
    else:
        role, token = kind, world.token(kind)
    # a reader's token opens loader sessions only: RemoteLoader says Hello with caps.loader
    return role, token, {"loader": True} if role == "reader" else {}


def say_hello(world: World, peer: Peer, role: str, token: str, caps: dict) -> dict:
    """Send a Hello with ``token`` on ``peer`` and return the reply (Welcome or Error)."""
    peer.send(
        [
            PROTOCOL,
            head(type="Hello", id=1, role=role, name=f"fuzz-{role}", token=token, host_id=world.host_id, caps=caps),
        ]
    )
    # (a provider's session is pushed its Entitlements right after its Welcome)
    replies = [r for r in peer.drain() if r["type"] not in ("Heartbeat", "Entitlements")]
    assert replies, "no reply to Hello"
    return replies[-1]


def assert_reply(reply: dict, expect: str, says: str = "") -> None:
    """``expect`` is a reply type (``Evaluation``, ``Welcome``, ``Error`` for any refusal) or an error
    code (``FORBIDDEN``): the one refusal this message must get. ``says``: a phrase its message holds
    (which check refused it, where two checks give one code)."""
    if expect.isupper():
        assert reply["type"] == "Error" and reply["code"] == expect, f"expected {expect}, got {reply}"
    else:
        assert reply["type"] == expect, f"expected {expect}, got {reply}"
    assert says in reply.get("message", ""), f"expected the refusal to say {says!r}: {reply}"


def weights(world: World, spec: list) -> bytes:
    """``["mlp", {"hidden": 4}, "nan"]``: safetensors weights of that built-in model for the world's
    mnist, every value ``nan`` or ``zeros``."""
    import torch  # only the lines that send weights pay for it
    from safetensors.torch import save as save_safetensors

    from services.models import build_model

    name, kwargs, fill = spec
    value = {"nan": float("nan"), "zeros": 0.0}[fill]
    model = build_model(name, world.mnist.info(), kwargs)
    return save_safetensors({k: torch.full_like(v, value).contiguous() for k, v in model.state_dict().items()})


def expect_handshake_refused(world: World, service: str, token: str, messages: list[list[bytes]]) -> None:
    """Connect with ``token`` in the handshake and send ``messages``: the service's ZAP handler must
    refuse the connection (counted), nothing must come back, and no session of the token's subject
    may exist."""
    running = world.router if service == "router" else world.provider
    server = running.service.server
    refused = server.stats()["counters"].get("handshakes_refused", 0)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    admit_client(sock, token)
    sock.connect(running.endpoint)
    try:
        for frames in messages:
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:  # nothing is admitted: the queue before the handshake fills
                break
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        failed = False
        while not failed and time.monotonic() < deadline:
            if monitor.poll(100):
                failed = zmq.utils.monitor.recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        assert failed, f"the {service}'s handshake admitted the token"
        assert not sock.poll(200), f"a refused connection got a reply: {orjson.loads(sock.recv_multipart()[1])}"
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
    assert server.stats()["counters"]["handshakes_refused"] > refused
    subject = inspect_token(token)[1]["sub"]
    assert not any(s.subject == subject for s in server.table.values()), "a refused token holds a session"

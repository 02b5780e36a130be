"""Hostile frames against a real router and a real provider: nothing crashes, leaks, or writes out of turn.

Generated messages (hypothesis) go through bare DEALER sockets to services running in this process on
loopback TCP: any frames at all (random bytes, wrong tags, truncated or typed-but-hostile headers) and
huge index frames. After every generated batch the test checks that each service still answers a
well-formed request correctly, that the process's resident memory stays bounded, that a ring slot a
legitimate trainer holds IN_USE never changed, and that every Error sent back was counted (the world
and these checks are in tests/support/fuzz.py; the service-level fuzz is in tests/security/test_fuzz_services.py).

``tests/fuzz_corpus/*.jsonl`` holds hand-written hostile messages (and past crashes), replayed by a
plain test so they stay covered whatever hypothesis generates.
"""

from __future__ import annotations

import time

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libbus import PROTOCOL
from libbus.constants import MAX_BATCH_INDICES
from libbus.errors import BusError
from libbus.wire.messages import GetJob, ListPeers, Resolve, Stats
from tests.support import REPO
from tests.support.corpus import assert_reply, expect_handshake_refused, say_hello, session_token, weights
from tests.support.fuzz import (
    FUZZ,
    drain_all,
    fire,
    head,
    nested,
    raw_message,
    world_fixture,  # noqa: F401 - the `world` fixture
)

CORPUS = REPO / "tests" / "fuzz_corpus"


# -- the fuzz tests ------------------------------------------------------------------------------


@settings(max_examples=150, **FUZZ)
@given(
    batch=st.lists(raw_message(), min_size=10, max_size=30),
    service=st.sampled_from(["router", "provider"]),
    authed=st.sampled_from([None, "trainer", "admin"]),
)
def test_any_frames_leave_both_services_answering(world, batch, service, authed):
    peer = world.peer(service)
    if authed:
        peer.hello(world.token(authed), authed, host_id=world.host_id)
    server = world.rserver if service == "router" else world.pserver
    replies = fire(world, peer, server, batch)
    if authed is None:  # before Hello nothing is served: only Welcome (a lucky Hello) or Error
        assert {r["type"] for r in replies} <= {"Error", "Welcome"}
    world.check()


def test_huge_index_frames_are_refused_or_served_without_growing(world):
    peer = world.peer("provider")
    peer.hello(world.token(), host_id=world.host_id)
    zeros = world.handler.datasets["zeros"]
    cases = [
        (np.zeros(MAX_BATCH_INDICES + 1, "<i8").tobytes(), "TOO_LARGE"),
        (np.zeros(MAX_BATCH_INDICES, "<i8").tobytes() + b"\0", "BAD_REQUEST"),
        (np.full(MAX_BATCH_INDICES, zeros.num_samples("train"), "<i8").tobytes(), "OUT_OF_RANGE"),
        (np.full(MAX_BATCH_INDICES, -1, "<i8").tobytes(), "OUT_OF_RANGE"),
    ]
    for _ in range(3):
        for frame, code in cases:
            peer.send([PROTOCOL, head(type="BatchRequest", id=1, dataset="zeros", split="train"), frame])
            replies = peer.drain()
            assert replies[0]["type"] == "Error" and replies[0]["code"] == code, replies
        peer.send(
            [
                PROTOCOL,
                head(type="BatchRequest", id=2, dataset="zeros", split="train"),
                np.zeros(MAX_BATCH_INDICES, "<i8").tobytes(),
            ]
        )
        reply = drain_all(peer, world.pserver)[0]  # read on a lane off the loop: a deferred reply
        assert reply["type"] == "BatchResponse" and reply["shapes"][0][0] == MAX_BATCH_INDICES
    world.check()


# -- the seed corpus -------------------------------------------------------------------------------


def corpus_cases() -> list:
    cases = []
    for path in sorted(CORPUS.glob("*.jsonl")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip() and not line.startswith("#"):
                case = orjson.loads(line)
                marks = [pytest.mark.xfail(strict=True, reason=case["xfail"])] if case.get("xfail") else []
                cases.append(pytest.param(case, id=f"{path.stem}:{n}:{case['name']}", marks=marks))
    return cases


def corpus_frames(case: dict, world=None) -> list[bytes]:
    """A corpus message: ``hex``, ``text`` or ``json`` frames (``%JOB%`` in json: the world's job),
    ``nest`` (deeply nested field), ``repeat``, or ``weights`` of a built-in model."""
    frames = []
    for f in case["frames"]:
        if "hex" in f:
            frames.append(bytes.fromhex(f["hex"]))
        elif "json" in f:
            frames.append(orjson.dumps(f["json"]).replace(b"%JOB%", world.job.encode() if world else b""))
        elif "text" in f:
            frames.append(f["text"].encode())
        elif "nest" in f:  # {"nest": [depth, kind], "into": header, "at": field}
            depth, kind = f["nest"]
            body = orjson.dumps(f["into"])[:-1] + f',"{f["at"]}":'.encode() + nested(depth, kind) + b"}"
            frames.append(body)
        elif "repeat" in f:
            frames.append(bytes.fromhex(f["repeat"][0]) * f["repeat"][1])
        elif "weights" in f:  # ["mlp", {kwargs}, "nan" | "zeros"]
            frames.append(weights(world, f["weights"]))
    return frames


@pytest.fixture
def provider(start_provider):
    """The conftest's provider, and a dataset of named fields (its batch bound in bytes)."""
    return start_provider(
        "mnist=mock://mnist?n=600", "zeros=dummy://?shape=2,3&n=100&classes=4", "fields=mock://fields?n=64"
    )


@pytest.mark.parametrize("case", corpus_cases())
def test_seed_corpus(world, secret, case):
    """Each line: which service, which session (none, a role, a scoped, reader, expired or revoked
    token; heartbeat caps), the messages to send and the reply each must get, then a well-formed
    request that must still be answered."""
    server = world.rserver if case["service"] == "router" else world.pserver
    if case.get("session"):
        role, token, caps = session_token(world, secret, case["session"])
        caps = case.get("caps", caps)
        if role == "provider":
            caps = {"endpoint": "tcp://127.0.0.1:1", "datasets": {}, **caps}
        if case.get("at") == "handshake":  # the token rides in the connection handshake too
            frames = [corpus_frames(msg, world) for msg in case["messages"]]
            expect_handshake_refused(world, case["service"], token, frames)
            world.check()
            return
        peer = world.peer(case["service"])
        assert_reply(say_hello(world, peer, role, token, caps), case.get("hello_expect", "Welcome"))
    else:
        peer = world.peer(case["service"])
    if case.get("hello_text"):  # a Hello written out by hand; %TOKEN% is a valid token of its role
        hello = orjson.loads(case["hello_text"].replace("%TOKEN%", "x"))
        peer.send([PROTOCOL, case["hello_text"].replace("%TOKEN%", world.token(hello["role"])).encode()])
        assert peer.drain()[-1]["type"] == case.get("hello_expect", "Welcome")
    if any("expect" in msg for msg in case["messages"]):  # one at a time, each reply checked
        for msg in case["messages"]:
            frames = corpus_frames(msg, world)
            replies = fire(world, peer, server, [frames])
            if "expect" in msg:
                sent = orjson.loads(frames[1])["id"]
                mine = [r for r in replies if r.get("id") == sent and r["type"] != "Heartbeat"]
                assert len(mine) == 1, f"{len(mine)} replies to message {sent}: {replies[-3:]}"
                assert_reply(mine[0], msg["expect"], msg.get("says", ""))
    else:
        fire(world, peer, server, [corpus_frames(msg, world) for msg in case["messages"]])
    time.sleep(case.get("settle_s", 0))
    for name in case.get("then", []):  # follow-up requests a legitimate peer makes
        other = world.trainer if name == "Stats@provider" else world.admin
        msg = {
            "Stats@router": Stats(),
            "ListPeers": ListPeers(),
            "Stats@provider": Stats(),
            "Resolve@router": Resolve(dataset="evil"),
        }[name]
        try:
            other.request(msg)
        except BusError:  # a refusal is an answer; a dead loop is not (world.check finds it)
            pass
    if case.get("job_state"):  # what the line tried must not have moved the world's job
        assert world.admin.request(GetJob(job=world.job)).job["state"] == case["job_state"]
    world.check()
    assert server.counters["internal"] == 0

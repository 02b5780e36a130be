"""Hostile-input helpers for tests/security/test_fuzz.py and tests/security/test_fuzz_services.py: a bare DEALER peer that
drains every reply, resident memory, the servers' refusal counts, hypothesis strategies for hostile frames
and requests, and the world they are fired at (services, sessions and a ring slot held IN_USE)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck
from hypothesis import strategies as st

from libbus import PROTOCOL
from libbus.constants import MAX_BATCH_INDICES, MAX_FRAMES
from libbus.serve.sessions import without_host_keys
from libbus.wire.messages import (
    MESSAGE_TYPES,
    AttachRing,
    BatchRequest,
    DatasetInfo,
    DatasetInfoRequest,
    GetJob,
    JobInfo,
    ListPeers,
    PeerList,
    SubmitJob,
    decode,
    encode,
)
from libbus.wire.schema import schema_of
from shm import Ring, RingLayout

__all__ = [
    "ABSURD_INTS",
    "FUZZ",
    "JSON",
    "REPLY_TIMEOUT_S",
    "RSS_BOUND",
    "SENT",
    "Peer",
    "World",
    "batch_request",
    "fire",
    "head",
    "nested",
    "raw_message",
    "refusals",
    "rss",
    "typed_header",
    "world_fixture",
]

SENTINEL_ID = 2**62
#: Messages sent by every Peer in this run (sentinels included), for the record.
SENT = [0]
REPLY_TIMEOUT_S = 10.0


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def head(**fields) -> bytes:
    return orjson.dumps(fields)


class Peer:
    """A bare DEALER: sends any frames, then drains replies up to a sentinel so none is missed."""

    def __init__(self, raw_dealer, endpoint: str):
        self.sock = raw_dealer(endpoint)
        self.sent = 0

    def send(self, frames: list) -> None:
        self.sock.send_multipart(frames, copy=len(frames) < 4 and sum(len(f) for f in frames) < 65536)
        self.sent += 1
        SENT[0] += 1

    def hello(self, token: str, role: str = "trainer", host_id: str = "", caps: dict | None = None) -> dict:
        self.send(
            [
                PROTOCOL,
                head(type="Hello", id=1, role=role, name=f"fuzz-{role}", token=token, host_id=host_id, caps=caps or {}),
            ]
        )
        replies = self.drain()
        assert replies and replies[-1]["type"] == "Welcome", replies
        return replies[-1]

    def drain(self) -> list[dict]:
        """Every reply to what was sent so far: a malformed sentinel's Error comes back last."""
        self.send([PROTOCOL, head(type="NoSuchType", id=SENTINEL_ID)])
        out = []
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"service stopped answering (replies so far: {out[-3:]})"
            if not self.sock.poll(int(left * 1000)):
                continue
            frames = self.sock.recv_multipart()
            if frames[0] != PROTOCOL:  # only the refusal of another wire version, under its tag
                assert re.fullmatch(rb"BB[0-9]{1,4}", frames[0]), frames[0]
                assert orjson.loads(frames[1])["type"] == "Error", frames
                frames = [PROTOCOL, *frames[1:]]
            decode(frames)  # whatever a service sends must itself be well-formed
            h = orjson.loads(frames[1])
            if h.get("id") == SENTINEL_ID and h["type"] == "Error":
                return out
            out.append(h)

    def request(self, msg) -> tuple[dict, list]:
        self.send(encode(msg))
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no reply to {msg.type}"
            if self.sock.poll(int(left * 1000)):
                frames = self.sock.recv_multipart()
                h = orjson.loads(frames[1])
                if h.get("id") == msg.id and h["type"] != "Heartbeat":
                    return h, frames[2:]


def refusals(server) -> int:
    """Errors the server says it sent: malformed, by code, and internal."""
    c = server.counters
    return c["malformed"] + c["internal"] + sum(v for k, v in c.items() if k.startswith("error_"))


def nested(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


# -- strategies ----------------------------------------------------------------------------------

ABSURD_INTS = st.sampled_from(
    [
        0,
        -1,
        1,
        2**31 - 1,
        2**31,
        2**32,
        2**63 - 1,
        -(2**63),
        2**64 - 1,
        MAX_BATCH_INDICES,
        MAX_BATCH_INDICES + 1,
        63,
        64,
        65,
    ]
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    ABSURD_INTS,
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(
        [
            "",
            "\x00",
            "../" * 20,
            "a" * 70000,
            "train",
            "test",
            "validation",
            "mnist",
            "zeros",
            "trainer",
            "admin",
            "provider",
        ]
    ),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12,
)
TYPES = sorted(MESSAGE_TYPES)


@st.composite
def typed_header(draw) -> bytes:
    """A header of a real message type whose fields are absent, of the wrong type, or absurd."""
    mtype = draw(st.sampled_from(TYPES))
    out = {"type": mtype, "id": draw(st.one_of(st.integers(0, 2**40), JSON))}
    for name in schema_of(MESSAGE_TYPES[mtype]):
        if name == "id" or draw(st.integers(0, 5)) == 0:
            continue
        out[name] = draw(JSON)
    raw = orjson.dumps(out)
    tweak = draw(st.integers(0, 9))
    if tweak == 0:  # NaN / Infinity are not JSON: a decoder must refuse them, not take them as floats
        raw = raw[:-1] + b',"x":' + draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999"])) + b"}"
    elif tweak == 1:  # deep nesting in some field
        raw = raw[:-1] + b',"x":' + nested(draw(st.integers(200, 1100)), draw(st.sampled_from(["list", "dict"]))) + b"}"
    elif tweak == 2:  # truncated
        raw = raw[: draw(st.integers(0, len(raw)))]
    return raw


@st.composite
def raw_message(draw) -> list[bytes]:
    """Any frames at all: random, wrong tag, truncated, typed-but-hostile headers, extra payload."""
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(st.lists(st.binary(max_size=128), min_size=1, max_size=MAX_FRAMES + 4))
    tag = draw(st.sampled_from([PROTOCOL, PROTOCOL, PROTOCOL, b"", b"BB0", b"BB1", b"bb1", PROTOCOL + b"\x00"]))
    header = draw(typed_header()) if kind != 1 else draw(st.binary(max_size=256))
    payload = draw(st.lists(st.binary(max_size=64), max_size=3))
    if kind == 5:
        payload = draw(st.lists(st.binary(max_size=8), min_size=MAX_FRAMES - 2, max_size=MAX_FRAMES + 2))
    return [tag, header, *payload]


INDEX_VALUES = st.one_of(
    st.integers(-(2**63), 2**63 - 1), st.sampled_from([-1, 0, 99, 100, 599, 600, 2**63 - 1, -(2**63)])
)


@st.composite
def batch_request(draw, slot_seq: bool) -> list[bytes]:
    """A well-typed BatchRequest with hostile dataset/split/range/indices (and slot/seq if asked)."""
    fields = {
        "type": "BatchRequest",
        "id": draw(st.integers(1, 2**40)),
        "dataset": draw(st.sampled_from(["mnist", "zeros", "nope", ""])),
        "split": draw(st.sampled_from(["train", "train", "test", "validation", "../train", ""])),
    }
    frames = []
    form = draw(st.integers(0, 3))
    if form == 0:
        fields["range"] = draw(
            st.one_of(
                st.lists(INDEX_VALUES, max_size=3), st.tuples(st.integers(-5, 700), st.integers(-5, 700)).map(list)
            )
        )
    elif form == 1:
        frames = [np.array(draw(st.lists(INDEX_VALUES, max_size=64)), dtype="<i8").tobytes()]
    elif form == 2:
        frames = [draw(st.binary(max_size=100))]
    if slot_seq:
        for key in ("slot", "seq"):
            if draw(st.integers(0, 4)):
                fields[key] = draw(st.one_of(ABSURD_INTS, st.integers(-5, 70), JSON))
    return [PROTOCOL, orjson.dumps(fields), *frames]


# -- the environment: services, a legitimate trainer with a ring ---------------------------------

FUZZ = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
}
#: Resident memory the whole fuzz run may add to this process (services run in-process).
RSS_BOUND = 300 * 1024 * 1024


class World:
    """Router, provider, legitimate admin/trainer sessions, and a ring slot held IN_USE."""

    def __init__(self, router, provider, raw_dealer, make_token, client_for):
        self.router, self.provider = router, provider
        self.rserver, self.pserver = router.service.server, provider.service.server
        self.handler = provider.service.handler
        self.host_id = self.handler.host_id
        self.make_token, self.raw_dealer = make_token, raw_dealer
        self.admin = client_for(router.endpoint, role="admin")
        self.job = self.admin.request(SubmitJob(spec={"dataset": "mnist", "epochs": 1})).job
        # Rings are offered over the provider's same-host ipc endpoint (over TCP they are refused).
        self.local = self.handler.local_endpoint
        self.trainer = client_for(self.local, role="trainer", host_id=self.host_id)
        src = self.handler.datasets["mnist"]
        self.mnist = src
        x = np.empty((8, *src.sample_shape), src.dtype)
        y = np.empty((8, *src.label_shape), src.label_dtype)
        src.read_into("train", np.arange(8, dtype=np.int64), x, y)
        self.expected = (x.tobytes(), y.tobytes())
        layout = RingLayout.for_batch(4, x.nbytes, y.nbytes)
        self.ring = Ring.create(layout)
        self.trainer.request(
            AttachRing(name=self.ring.name, slots=4, slot_bytes=layout.slot_bytes, label_offset=layout.label_offset)
        )
        # Slot 0: filled by the provider, taken by the trainer, then painted with a known pattern.
        seq = self.ring.request(0)
        self.trainer.request(BatchRequest(dataset="mnist", split="train", range=[0, 8], slot=0, seq=seq))
        self.ring.take(0, seq)
        self.in_use_seq = seq
        base = layout.data_offset
        self.slot_bytes = slice(base, base + layout.stride)
        self.ring.segment.buf[self.slot_bytes] = bytes(range(256)) * (layout.stride // 256)
        self.pattern = bytes(self.ring.segment.buf[self.slot_bytes])
        # Slot 1: left FILLED and slot 2 IN_USE under old sequence numbers, so replays have targets.
        self.replays = []
        for slot in (1, 2):
            s = self.ring.request(slot)
            req = BatchRequest(id=10_000 + slot, dataset="mnist", split="train", range=[8, 16], slot=slot, seq=s)
            self.trainer.request(req)
            self.replays.append(encode(req))
        self.ring.take(2, s)
        self.other_ring = Ring.create(layout)  # a second trainer's ring
        self.layout = layout
        self.rss0 = rss()

    def token(self, role: str = "trainer") -> str:
        return self.make_token(role)

    def peer(self, service: str) -> Peer:
        """A bare peer of ``router``, ``provider`` (TCP) or ``provider-local`` (its ipc endpoint)."""
        endpoints = {"router": self.router.endpoint, "provider": self.provider.endpoint, "provider-local": self.local}
        # The previous example's peer says Goodbye: sessions per subject are capped (64).
        last = getattr(self, "_last_peer", None)
        if last is not None:
            last.sock.send_multipart([PROTOCOL, head(type="Goodbye")])
        self._last_peer = Peer(self.raw_dealer, endpoints[service])
        return self._last_peer

    def check(self) -> None:
        """Both services alive and correct, memory bounded, the IN_USE slot untouched."""
        assert self.router.thread.is_alive() and self.provider.thread.is_alive(), "a service loop died"
        assert self.rserver.counters["internal"] == 0 and self.pserver.counters["internal"] == 0, (
            "a handler raised something other than a BusError"
        )
        info = self.trainer.request(DatasetInfoRequest(dataset="mnist"))
        assert isinstance(info, DatasetInfo) and info.info == without_host_keys(self.mnist.info())  # a trainer's view
        reply = self.trainer.request(BatchRequest(dataset="mnist", split="train", range=[0, 8]))
        assert bytes(reply.frames[0]) == self.expected[0] and bytes(reply.frames[1]) == self.expected[1]
        # (on a loaded machine the provider's router link may be reconnecting right now: that is
        # no failure, but it must be registered again within seconds)
        deadline = time.monotonic() + 10
        while True:
            peers = self.admin.request(ListPeers())
            assert isinstance(peers, PeerList)
            if any(p["role"] == "provider" for p in peers.peers):
                break
            assert time.monotonic() < deadline, "the provider is not registered with the router"
            time.sleep(0.1)
        job = self.admin.request(GetJob(job=self.job))
        assert isinstance(job, JobInfo) and job.job["id"] == self.job
        assert bytes(self.ring.segment.buf[self.slot_bytes]) == self.pattern, "IN_USE slot was written"
        assert self.ring.state(0) == 3 and self.ring.seq(0) == self.in_use_seq
        grown = rss() - self.rss0
        assert grown < RSS_BOUND, f"resident memory grew by {grown >> 20} MiB during fuzzing"

    def close(self) -> None:
        self.ring.close()
        self.other_ring.close()


@pytest.fixture(name="world")
def world_fixture(router, provider, raw_dealer, make_token, client_for):
    w = World(router, provider, raw_dealer, make_token, client_for)
    yield w
    w.close()


def drain_all(peer: Peer, server) -> list[dict]:
    """Every reply to what ``peer`` sent, deferred ones too (work on a lane off the serving loop, a batch
    read or an evaluation, is answered after the loop's own replies, a sentinel's included): drain, wait
    until ``server`` holds no deferred reply, drain again (two sentinels)."""
    replies = peer.drain()
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while server._pending and time.monotonic() < deadline:
        time.sleep(0.01)
    return replies + peer.drain()


def fire(world: World, peer: Peer, server, messages: list[list[bytes]]) -> list[dict]:
    """Send, drain, and check that every Error that came back was counted by the server."""
    before, dropped_before = refusals(server), server.counters["send_dropped"]
    for frames in messages:
        peer.send(frames)
    replies = drain_all(peer, server)
    errors = sum(1 for r in replies if r["type"] == "Error") + 2  # + the two sentinels
    # every Error received was counted; one counted but not received is one the server could not hand
    # to a peer whose queue was full (it counts those as send_dropped, and never blocks on them)
    dropped = server.counters["send_dropped"] - dropped_before
    counted = refusals(server) - before
    assert counted - dropped <= errors <= counted, (server.counters, replies[-5:])
    return replies

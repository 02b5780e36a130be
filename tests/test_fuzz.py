"""Hostile input against a real router and a real provider: nothing crashes, leaks, or writes out of turn.

Generated messages (hypothesis) go through bare DEALER sockets to services running in this process on
loopback TCP. After every generated batch the test checks that each service still answers a
well-formed request correctly, that the process's resident memory stays bounded, that a ring slot a
legitimate trainer holds IN_USE never changed, and that every Error sent back was counted.

``tests/fuzz_corpus/*.jsonl`` holds hand-written hostile messages (and past crashes), replayed by a
plain test so they stay covered whatever hypothesis generates.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libbus import PROTOCOL
from libbus.constants import MAX_BATCH_INDICES
from libbus.errors import BusError
from libbus.messages import (
    AttachRing,
    BatchRequest,
    DatasetInfo,
    DatasetInfoRequest,
    GetJob,
    JobInfo,
    ListPeers,
    PeerList,
    Resolve,
    Stats,
    SubmitJob,
    encode,
)
from shm import Ring, RingLayout
from shm.names import SHM_DIR, new_name
from tests.support.fuzz import (
    ABSURD_INTS,
    REPLY_TIMEOUT_S,
    Peer,
    batch_request,
    head,
    nested,
    raw_message,
    refusals,
    rss,
)

CORPUS = Path(__file__).parent / "fuzz_corpus"
FUZZ = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
}
#: Resident memory the whole fuzz run may add to this process (services run in-process).
RSS_BOUND = 300 * 1024 * 1024


# -- the environment: services, a legitimate trainer with a ring, hostile /dev/shm entries -------


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
        assert isinstance(info, DatasetInfo) and info.info == self.mnist.info()
        reply = self.trainer.request(BatchRequest(dataset="mnist", split="train", range=[0, 8]))
        assert bytes(reply.frames[0]) == self.expected[0] and bytes(reply.frames[1]) == self.expected[1]
        peers = self.admin.request(ListPeers())
        assert isinstance(peers, PeerList) and any(p["role"] == "provider" for p in peers.peers)
        job = self.admin.request(GetJob(job=self.job))
        assert isinstance(job, JobInfo) and job.job["id"] == self.job
        assert bytes(self.ring.segment.buf[self.slot_bytes]) == self.pattern, "IN_USE slot was written"
        assert self.ring.state(0) == 3 and self.ring.seq(0) == self.in_use_seq
        grown = rss() - self.rss0
        assert grown < RSS_BOUND, f"resident memory grew by {grown >> 20} MiB during fuzzing"

    def close(self) -> None:
        self.ring.close()
        self.other_ring.close()


@pytest.fixture
def world(router, provider, raw_dealer, make_token, client_for):
    w = World(router, provider, raw_dealer, make_token, client_for)
    yield w
    w.close()


def fire(world: World, peer: Peer, server, messages: list[list[bytes]]) -> list[dict]:
    """Send, drain, and check that every Error that came back was counted by the server."""
    before = refusals(server)
    for frames in messages:
        peer.send(frames)
    replies = peer.drain()
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while server._pending and time.monotonic() < deadline:  # deferred work (Evaluate) finishes
        time.sleep(0.01)
    replies += peer.drain()
    errors = sum(1 for r in replies if r["type"] == "Error") + 2  # + the two sentinels
    assert refusals(server) - before == errors, (server.counters, replies[-5:])
    return replies


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


@settings(max_examples=80, **FUZZ)
@given(batch=st.lists(batch_request(slot_seq=False), min_size=5, max_size=20))
def test_hostile_batch_requests_are_refused_or_exact(world, batch):
    peer = world.peer("provider")
    peer.hello(world.token(), host_id=world.host_id)
    for frames in batch:
        h = orjson.loads(frames[1])
        peer.send(frames)
        replies = peer.drain()
        assert len(replies) == 1, replies
        reply = replies[0]
        if reply["type"] == "BatchResponse":  # then it must be exactly what the source holds
            src = world.handler.datasets[h["dataset"]]
            idx = np.arange(*h["range"], dtype=np.int64) if "range" in h else np.frombuffer(frames[2], "<i8")
            x = np.empty((len(idx), *src.sample_shape), src.dtype)
            y = np.empty((len(idx), *src.label_shape), src.label_dtype)
            src.read_into(h["split"], idx, x, y)
            assert reply["nbytes"] == x.nbytes + y.nbytes
        else:
            assert reply["type"] == "Error" and reply["code"] in {
                "BAD_REQUEST",
                "NOT_FOUND",
                "OUT_OF_RANGE",
                "TOO_LARGE",
                "SPLIT_PRIVATE",
            }, reply
    world.check()


@settings(max_examples=80, **FUZZ)
@given(data=st.data(), who=st.sampled_from(["same", "other", "other-with-ring", "no-hello"]))
def test_slot_requests_never_write_out_of_turn(world, data, who):
    """BatchRequests naming the IN_USE slot (or any slot) with any seq, from any session."""
    before = dict(world.handler.refused)
    if who == "same":
        sock = world.trainer.socket  # the legitimate session itself
        peer = Peer(lambda _: sock, "")
    else:
        peer = world.peer("provider-local" if who == "other-with-ring" else "provider")
        if who != "no-hello":
            peer.hello(world.token(), host_id=world.host_id)
        if who == "other-with-ring":
            lay = world.layout
            peer.send(
                encode(
                    AttachRing(
                        id=5,
                        name=world.other_ring.name,
                        slots=lay.slots,
                        slot_bytes=lay.slot_bytes,
                        label_offset=lay.label_offset,
                    )
                )
            )
            assert peer.drain()[0]["type"] == "RingAttached"
    batch = data.draw(st.lists(batch_request(slot_seq=True), min_size=5, max_size=25))
    # aimed shots at the IN_USE and FILLED slots, with their old sequence numbers and neighbours
    for slot in (0, 1, 2):
        for seq in (world.in_use_seq, world.in_use_seq + 1, world.ring.seq(slot), 0, -1, 2**64 - 1):
            batch.append(
                [
                    PROTOCOL,
                    head(type="BatchRequest", id=7, dataset="mnist", split="train", range=[0, 8], slot=slot, seq=seq),
                ]
            )
    if who == "same":
        batch += world.replays + world.replays[::-1]  # replayed and reordered
    replies = fire(world, peer, world.pserver, batch)
    written = [r for r in replies if r["type"] == "BatchResponse" and r.get("slot") is not None]
    assert not written or who == "other-with-ring", written
    stale = sum(1 for r in replies if r["type"] == "Error" and "batch not written" in r["message"])
    assert world.handler.refused["stale_slot"] - before.get("stale_slot", 0) == stale
    world.check()


@pytest.fixture
def hostile_shm(world):
    """Entries in /dev/shm under valid ring names that are not rings the caller may use."""
    made = []
    lay = world.layout

    def add(kind: str) -> str:
        name = new_name()
        path = SHM_DIR / name
        if kind == "fifo":
            os.mkfifo(path, 0o600)
        elif kind == "dir":
            path.mkdir(0o700)
        elif kind == "symlink":
            path.symlink_to(world.ring.segment.path)
        elif kind == "world-readable":
            path.write_bytes(bytes(world.ring.segment.buf[: lay.size]))
            path.chmod(0o644)
        elif kind == "bad-magic":
            path.write_bytes(b"\xff" * lay.size)
            path.chmod(0o600)
        elif kind == "empty":
            path.touch(0o600)
        elif kind == "short":
            path.write_bytes(bytes(world.ring.segment.buf[:100]))
            path.chmod(0o600)
        elif kind == "socket":
            import socket

            s = socket.socket(socket.AF_UNIX)
            s.bind(str(path))
            s.close()
        made.append(path)
        return name

    yield add
    for path in made:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink(missing_ok=True)


SHM_KINDS = ["fifo", "dir", "symlink", "world-readable", "bad-magic", "empty", "short", "socket"]


@settings(max_examples=50, **FUZZ)
@given(data=st.data())
def test_hostile_attach_ring_is_refused_and_counted(world, hostile_shm, data):
    peer = world.peer("provider-local")
    peer.hello(world.token(), host_id=world.host_id)
    lay = world.layout
    names = data.draw(
        st.lists(
            st.one_of(
                st.sampled_from(
                    [
                        "../../etc/passwd",
                        "/dev/shm/" + world.ring.name,
                        world.ring.name + "/..",
                        world.ring.name + "\n",
                        "batchbus-0-0000000000000000",
                        "batchbus-1-ffffffffffffffff",
                        "",
                        ".",
                        "..",
                        "a" * 5000,
                        "batchbus-1-" + "0" * 15 + "/",
                    ]
                ),
                st.text(max_size=40),
                st.sampled_from(SHM_KINDS).map(hostile_shm),
            ),
            min_size=3,
            max_size=10,
        )
    )
    before = refusals(world.pserver)
    for name in names:
        geometry = data.draw(
            st.one_of(
                st.just((lay.slots, lay.slot_bytes, lay.label_offset)),
                st.tuples(ABSURD_INTS, ABSURD_INTS, ABSURD_INTS),
                st.tuples(st.integers(0, 65), st.integers(0, 1 << 31), st.integers(-64, 1 << 20)),
            )
        )
        peer.send(
            [
                PROTOCOL,
                head(
                    type="AttachRing",
                    id=3,
                    name=name,
                    slots=geometry[0],
                    slot_bytes=geometry[1],
                    label_offset=geometry[2],
                ),
            ]
        )
    replies = peer.drain()
    assert [r["type"] for r in replies] == ["Error"] * len(names), replies
    # at least: a concurrent peer's refusal may land in the same window (seen once, not diagnosed)
    assert refusals(world.pserver) - before >= len(names) + 1
    world.check()


@settings(max_examples=60, **FUZZ)
@given(
    bit=st.integers(0, 10_000),
    role=st.sampled_from(["trainer", "admin", "provider"]),
    service=st.sampled_from(["router", "provider"]),
)
def test_tokens_with_a_flipped_bit_open_no_session(world, bit, role, service):
    token = world.token(role).encode()
    pos, b = (bit // 8) % len(token), bit % 8
    bad = bytearray(token)
    bad[pos] ^= 1 << b
    peer = world.peer(service)
    try:
        text = bad.decode()
    except UnicodeDecodeError:
        text = bad.decode("latin-1")
    peer.send([PROTOCOL, head(type="Hello", id=1, role=role, name="flip", token=text, host_id=world.host_id)])
    peer.send([PROTOCOL, head(type="ListPeers", id=2)])
    peer.send([PROTOCOL, head(type="DatasetInfoRequest", id=3, dataset="mnist")])
    replies = peer.drain()
    if replies[0]["type"] == "Welcome":  # only if the flip changed nothing the signature covers
        assert _same_jwt(token.decode(), text), f"a token with bit {bit} flipped was accepted"
    else:
        assert [r["type"] for r in replies] == ["Error"] * 3, replies
        assert replies[0]["code"] in {"AUTH_INVALID", "AUTH_EXPIRED"}
        assert replies[1]["code"] == replies[2]["code"] == "AUTH_REQUIRED"
    world.check()


def _same_jwt(a: str, b: str) -> bool:
    """Base64url's spare low bits in a segment's last character decode to the same bytes."""

    def parts(t):
        try:
            return [base64.urlsafe_b64decode(p + "=" * (-len(p) % 4)) for p in t.split(".")]
        except Exception:  # noqa: BLE001
            return None

    return parts(a) is not None and parts(a) == parts(b)


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
        reply = peer.drain()[0]
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


def corpus_frames(case: dict) -> list[bytes]:
    """A corpus message: ``hex`` frames, or ``json`` headers, or ``nest`` (deeply nested field)."""
    frames = []
    for f in case["frames"]:
        if "hex" in f:
            frames.append(bytes.fromhex(f["hex"]))
        elif "json" in f:
            frames.append(orjson.dumps(f["json"]))
        elif "text" in f:
            frames.append(f["text"].encode())
        elif "nest" in f:  # {"nest": [depth, kind], "into": header, "at": field}
            depth, kind = f["nest"]
            body = orjson.dumps(f["into"])[:-1] + f',"{f["at"]}":'.encode() + nested(depth, kind) + b"}"
            frames.append(body)
        elif "repeat" in f:
            frames.append(bytes.fromhex(f["repeat"][0]) * f["repeat"][1])
    return frames


@pytest.mark.parametrize("case", corpus_cases())
def test_seed_corpus(world, case):
    """Each line: which service, which session (none/trainer/admin/provider, heartbeat caps), the
    messages to send, then a well-formed request that must still be answered."""
    peer = world.peer(case["service"])
    if case.get("session"):
        role = case["session"]
        caps = case.get("caps", {})
        if role == "provider":
            caps = {"endpoint": "tcp://127.0.0.1:1", "datasets": {}, **caps}
        peer.hello(world.token(role), role, host_id=world.host_id, caps=caps)
    if case.get("hello_text"):  # a Hello written out by hand; %TOKEN% is a valid token of its role
        hello = orjson.loads(case["hello_text"].replace("%TOKEN%", "x"))
        peer.send([PROTOCOL, case["hello_text"].replace("%TOKEN%", world.token(hello["role"])).encode()])
        assert peer.drain()[-1]["type"] == case.get("hello_expect", "Welcome")
    server = world.rserver if case["service"] == "router" else world.pserver
    fire(world, peer, server, [corpus_frames(msg) for msg in case["messages"]])
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
    world.check()
    assert server.counters["internal"] == 0
